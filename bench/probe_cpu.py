"""CPU probe: are the CPU products (torch's weight-packed int4 / int8 matmuls, prefixd's own int4
kernel, bf16 / fp32 GEMMs) row-invariant, and how fast are they?

    python bench/probe_cpu.py            # invariance over M = 1..64 and larger, then timings
    python bench/probe_cpu.py --quick    # fewer row counts, fewer repeats
    python bench/probe_cpu.py --threads 1,2   # the invariance tables at each torch thread count
    python bench/probe_cpu.py --timings-only  # only the timings (what a row more costs)

For each kernel and the default model's projection shapes, a reference call of R rows is
compared with calls of M rows (the reference's first M rows) and with the reference rows
rotated to other positions in the call: a row is "invariant" when its bits never change.
Timings are medians of a few calls per row count beside bf16 `F.linear` on the same shape.
Prints markdown tables; asserts nothing (docs/runtime.md keeps the results).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import markdown_table, median, time_calls  # noqa: E402

GROUP = 32
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))  # (N, K): qkv, o, gate|up, down, lm_head
REFERENCE_ROWS = 512


def _int4(n: int, k: int, x_dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    scale = torch.rand(k // GROUP, n) * 0.02
    zero = torch.randn(k // GROUP, n) * 0.01
    sz = torch.stack([scale, zero], dim=-1).to(x_dtype)  # (K/G, N, 2)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(x_dtype), packed, GROUP, sz)


def _prefixd_int4(n: int, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Mode int4's product: prefixd's kernel (prefixd/gpu/csrc/int4_mm.cpp), fp32 x read as is."""
    from prefixd.gpu.linear import matmul, quantize_int4

    w = quantize_int4(torch.randn(n, k) * 0.05)
    return lambda x: matmul(x, w)


def _int8(n: int, k: int, x_dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales = (torch.rand(n) * 0.01).to(x_dtype)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(x_dtype), w, scales)


def _dense(n: int, k: int, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    w = (torch.randn(n, k) * 0.05).to(dtype)
    return lambda x: torch.nn.functional.linear(x.to(dtype), w)


def _forward_mm(n: int, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The product the forward runs for a bf16 projection: prefixd's kernels.mm_t (one thread;
    on a CPU with AMX, calls of exactly kernels.CPU_PRODUCT_ROWS rows)."""
    from prefixd.gpu import kernels

    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    return lambda x: kernels.mm_t(x.to(torch.bfloat16), w)


PROBED = ("bf16 F.linear", "bf16 kernels.mm_t", "fp32 F.linear", "int4pack bf16 x",
          "int8pack bf16 x", "prefixd int4")  # int4 fp32 / fp16 x: far too slow

KERNELS: dict[str, Callable[[int, int], Callable[[torch.Tensor], torch.Tensor]]] = {
    "bf16 F.linear": lambda n, k: _dense(n, k, torch.bfloat16),
    "fp32 F.linear": lambda n, k: _dense(n, k, torch.float32),
    "int4pack fp32 x": lambda n, k: _int4(n, k, torch.float32),
    "int4pack fp16 x": lambda n, k: _int4(n, k, torch.float16),
    "int4pack bf16 x": lambda n, k: _int4(n, k, torch.bfloat16),
    "int8pack bf16 x": lambda n, k: _int8(n, k, torch.bfloat16),
    "int8pack fp32 x": lambda n, k: _int8(n, k, torch.float32),
    "bf16 kernels.mm_t": _forward_mm,
    "prefixd int4": _prefixd_int4,
}


def bad_row_counts(fn: Callable[[torch.Tensor], torch.Tensor], k: int, counts: Sequence[int]) -> list[int]:
    """Row counts M whose call gives some row other bits than the reference call."""
    x = torch.randn(REFERENCE_ROWS, k)
    ref = fn(x)
    return [m for m in counts if not torch.equal(fn(x[:m].contiguous()), ref[:m])]


def bad_positions(fn: Callable[[torch.Tensor], torch.Tensor], k: int, rows: int) -> list[int]:
    """Rotations s for which a `rows`-row call with its rows rotated by s changes some row's bits."""
    x = torch.randn(rows, k)
    ref = fn(x)
    return [s for s in range(1, rows) if not torch.equal(fn(torch.roll(x, s, 0)), torch.roll(ref, s, 0))]


def invariance(counts: Sequence[int], shapes: Sequence[tuple[int, int]]) -> None:
    rows = []
    for name in PROBED:
        for n, k in shapes:
            torch.manual_seed(0)
            make = KERNELS[name]
            fn = make(n, k)
            bad = bad_row_counts(fn, k, counts)
            pos = sorted({s for m in (4, 16) for s in bad_positions(fn, k, m)})
            rows.append([name, f"{n}x{k}", _ranges(bad) or "none", _ranges(pos) or "none"])
    print(f"Row invariance (reference: {REFERENCE_ROWS} rows; M tried: {_ranges(list(counts))})\n")
    print(markdown_table(["kernel", "N x K", "M with other bits", "rotations with other bits (M=4,16)"], rows))


ATTENTION_SHAPES = ((64, 256), (256, 64), (128, 256), (256, 128))  # (K, N): QK and PV per block, head_dim 64 / 128
ATTENTION_BATCHES = (1, 3, 9, 48)


def attention_invariance(counts: Sequence[int]) -> None:
    """bf16 bmm at attention's per-block shapes: does a row keep its bits at every M (query
    rows x group) and batch count, with B contiguous and as a transposed view (QK reads keys
    transposed)? attention.py pads no query rows over a bf16 pool on this result."""
    rows = []
    for k, n in ATTENTION_SHAPES:
        for batch in ATTENTION_BATCHES:
            torch.manual_seed(0)
            a = torch.randn(batch, max(counts), k).to(torch.bfloat16)
            b = torch.randn(batch, k, n).to(torch.bfloat16)
            for layout, bb in (("contiguous", b), ("transposed view", b.transpose(1, 2).contiguous().transpose(1, 2))):
                ref = torch.bmm(a, bb)
                bad = [m for m in counts if not torch.equal(torch.bmm(a[:, :m].contiguous(), bb), ref[:, :m])]
                rows.append([f"{k}x{n}", str(batch), layout, _ranges(bad) or "none"])
    print(f"\nbf16 bmm row invariance, attention shapes (reference: {max(counts)} rows)\n")
    print(markdown_table(["K x N", "batch", "B layout", "M with other bits"], rows))


def timings(counts: Sequence[int], shapes: Sequence[tuple[int, int]], repeats: int) -> None:
    rows = []
    for n, k in shapes:
        for name, make in KERNELS.items():
            fn = make(n, k)
            cells = []
            for m in counts:
                x = torch.randn(m, k)
                cells.append(f"{median(time_calls(lambda: fn(x), repeats, warmup=2)) * 1e6:,.0f}")
            rows.append([f"{n}x{k}", name, *cells])
    print(f"\nMicroseconds per call (median of {repeats}, {torch.get_num_threads()} threads)\n")
    print(markdown_table(["N x K", "kernel", *(f"M={m}" for m in counts)], rows))


def _ranges(values: list[int]) -> str:
    out: list[str] = []
    for v in values:
        if out and out[-1][1] == v - 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))  # type: ignore[arg-type]
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)  # type: ignore[misc]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", default=None,
                        help="torch thread counts to probe invariance at, comma separated (default: torch's count); "
                             "the library products of the forward run on one (prefixd.gpu.kernels.one_thread)")
    parser.add_argument("--timings-only", action="store_true", help="skip the invariance tables")
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    counts = [1, 2, 3, 4, 5, 7, 8, 16, 17, 64, 200] if args.quick else [*range(1, 18), 31, 32, 33, 63, 64, 65, 100, 128, 256, 300, 512]
    shapes = SHAPES[:2] if args.quick else SHAPES[:4]  # lm_head: timed only
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}\n")
    default_threads = torch.get_num_threads()
    for t in [] if args.timings_only else threads:
        torch.set_num_threads(t)
        print(f"## {t} torch thread{'s' if t > 1 else ''}\n")
        invariance(counts, shapes)
        attention_invariance(counts)
        print()
    torch.set_num_threads(default_threads)
    # Around multiples of 4: torch's int4 kernel works in blocks of 4 rows (its time steps there);
    # 32 rows: 8 lanes with 3 drafts each
    timings([1, 4, 16, 256] if args.quick else [1, 2, 3, 4, 5, 8, 9, 12, 16, 32, 256],
            shapes if args.quick else SHAPES, 3 if args.quick else 10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
