"""Is mode int4's decode attention bound by memory or by instructions? Cache-resident against streamed.

    python bench/attend_bound.py             # contexts 512, 1024, 2048, 4096 (the default model's heads)
    python bench/attend_bound.py --quick     # 512 and 4096 only, fewer repeats
    python bench/attend_bound.py --pages 8-bit   # mode int4's 8-bit pages only (default: bf16 and 8-bit)

One decode row (one lane, 9 q heads over 3 kv heads of 64 dims, the default model's shape)
attends a context of K/V pages through `cpu_kernels.attend`, the kernel a decode round calls
once per layer. Each context is timed twice with the same calls:

- **resident**: one layer's pages, attended again and again: after the first call they sit in
  the caches, so the time is the kernel's instructions;
- **streamed**: as many layers' pages as fill --stream-mb (94 MB by default, the default
  model's 30 layers at 4K context), attended one after another as a decode round does: each
  call reads its pages from memory.

If streamed calls take about as long as resident ones, attention is bound by its instructions
and fewer bytes a key (8-bit K/V pages) would not help; if they take clearly longer, it waits
on memory, and halving the bytes a key reads is worth up to the difference. Medians of
--repeats rounds of calls, on torch's thread count (the daemon's).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import markdown_table, median, print_machine  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16  # the default model's attention


KINDS = ("bf16", "8-bit")  # bf16 key pages, and mode int4's 8-bit pages (kv_pool.py)


def pools(context: int, layers: int, seed: int, kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`layers` (K, V) page pools of `context` rows each: random values, no magnitude below
    2^-30; bf16 (K in the kernel's dim-pair order is immaterial to the timing) or 8-bit pages
    written through the pool."""
    from prefixd.gpu import cpu_kernels
    from prefixd.gpu.kv_pool import KVPool

    g = torch.Generator().manual_seed(seed)
    pages = context // PAGE
    if kind == "8-bit":
        pool = KVPool(num_layers=layers, num_pages=pages, page_size=PAGE, num_kv_heads=KV_HEADS, head_dim=DIM,
                      device=torch.device("cpu"), dtype=torch.bfloat16, codes8=True)
        slots = torch.arange(pages * PAGE)
        for layer in range(layers):
            pool.write(layer, slots, cpu_kernels.flush_tiny(torch.randn(pages * PAGE, KV_HEADS, DIM, generator=g).bfloat16()),
                       torch.randn(pages * PAGE, KV_HEADS, DIM, generator=g))
        return list(zip(pool.k, pool.v))
    return [(cpu_kernels.flush_tiny(torch.randn(pages, PAGE, KV_HEADS, DIM, generator=g).bfloat16()),
             torch.randn(pages, PAGE, KV_HEADS, DIM, generator=g).bfloat16()) for _ in range(layers)]


def call_bytes(context: int, kind: str) -> int:
    """K and V bytes one call reads: bf16, or a byte a dim and 4 a block of 32 dims."""
    return 2 * context * KV_HEADS * (DIM + DIM // 8 if kind == "8-bit" else 2 * DIM)


def time_calls(context: int, layers: int, calls: int, repeats: int, kind: str) -> float:
    """Median seconds a call over `calls` calls cycling through `layers` pools."""
    from prefixd.gpu import cpu_kernels

    kv = pools(context, layers, seed=context + layers, kind=kind)
    q = cpu_kernels.flush_tiny(torch.randn(2 * (HEADS + KV_HEADS), DIM).bfloat16())
    spans = torch.tensor([[0, context - 1, 1]], dtype=torch.long)  # one row at the context's last position
    tables = torch.arange(context // PAGE, dtype=torch.int32).view(1, -1)
    out = torch.zeros(2, HEADS * DIM)
    times = []
    for _ in range(repeats + 1):  # the first round warms up
        t0 = time.perf_counter()
        for i in range(calls):
            k, v = kv[i % layers]
            cpu_kernels.attend(q, k, v, spans, tables, HEADS, HEADS + KV_HEADS, out)
        times.append((time.perf_counter() - t0) / calls)
    return median(times[1:])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two contexts, fewer repeats (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds of calls (default 7; --quick 3)")
    parser.add_argument("--stream-mb", type=float, default=94.0, help="K/V bytes the streamed calls cycle through")
    parser.add_argument("--pages", default=",".join(KINDS), help=f"page kinds, of {', '.join(KINDS)}")
    args = parser.parse_args(argv)
    from prefixd.gpu import cpu_kernels

    ok, why = cpu_kernels.available()
    if not ok:
        raise SystemExit(f"attend_bound: {why}")
    contexts = (512, 4096) if args.quick else (512, 1024, 2048, 4096)
    repeats = args.repeats or (3 if args.quick else 7)
    kinds = [k.strip() for k in args.pages.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        parser.error(f"--pages: a list of {', '.join(KINDS)}")
    rows = []
    for context in contexts:
        for kind in kinds:  # the kinds one after another at each context: the same machine state
            nbytes = call_bytes(context, kind)
            layers = max(2, round(args.stream_mb * 1e6 / nbytes))
            calls = max(30, layers)
            resident = time_calls(context, 1, calls, repeats, kind)
            streamed = time_calls(context, layers, calls, repeats, kind)
            rows.append([f"{context:,}", kind, f"{nbytes / 1e6:.2f}", f"{resident * 1e6:.1f}",
                         f"{nbytes / resident / 1e9:.1f}", f"{layers}", f"{streamed * 1e6:.1f}",
                         f"{nbytes / streamed / 1e9:.1f}", f"{streamed / resident:.2f}x"])
        print(f"attend_bound: context {context} done", file=sys.stderr, flush=True)
    print_machine({"attention path": f"bf16 {cpu_kernels.attention_path()}, 8-bit {cpu_kernels.attention_path(q8=True)}",
                   "threads": str(torch.get_num_threads()), "repeats": str(repeats)})
    print(markdown_table(["context", "pages", "K/V MB a call", "resident µs", "resident GB/s", "streamed pools",
                          "streamed µs", "streamed GB/s", "streamed / resident"], rows))
    print("- one decode row, 9 q heads over 3 kv heads of 64 dims, pages of 16 rows; medians; streamed: "
          f"the calls cycle through pools of about {args.stream_mb:.0f} MB in all (fewer bytes a call: more pools)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
