"""Shared helpers for the runner tests: build runners, drive rounds, compare bits."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch

from prefixd.gpu.loading import load_checkpoint
from prefixd.gpu.runner import ModelRunner
from prefixd.scheduler.records import Capture, LaneWork, RoundPlan, SamplerSetup, SamplingParams
from tests.helpers.device import TEST_DEVICE

DEVICE = torch.device(TEST_DEVICE)
PAGE = 16


def lane_pages(lane: int) -> tuple[int, ...]:
    """Lane `lane`'s own 20 pages (320 rows) in a runner of 8 * 20 pages."""
    return pages(20 * lane)


def make_runner(spec: str | Path, dtype: torch.dtype, *, num_lanes: int = 8, num_pages: int = 160,
                page_size: int = PAGE, device: torch.device = DEVICE, mode: str = "invariant",
                programs: str = "auto") -> ModelRunner:
    ckpt = load_checkpoint(spec, device=device, dtype=dtype)
    return ModelRunner(ckpt, device=device, dtype=dtype, num_lanes=num_lanes, num_pages=num_pages,
                       page_size=page_size, mode=mode, programs=programs)


def pages(first: int, n: int = 20) -> tuple[int, ...]:
    """A page table of n consecutive page ids from `first`."""
    return tuple(range(first, first + n))


@lru_cache(maxsize=None)
def prompt(n: int, seed: int = 0, vocab: int = 49152) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(int(t) for t in torch.randint(0, vocab, (n,), generator=g))


def work(lane: int, start: int, tokens: Sequence[int], table: tuple[int, ...], *, prefill: bool = True,
         all_logits: bool = True) -> LaneWork:
    n = len(tokens)
    return LaneWork(lane=lane, start=start, tokens=tuple(tokens), page_table=table, prefill=prefill,
                    logits_rows=tuple(range(n)) if all_logits else (n - 1,))


def run_chunks(runner: ModelRunner, lane: int, tokens: Sequence[int], table: tuple[int, ...],
               chunks: Sequence[int], start: int = 0) -> torch.Tensor:
    """Prefill `tokens` from `start` in consecutive chunks of the given sizes; (n, vocab) logits."""
    out, at = [], 0
    for size in chunks:
        piece = tokens[at : at + size]
        res = runner.run_round(RoundPlan((work(lane, start + at, piece, table),)))
        out.append(res.lanes[0].logits)
        at += size
    if at != len(tokens):
        raise ValueError(f"chunks cover {at} of {len(tokens)} tokens")
    return torch.cat(out)


def start_sampler(runner: ModelRunner, lane: int, history: Sequence[int] = (),
                  sampling: SamplingParams = SamplingParams()) -> None:
    """A round with only a sampler set-up for `lane` (what the engine plans when it seats a stream)."""
    runner.run_round(RoundPlan(samplers=(SamplerSetup(lane, sampling, tuple(history)),)))


def capture(runner: ModelRunner, lane: int, cut: int = 0):
    """A round with only a capture of `lane`'s state; returns the state."""
    return runner.run_round(RoundPlan(captures=(Capture(lane, cut),))).captured[0].state


def kv_equal(a: ModelRunner, table_a: Sequence[int], b: ModelRunner, table_b: Sequence[int], n: int) -> bool:
    for layer in range(a.kv.num_layers):
        ka, va = a.kv_rows(layer, table_a, n)
        kb, vb = b.kv_rows(layer, table_b, n)
        if not (torch.equal(ka, kb) and torch.equal(va, vb)):
            return False
    return True


def run_program_refusing_host_reads(runner: ModelRunner, lanes: Sequence[LaneWork], monkeypatch) -> None:
    """Load `lanes` into the runner's decode program for them and run it (in inference mode,
    as run_round does) with every way of reading a tensor's value into Python refused: what a
    CUDA graph cannot capture (a device sync)."""
    with torch.inference_mode():
        program = runner.programs.pick(lanes)
        program.load(lanes)

        def refuse(*args, **kwargs):
            raise AssertionError("a decode program read a device value on the host")

        for name in ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__"):
            monkeypatch.setattr(torch.Tensor, name, refuse)
        program._run()
