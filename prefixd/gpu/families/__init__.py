"""Model families at run time: the `FamilyModel` protocol the runner drives, and building one.

Which code runs a checkpoint's `config.family`, and in which numeric modes, is part of the
family's one record in `prefixd.gpu.config` (`register_family(..., build=, modes=)`), beside
its config parsers and GGUF tensor map. Built in: llama, qwen2, qwen3
(`prefixd.gpu.model.build_llama`); qwen3_5 (`families.qwen3_5.build_qwen3_5`).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Protocol

import torch

from prefixd.gpu import cpu_kernels
from prefixd.gpu.config import family_record, registered_families
from prefixd.gpu.kv_pool import KVPool


class FamilyModel(Protocol):
    """What the runner needs from a model family.

    Attention layers keep K/V in the runner's KVPool (`num_kv_layers` of them, indexed
    0..num_kv_layers-1 in the family's layer order). Anything else a lane carries between
    rounds (recurrent and conv state) is the family's lane state, one per lane, created by
    `new_lane_states` and touched only by forward, capture, restore and reset.
    """

    config: Any  # ModelConfig
    dtype: torch.dtype
    mode: str  # the numeric mode it runs ("invariant", "int4")
    num_kv_layers: int
    invariant_rows: bool  # True: every row's bits are invariant (decode == prefill)
    attention_tiles: bool  # True: forward reads `RoundInputs.tiles` (the runner plans them)
    lane_state_bytes: int  # bytes of one lane's state (0: attention only)
    workspace_bytes_per_row: int
    # True when `forward` and `logits` may run as fixed programs (gpu/programs.py: inputs in
    # static buffers, `RoundInputs.max_position` set, no device value read on the host)
    decode_programs: bool
    # optional, for programs: `program_rows`, the rows a lane may bring to one (default: up to
    # attention.DECODE_ROWS); `program_prefill`, whether a prefill chunk that small may run in
    # one (default True); `before_program(lanes)`, host bookkeeping before a program's round

    def new_lane_states(self, num_lanes: int) -> None:
        """Allocate zeroed state for lanes 0..num_lanes-1."""

    def padded_rows(self, n: int) -> int:
        """Rows to compute so that each of n rows has its invariant bits (>= n)."""

    def forward(self, inputs: Any, kv: KVPool) -> torch.Tensor:
        """Run a round (`model.RoundInputs`): writes K/V of every real row, advances the
        state of every lane in it, returns final-normed fp32 hidden (padded_rows, hidden)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 (n, vocab) logits of final-normed hidden rows."""

    def capture(self, lane: int) -> Any:
        """A copy of the lane's state (an object with `nbytes`)."""

    def restore(self, lane: int, state: Any) -> int:
        """Overwrite the lane's state with a capture; returns bytes copied."""

    def reset(self, lane: int) -> None:
        """Zero the lane's state."""


# "auto": int4 where the family has it on CPU bf16 (docs/benchmarks.md), else invariant
CPU_DEFAULT_MODE = "int4"


# A mode's revision: bumped whenever what decides its bits changes (the int4 lm_head became two
# 4-bit layers and its rounds lost their padding: revision 2; CPU library products moved to one
# thread: invariant 2, int4 3; bf16 products in calls of fixed rows on CPUs with AMX:
# invariant 3; int4 on prefixd's own kernel, 8-bit activations and w = q * scale + base: int4 4;
# int4's attention reduces a row's keys in fixed chunks of 512, joined after: int4 5; its scores
# are dim-pair fma chains (the AVX-512 BF16 dot product's steps) over K pages laid out in dim
# pairs, q and k flushed below 2^-30: int4 6; the hybrid family's products and rope became the
# shared ones, its rope in fp32: invariant 4; on CUDA, paged flash attention with an online
# max and the fused norm, rope and SiLU kernels, flash's key blocks and warps by head width:
# invariant 5; int4's group scales and bases kept as fp16, a GGUF's own, where bf16 rounded
# them: int4 7; the int4 lm_head reads two 8-bit codes of each activation, its codes and those
# of their rounding error: int4 8; int4's KV pool holds 8-bit pages, K and V as codes with a
# scale per 32 dims, and its attention scores q's codes against K's in integers: int4 9; its
# value sums take each weight (e times the V scale) rounded to bf16, two keys a BF16 dot-product
# step: int4 10), so that the disk tier, which keys on `mode_identity`, never serves rows
# computed by an earlier revision.
MODE_REVISIONS = {"invariant": 5, "int4": 10}


def mode_identity(mode: str) -> str:
    """The name the disk tier keys a mode's rows on: the mode and its revision ("int4@2")."""
    if mode not in MODE_REVISIONS:
        raise ValueError(f"mode {mode!r} has no revision (have: {', '.join(MODE_REVISIONS)})")
    return f"{mode}@{MODE_REVISIONS[mode]}"


def family_modes(family: str) -> tuple[str, ...]:
    """The numeric modes the family's model code has (its `FamilyRecord`); () when unknown."""
    record = family_record(family)
    return record.modes if record is not None and record.build else ()


def resolve_mode(mode: str, family: str, device: torch.device, dtype: torch.dtype) -> str:
    """`mode` itself, or for "auto" the family's default on this device and dtype."""
    if mode != "auto":
        return mode
    cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
    if not (cpu_bf16 and CPU_DEFAULT_MODE in family_modes(family)):
        return "invariant"
    if cpu_kernels.fast():
        return CPU_DEFAULT_MODE
    why = cpu_kernels.available()[1] or "mode int4's kernels have no fast path on this CPU (it needs AVX-512 VNNI)"
    print(f"prefixd: --mode auto runs the invariant mode: {why}", file=sys.stderr, flush=True)
    return "invariant"


def build_family(checkpoint: Any, device: torch.device, dtype: torch.dtype,
                 mode: str = "invariant") -> FamilyModel:
    """The FamilyModel for `checkpoint.config.family` in `mode` ("auto": `resolve_mode`), built
    by the family record's model code; ValueError when the family has none or not that mode."""
    family = checkpoint.config.family
    record = family_record(family)
    if record is None or not record.build:
        raise ValueError(f"no model code for family {family!r}; have {sorted(registered_families())}")
    mode = resolve_mode(mode, family, device, dtype)
    if mode not in record.modes:
        raise ValueError(f"family {family!r} has no mode {mode!r} (have: {', '.join(record.modes)})")
    module, _, name = record.build.partition(":")
    return getattr(importlib.import_module(module), name)(checkpoint, device, dtype, mode)
