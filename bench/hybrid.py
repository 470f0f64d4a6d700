"""Hybrid (Qwen3.5-style) benchmark: a random model through the round runner.

    python bench/hybrid.py            # the full table (a ~0.5B model; minutes on an idle machine)
    python bench/hybrid.py --quick    # a smoke run: a small model and short prompts
    python bench/hybrid.py --device cuda
    python bench/hybrid.py --gdn-only     # only the chunked vs token-by-token GDN rows
    python bench/hybrid.py --trace        # only the reply re-prefill on the agent trace

Prints markdown tables: prefill tok/s at 512/2048/4096, decode tok/s at 1 and 8 lanes,
snapshot bytes per cut and capture/restore time against a plain copy of the same bytes,
the chunked Gated DeltaNet form against token-by-token recurrence at 4096 rows, and the
reply re-prefill per turn of the quick agent trace replayed through a daemon
(bench/hybrid_trace.py).
Medians of several repeats; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import hybrid_trace  # noqa: E402
from bench.common import fmt_rate, markdown_table, median, print_machine, rate, time_calls  # noqa: E402
from prefixd.gpu.families import gdn  # noqa: E402
from prefixd.gpu.families.qwen3_5_config import (hybrid_config_from_hf, hybrid_tensor_shapes,  # noqa: E402
                                                 model_config)
from prefixd.gpu.families.qwen3_5_tiny import random_tensors  # noqa: E402
from prefixd.gpu.runner import ModelRunner  # noqa: E402
from prefixd.scheduler.records import (Capture, LaneWork, Restore, RoundPlan, SamplerSetup,  # noqa: E402
                                       SamplingParams)

# Shaped like the smallest Qwen3.5 text model: 3 Gated DeltaNet layers per gated-attention
# layer, 16 GDN heads of 128x128 state, 8 query / 2 KV heads of 256 (a quarter rotary);
# 0.65B parameters, 0.50B without the (tied) embeddings.
SMALL_QWEN3_5 = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=16, tie_word_embeddings=True, max_position_embeddings=32768,
)
QUICK_MODEL = dict(SMALL_QWEN3_5, vocab_size=8192, hidden_size=256, intermediate_size=512,
                   num_hidden_layers=4, num_attention_heads=4, head_dim=64,
                   linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=64,
                   linear_value_head_dim=64)


@dataclass(frozen=True)
class Sizes:
    prefill: tuple[int, ...]
    grid: int  # prefill chunk length G
    lane_context: int  # context of each decoding lane
    decode_steps: int
    recurrence_rows: int  # rows for chunked vs token-by-token
    repeats: int


FULL = Sizes(prefill=(512, 2048, 4096), grid=512, lane_context=512, decode_steps=16,
             recurrence_rows=4096, repeats=3)
QUICK = Sizes(prefill=(128, 256), grid=128, lane_context=64, decode_steps=4,
              recurrence_rows=512, repeats=2)
PAGE = 16


_WEIGHTS: dict[tuple[int, torch.dtype], dict] = {}


def _runner(fields: dict, device: torch.device, dtype: torch.dtype, lanes: int, rows: int) -> ModelRunner:
    config = hybrid_config_from_hf(fields)
    key = (id(fields), dtype)  # random weights are made once per model and dtype
    if key not in _WEIGHTS:
        _WEIGHTS[key] = random_tensors(config, seed=0, dtype=dtype)
    tensors = _WEIGHTS[key]
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    checkpoint = SimpleNamespace(config=model_config(config), tensors=tensors, tokenizer=None,
                                 weights_bytes=weights)
    pages = lanes * (-(-rows // PAGE))
    runner = ModelRunner(checkpoint, device=device, dtype=dtype, num_lanes=lanes,
                         num_pages=pages, page_size=PAGE)
    runner.run_round(RoundPlan(samplers=tuple(SamplerSetup(lane, SamplingParams(), ()) for lane in range(lanes))))
    return runner


def _pages(lane: int, rows: int) -> tuple[int, ...]:
    per = -(-rows // PAGE)
    return tuple(range(lane * per, (lane + 1) * per))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _prefill(runner: ModelRunner, lane: int, n: int, grid: int, rows: int) -> None:
    vocab = runner.config.vocab_size
    for lo in range(0, n, grid):
        hi = min(n, lo + grid)
        tokens = tuple((7 * i + 3) % vocab for i in range(lo, hi))
        last = (hi - lo - 1,) if hi == n else ()
        runner.run_round(RoundPlan((LaneWork(lane, lo, tokens, _pages(lane, rows), True,
                                             sample_rows=last),)))
    _sync(runner.device)


def bench_prefill(fields, sizes, device, dtype) -> list[list[str]]:
    rows = max(sizes.prefill)
    runner = _runner(fields, device, dtype, 1, rows)
    out = []
    for n in sizes.prefill:
        def run() -> None:
            runner.run_round(RoundPlan(resets=(0,)))
            _prefill(runner, 0, n, sizes.grid, rows)
        out.append([f"prefill {n}", fmt_rate(rate(n, time_calls(run, sizes.repeats)))])
    return out


def bench_decode(fields, sizes, device, dtype) -> list[list[str]]:
    out = []
    rows = sizes.lane_context + sizes.decode_steps * (sizes.repeats + 1) + 1
    for lanes in (1, 8):
        runner = _runner(fields, device, dtype, lanes, rows)
        for lane in range(lanes):
            _prefill(runner, lane, sizes.lane_context, sizes.grid, rows)
        pos = [sizes.lane_context] * lanes

        def run() -> None:
            for _ in range(sizes.decode_steps):
                works = tuple(LaneWork(lane, pos[lane], (5,), _pages(lane, rows), False,
                                       sample_rows=(0,)) for lane in range(lanes))
                runner.run_round(RoundPlan(works))
                for lane in range(lanes):
                    pos[lane] += 1
            _sync(device)
        out.append([f"decode, {lanes} lane(s), ctx {sizes.lane_context}",
                    fmt_rate(rate(lanes * sizes.decode_steps, time_calls(run, sizes.repeats)))])
    return out


def bench_snapshot(fields, sizes, device, dtype) -> list[list[str]]:
    runner = _runner(fields, device, dtype, 2, sizes.grid)
    _prefill(runner, 0, sizes.grid, sizes.grid, sizes.grid)
    state_bytes = runner.info.lane_state_bytes
    capture = RoundPlan(captures=(Capture(0, sizes.grid),))
    snap = runner.run_round(capture).captured[0].state
    restore = RoundPlan(restores=(Restore(1, snap),))
    src = torch.zeros(state_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    reps = max(5, 5 * sizes.repeats)
    capture_s = median(time_calls(lambda: (runner.run_round(capture), _sync(device)), reps))
    restore_s = median(time_calls(lambda: (runner.run_round(restore), _sync(device)), reps))
    clone_s = median(time_calls(lambda: (src.clone(), _sync(device)), reps))
    copy_s = median(time_calls(lambda: (dst.copy_(src), _sync(device)), reps))
    logits_row = runner.info.logits_row_bytes
    return [
        ["lane state bytes (recurrent + conv)", f"{state_bytes:,}"],
        ["snapshot bytes per cut (state + logits row)", f"{state_bytes + logits_row:,}"],
        ["KV bytes per page (full-attention layers)", f"{runner.info.kv_bytes_per_page:,}"],
        ["capture ms / memcpy-alloc ms", f"{capture_s * 1e3:.3f} / {clone_s * 1e3:.3f} "
                                         f"({capture_s / clone_s:.2f}x)"],
        ["restore ms / memcpy ms", f"{restore_s * 1e3:.3f} / {copy_s * 1e3:.3f} "
                                   f"({restore_s / copy_s:.2f}x)"],
    ]


def bench_recurrence(fields, sizes, device) -> list[list[str]]:
    config = hybrid_config_from_hf(fields)
    gen = torch.Generator().manual_seed(0)
    rows, heads = sizes.recurrence_rows, config.lin_num_v_heads
    shape_k, shape_v = (rows, heads, config.lin_k_dim), (rows, heads, config.lin_v_dim)
    q = (gdn.l2_normalize(torch.randn(shape_k, generator=gen)) * config.lin_k_dim ** -0.5).to(device)
    k = gdn.l2_normalize(torch.randn(shape_k, generator=gen)).to(device)
    v = torch.randn(shape_v, generator=gen).to(device)
    g = (-torch.rand(rows, heads, generator=gen)).to(device)
    beta = torch.rand(rows, heads, generator=gen).to(device)
    state = torch.zeros(heads, config.lin_k_dim, config.lin_v_dim, device=device)

    def steps() -> None:
        s = state.unsqueeze(0)
        for t in range(rows):
            _, s = gdn.step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
        _sync(device)

    # both forms are quick to run: more repeats give steadier medians
    chunked_s = median(time_calls(lambda: (gdn.chunked(q, k, v, g, beta, state), _sync(device)),
                                  3 * sizes.repeats))
    steps_s = median(time_calls(steps, sizes.repeats))
    return [[f"GDN layer, {rows} rows, chunked form", fmt_rate(rows / chunked_s)],
            [f"GDN layer, {rows} rows, token by token", fmt_rate(rows / steps_s)],
            ["chunked speed-up", f"{steps_s / chunked_s:.1f}x"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, short prompts")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--gdn-only", action="store_true",
                        help="only the GDN layer rows (chunked vs token by token)")
    parser.add_argument("--trace", action="store_true",
                        help="only the reply re-prefill on the quick agent trace (through a daemon)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    fields = QUICK_MODEL if args.quick else SMALL_QWEN3_5
    sizes = QUICK if args.quick else FULL
    config = hybrid_config_from_hf(fields)
    shapes = hybrid_tensor_shapes(config)
    params = sum(math.prod(shape) for shape in shapes.values())
    embed = math.prod(shapes["model.embed_tokens.weight"])
    print_machine({"dtype": args.dtype, "model": f"random qwen3_5, {params / 1e6:.0f}M parameters "
                                                  f"({(params - embed) / 1e6:.0f}M without embeddings)"})
    print(markdown_table(["config", "value"], sorted((k, str(v)) for k, v in fields.items())))
    print()
    with torch.inference_mode():
        if args.gdn_only:
            print(markdown_table(["recurrence", "rows/s"], bench_recurrence(fields, sizes, device)))
            return
        if not args.trace:
            rows = bench_prefill(fields, sizes, device, dtype)
            rows += bench_decode(fields, sizes, device, dtype)
            print(markdown_table(["throughput", "tok/s"], rows))
            print()
            print(markdown_table(["snapshot", "value"], bench_snapshot(fields, sizes, device, dtype)))
            print()
            print(markdown_table(["recurrence", "rows/s"], bench_recurrence(fields, sizes, device)))
            print()
        if device.type == "cpu":  # the daemon the trace goes through serves on the CPU
            print(hybrid_trace.table(hybrid_trace.measure(fields, dtype)))


if __name__ == "__main__":
    main()
