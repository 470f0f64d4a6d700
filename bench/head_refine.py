"""Could mode int4's head read fewer bytes? A coarse head, refined near each row's maximum.

    python bench/head_refine.py                  # 4,096 tokens of docs text, margins 4 to 16
    python bench/head_refine.py --tokens 2048 --margins 8,12

Mode int4's head (8-bit codes of the file's Q8_0 values, read with two codes an activation) is
about a third of the bytes a one-lane decode token reads (`bench/runtime.py`'s account). A
cheaper form would read, for every row of the vocabulary, only the high four bits of each code
(a 4-bit head: scale 16 times the 8-bit one's, base raised by 7.5 scales, the low bits' middle),
then the full head only for the rows whose coarse logit lies within a margin T of the row's
largest: the same greedy token and the same logits near the top, coarse ones in the tail. Each
row's choice depends on that row alone, so the exactness rules would hold.

This bench emulates it: every window's logits from mode int4 as it is, and from the coarse head
on the same final-normed rows (`cpu_kernels.matmul` on the unpacked high bits, one code an
activation), mixed row by row for each margin. Against prefixd's fp32 reference on the text of
`bench/accuracy.py`, it prints the mean and 99th-percentile KL divergence and the top-1
agreement of the full head, the coarse head alone and each margin, the rows each margin reads in
full (mean, median, 99th percentile of 49,152 on the default model), and the head's bytes a
token that would make. llama.cpp's KL on the same text is `bench/accuracy.py`'s row.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.accuracy import RunnerLogits, Stats, docs_text  # noqa: E402
from bench.common import markdown_table, print_machine  # noqa: E402
from prefixd.gpu import cpu_kernels  # noqa: E402
from prefixd.gpu.linear import Int8Weight  # noqa: E402


def unpack8(weight: Int8Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (N, K) in 0..255, scale (N, K/32), base (N, K/32)) of a packed 8-bit weight: the
    inverse of `cpu_kernels.pack8`."""
    n, k = weight.shape
    nb, g = weight.codes.shape[0], weight.codes.shape[1]
    # [nb, g, i, h, l, b]: output nb*32 + 16h + l, input 32g + 4i + b
    q = weight.codes.reshape(nb, g, 8, 2, 16, 4).permute(0, 3, 4, 1, 2, 5).reshape(nb * 32, g * 32)[:n]
    sb = weight.scales.float().permute(2, 0, 3, 1).reshape(2, nb * 32, g)[:, :n]  # [which, output, group]
    return q.to(torch.int32), sb[0], sb[1]


def coarse_head(weight: Int8Weight) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The 4-bit head of the codes' high bits, packed for `cpu_kernels.matmul`: w = hi * 16 scale
    + (base + 7.5 scale), scale and base rounded to fp16."""
    codes, scale, base = unpack8(weight)
    if not torch.equal(cpu_kernels.pack8(codes, scale, base)[0], weight.codes):
        raise RuntimeError("unpack8 does not invert cpu_kernels.pack8 in this tree")
    packed, scales = cpu_kernels.pack(codes >> 4, (scale * 16).half().float(), (base + 7.5 * scale).half().float())
    return packed, scales, weight.shape[0]


def measure(*, tokens: int, window: int, margins: Sequence[float]) -> tuple[str, dict[str, str]]:
    from prefixd.gpu.loading import load_checkpoint

    ref_ckpt = load_checkpoint("default", device=torch.device("cpu"), dtype=torch.float32)
    ids = ref_ckpt.tokenizer.encode(docs_text())
    windows = [ids[i : i + window] for i in range(0, min(tokens, len(ids)) - window + 1, window)]
    low = load_checkpoint("default", device=torch.device("cpu"), dtype=torch.bfloat16)
    engine = RunnerLogits(dataclasses.replace(low, tensors=dict(low.tensors)), mode="int4", dtype=torch.bfloat16,
                          window=window)
    model = engine.runner.model
    if not isinstance(model.lm_head, Int8Weight):
        raise SystemExit("mode int4's head is not 8-bit codes in this tree")
    codes, scales, n = coarse_head(model.lm_head)
    full_mb = model.lm_head.nbytes / 1e6
    coarse_mb = (codes.nbytes + scales.nbytes) / 1e6
    row_bytes = model.lm_head.nbytes / model.lm_head.shape[0]  # a row read in full: its codes, scales, bases
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    full_logits = model.logits

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = full_logits(hidden)
        captured.append((out, cpu_kernels.matmul(hidden, codes, scales, n, passes=1)))
        return out

    model.logits = logits  # every row through the separate head (the one-call head has its bits)
    model.host_set_up = False  # the runner's rounds through RoundInputs and the two calls below
    model.forward_logits = lambda inputs, kv, pick_below=0: (model.forward(inputs, kv), None, None)
    reference = RunnerLogits(ref_ckpt, mode="invariant", dtype=torch.float32, window=window)
    names = ["full (mode int4)", "coarse alone", *(f"T = {t:g}" for t in margins)]
    stats = {name: Stats() for name in names}
    rows: list[list[torch.Tensor]] = [[] for _ in margins]  # per margin, each window's rows read in full
    for i, w in enumerate(windows):
        print(f"head_refine: window {i + 1} of {len(windows)}", file=sys.stderr, flush=True)
        captured.clear()
        ref = reference.logits(w)
        engine.logits(w)
        full = torch.cat([c[0] for c in captured])
        coarse = torch.cat([c[1] for c in captured])
        following = torch.tensor(w[1:])
        stats[names[0]].add(ref, full, following)
        stats[names[1]].add(ref, coarse, following)
        top = coarse.max(dim=-1, keepdim=True).values
        for t, name, read in zip(margins, names[2:], rows):
            near = coarse >= top - t
            read.append(near.sum(dim=-1))
            stats[name].add(ref, torch.where(near, full, coarse), following)
    headers = [f"head ({sum(map(len, windows))} tokens)", "mean KL", "p99 KL", "top-1 agreement",
               "rows read in full: mean / p50 / p99", "head MB a token (mean)"]
    read_cells = [[f"{n:,} (all)", f"{full_mb:.1f}"], ["0", f"{coarse_mb:.1f}"]]
    for read in rows:
        r = torch.cat(read).float()
        read_cells.append([f"{r.mean():,.0f} / {r.median():,.0f} / {r.quantile(0.99):,.0f}",
                           f"{coarse_mb + float(r.mean()) * row_bytes / 1e6:.1f}"])
    table = []
    for name, cells in zip(names, read_cells):
        kl = torch.cat(stats[name].kl)
        table.append([name, f"{float(kl.mean()):.5f}", f"{float(kl.quantile(0.99)):.4f}",
                      f"{100 * stats[name].top1 / stats[name].rows:.2f} %", *cells])
    versions = {"model": str(ref_ckpt.path), "text": f"docs/*.md, {len(windows)} windows of {window} tokens",
                "threads": str(torch.get_num_threads())}
    return markdown_table(headers, table), versions


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of docs text compared")
    parser.add_argument("--window", type=int, default=1024, help="tokens per window, each from position 0")
    parser.add_argument("--margins", default="4,6,8,10,12,16", help="margins T in logits (nats), comma-separated")
    args = parser.parse_args(argv)
    margins = [float(t) for t in args.margins.split(",") if t]
    table, versions = measure(tokens=args.tokens, window=args.window, margins=margins)
    print_machine(versions)
    print(table)
    print()
    print("- KL(reference || head) of each row's next-token distribution in nats, against prefixd's fp32 path; "
          "coarse: the 8-bit codes' high four bits, the low bits taken at their middle (7.5); T: rows whose coarse "
          "logit is within T of the row's largest read in full, the rest coarse; MB: the coarse head, plus the rows "
          "read in full at their 8-bit bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
