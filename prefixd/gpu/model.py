"""The llama-style decoder (families llama, qwen2, qwen3) over the paged KV pool.

Per layer, every row of the round in one batch::

    x = rms(h) -> qkv (one fused GEMM, + bias: qwen2) -> q/k rms per head (qwen3) -> rope
      -> K, V into the pool -> blocked attention per tile -> o_proj -> h += .
    x = rms(h) -> gate|up (one fused GEMM) -> silu(gate) * up -> down -> h += .

The residual stream, norms, rope, attention and the SiLU product are fp32; GEMM inputs and
weights are in the compute dtype (bf16 by default) and their outputs come back as fp32.
Mode "int4" keeps the four projections of every layer as 4-bit group-32 codes (linear.py);
embeddings and the lm_head stay in the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from prefixd.gpu import kernels
from prefixd.gpu.attention import AttentionSpan, AttentionTile, attend
from prefixd.gpu.config import ModelConfig
from prefixd.gpu.kv_pool import KVPool
from prefixd.gpu.linear import (Weight, fuse, invariant_rows, linear, pad_rows, quantize_int4,
                               quantize_int4_residual)
from prefixd.gpu.rope import RopeTable, rotate, rotation_tables


@dataclass(frozen=True)
class RoundInputs:
    """Everything a family's forward reads about one round, built once by the runner.

    Rows are the round's lanes concatenated; `tokens`/`positions` may carry padding rows
    past `num_rows` (token 0, position 0) that are computed and ignored.
    """

    tokens: torch.Tensor  # (padded_rows,) long
    positions: torch.Tensor  # (padded_rows,) long
    num_rows: int
    slots: torch.Tensor  # (num_rows,) long: page * page_size + offset of each real row
    spans: tuple[AttentionSpan, ...]  # one per lane, in plan order
    lanes: tuple[int, ...]  # lane id of each span
    prefill: tuple[bool, ...]  # per span: a prefill chunk (True) or decode/verify rows
    tiles: tuple[AttentionTile, ...]
    images: tuple[tuple[torch.Tensor, torch.Tensor], ...] = field(default=())  # (row idx, rows f32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight.

    On CPU torch's fused rms_norm gives the composite's bits in one op (tests/gpu/test_ops.py);
    on CUDA the mean runs in kernels.py's fixed order.
    """
    if not x.is_cuda:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return x * torch.rsqrt(kernels.mean_last(x.pow(2)) + eps) * weight


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight
    down: Weight


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise KeyError(f"checkpoint has no tensor {name!r}")
    return tensors.pop(name)


MODES = ("invariant", "int4")


def check_mode(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """ValueError unless `mode` runs on this device and dtype ("int4": CPU, bf16 only)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not available (have: {', '.join(MODES)})")
    if mode == "int4" and (device.type != "cpu" or dtype != torch.bfloat16):
        raise ValueError(f"mode 'int4' runs on the CPU in bf16 only (got {device.type}, {dtype})")


class LlamaModel:
    """FamilyModel for llama / qwen2 / qwen3 (attention only: every row is invariant).

    Takes ownership of `tensors`: projections are fused and the originals dropped from it.
    """

    invariant_rows = True
    lane_state_bytes = 0

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], *,
                 device: torch.device, dtype: torch.dtype, mode: str = "invariant") -> None:
        check_mode(mode, device, dtype)
        self.config = config
        self.device = device
        self.dtype = dtype
        self.mode = mode
        self.num_kv_layers = config.num_layers
        f32 = lambda t: t.to(device=device, dtype=torch.float32)  # noqa: E731
        lin = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
        self.embed = lin(_take(tensors, "model.embed_tokens.weight"))
        head = self.embed if config.tie_embeddings else lin(_take(tensors, "lm_head.weight"))
        tensors.pop("lm_head.weight", None)
        self.lm_head: Weight = quantize_int4_residual(head) if mode == "int4" else head
        self.final_norm = f32(_take(tensors, "model.norm.weight"))
        self.layers = [self._layer(tensors, i, f32, lin) for i in range(config.num_layers)]
        self.rope = RopeTable(config, device=device)
        self.scale = 1.0 / math.sqrt(config.head_dim)

    def _layer(self, t: dict[str, torch.Tensor], i: int, f32, lin) -> _Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        pack = quantize_int4 if self.mode == "int4" else lin
        qkv = fuse([_take(t, a + f"{n}_proj.weight").to(self.dtype) for n in "qkv"])
        bias = None
        if self.config.attention_bias:
            bias = f32(torch.cat([_take(t, a + f"{n}_proj.bias").float() for n in "qkv"]))
        qn = f32(_take(t, a + "q_norm.weight")) if self.config.qk_norm else None
        kn = f32(_take(t, a + "k_norm.weight")) if self.config.qk_norm else None
        gate_up = fuse([_take(t, p + f"mlp.{n}_proj.weight").to(self.dtype) for n in ("gate", "up")])
        return _Layer(
            input_norm=f32(_take(t, p + "input_layernorm.weight")), qkv=pack(qkv), qkv_bias=bias,
            q_norm=qn, k_norm=kn, o=pack(lin(_take(t, a + "o_proj.weight"))),
            post_norm=f32(_take(t, p + "post_attention_layernorm.weight")),
            gate_up=pack(gate_up), down=pack(lin(_take(t, p + "mlp.down_proj.weight"))))

    # FamilyModel: lane state (none for attention-only families)
    def new_lane_states(self, num_lanes: int) -> None:
        return None

    def capture(self, lane: int) -> "EmptyState":
        return EmptyState()

    def restore(self, lane: int, state: object) -> int:
        return 0

    def reset(self, lane: int) -> None:
        return None

    @property
    def workspace_bytes_per_row(self) -> int:
        """fp32 activations one prefill row keeps alive inside a layer (upper estimate)."""
        c = self.config
        qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        return 4 * (4 * c.hidden_size + 2 * qkv + 3 * c.intermediate_size)

    def padded_rows(self, n: int) -> int:
        """int4: n (its one kernel is invariant at every M); else the compute dtype's minimum."""
        return n if self.mode == "int4" else invariant_rows(n, self.dtype)

    def embed_rows(self, inputs: RoundInputs) -> torch.Tensor:
        """(padded_rows, hidden) fp32 input embeddings; image rows replace their tokens'."""
        h = self.embed.index_select(0, inputs.tokens)
        for rows_idx, rows in inputs.images:
            h.index_copy_(0, rows_idx, rows.to(self.dtype))
        return h.float()

    def forward(self, inputs: RoundInputs, kv: KVPool) -> torch.Tensor:
        """Run every layer; writes K/V of the real rows; returns final-normed fp32 hidden."""
        c = self.config
        h = self.embed_rows(inputs)  # (rows, hidden) fp32, a fresh tensor: updated in place
        cos, sin = rotation_tables(*self.rope.lookup(inputs.positions))  # (rows, 1, head_dim) each
        for i, layer in enumerate(self.layers):
            h += self._attention(i, layer, rms_norm(h, layer.input_norm, c.rms_norm_eps), cos, sin, inputs, kv)
            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)
            h += linear(torch.nn.functional.silu(gate) * up, layer.down)
        return rms_norm(h, self.final_norm, c.rms_norm_eps)

    def _attention(self, i: int, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   inputs: RoundInputs, kv: KVPool) -> torch.Tensor:
        c = self.config
        qkv = linear(x, layer.qkv, layer.qkv_bias)
        qk_dim = (c.num_heads + c.num_kv_heads) * c.head_dim
        qk = qkv[:, :qk_dim].unflatten(-1, (c.num_heads + c.num_kv_heads, c.head_dim))  # (rows, H + KV, hd)
        v = qkv[:, qk_dim:].unflatten(-1, (c.num_kv_heads, c.head_dim))
        if layer.q_norm is None:
            qk = rotate(qk, cos, sin)  # q and k heads in one pass: rope is per head
            q, k = qk[:, : c.num_heads] * self.scale, qk[:, c.num_heads :]
        else:
            q = rotate(rms_norm(qk[:, : c.num_heads], layer.q_norm, c.rms_norm_eps), cos, sin) * self.scale
            k = rotate(rms_norm(qk[:, c.num_heads :], layer.k_norm, c.rms_norm_eps), cos, sin)
        n = inputs.num_rows
        kv.write(i, inputs.slots, k[:n], v[:n])
        out = attend(q, kv.k[i], kv.v[i], inputs.tiles)
        return linear(out, layer.o)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, vocab) fp32 logits of final-normed hidden rows (n, hidden)."""
        n = hidden.shape[0]
        return linear(pad_rows(hidden, self.padded_rows(n)), self.lm_head)[:n]


class EmptyState:
    """The lane state of an attention-only family: nothing."""

    nbytes = 0


def build_llama(checkpoint, device: torch.device, dtype: torch.dtype, mode: str) -> LlamaModel:
    return LlamaModel(checkpoint.config, checkpoint.tensors, device=device, dtype=dtype, mode=mode)

