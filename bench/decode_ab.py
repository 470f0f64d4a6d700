"""Same-process A/B of decode rounds: the runner at a git revision against the working tree.

    python bench/decode_ab.py --base HEAD~3                    # 1 lane @ 512 ctx, int4
    python bench/decode_ab.py --base main --case 8x512 --mode invariant --threads 1

The package at `--base` is extracted into a temporary directory as `prefixd_base` (its imports
rewritten), so both runners live in one process and are timed alternately: each repeat runs
`--steps` decode rounds of one, then of the other; the figure is the median per round. Before
timing, both decode the same rounds and the logits of every row are compared bit for bit.
On a busy machine only the ratio means anything. Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import median  # noqa: E402
from bench.runtime import prompt_tokens  # noqa: E402

PAGE = 16


def extract_base(rev: str, into: Path) -> None:
    """prefixd at `rev` as the package `prefixd_base` under `into`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "prefixd"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    (into / "prefixd").rename(into / "prefixd_base")
    for path in (into / "prefixd_base").rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bprefixd\.", "prefixd_base.", text)  # torch.ops.prefixd too: the base's kernels below
        path.write_text(re.sub(r"^(from|import) prefixd\b", r"\1 prefixd_base", text, flags=re.M))
    # mode int4's CPU kernels register their ops as torch.ops.prefixd; the base's register them
    # as torch.ops.prefixd_base, so both libraries load in one process even where their sources
    # differ (the rewritten sources are built into a library of their own)
    for path in (into / "prefixd_base" / "gpu" / "csrc").glob("*.cpp"):
        text = path.read_text()
        path.write_text(re.sub(r"\b(TORCH_LIBRARY(?:_FRAGMENT|_IMPL)?)\(prefixd\b", r"\1(prefixd_base", text))


class Lanes:
    """One runner (of package `pkg`) with `contexts` prefilled, decoding greedy rounds."""

    def __init__(self, pkg: str, checkpoint, mode: str, contexts: dict[int, list[int]], steps: int):
        runner_mod = importlib.import_module(pkg + ".gpu.runner")
        self.rec = importlib.import_module(pkg + ".scheduler.records")
        per = math.ceil((max(map(len, contexts.values())) + 4 * steps + 16) / PAGE)
        self.runner = runner_mod.ModelRunner(checkpoint, device=torch.device("cpu"), dtype=torch.bfloat16,
                                             num_lanes=len(contexts), num_pages=per * len(contexts),
                                             page_size=PAGE, mode=mode)
        self.tables = {lane: tuple(range(lane * per, (lane + 1) * per)) for lane in contexts}
        self.contexts = contexts
        self.first = self._prefill()

    def _plan(self, lane: int, start: int, tokens: Sequence[int], prefill: bool, sample: tuple[int, ...],
              logits: bool):
        pages = self.tables[lane][: math.ceil((start + len(tokens)) / PAGE)]
        return self.rec.LaneWork(lane, start, tuple(tokens), pages, prefill, sample_rows=sample,
                                 logits_rows=sample if logits else ())

    def _prefill(self) -> dict[int, int]:
        rec = self.rec
        self.runner.run_round(rec.RoundPlan(samplers=tuple(
            rec.SamplerSetup(lane, rec.SamplingParams(), tuple(t)) for lane, t in self.contexts.items())))
        first = {}
        for lane, tokens in self.contexts.items():
            for s in range(0, len(tokens), 256):
                chunk = tokens[s : s + 256]
                last = (len(chunk) - 1,) if s + len(chunk) == len(tokens) else ()
                for r in self.runner.run_round(rec.RoundPlan((self._plan(lane, s, chunk, True, last, False),))).lanes:
                    first.update({r.lane: r.sampled[-1]} if r.sampled else {})
        return first

    def decode(self, steps: int, logits: bool = False) -> list:
        tokens, out = dict(self.first), []
        for step in range(steps):
            work = tuple(self._plan(lane, len(ctx) + step, (tokens[lane],), False, (0,), logits)
                         for lane, ctx in self.contexts.items())
            for r in self.runner.run_round(self.rec.RoundPlan(work)).lanes:
                tokens[r.lane] = r.sampled[-1]
                out.append((r.lane, r.sampled[-1], None if r.logits is None else r.logits.view(torch.int32).clone()))
        return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision to compare the working tree with")
    parser.add_argument("--case", default="1x512", help="LANESxCONTEXT")
    parser.add_argument("--mode", default="int4")
    parser.add_argument("--steps", type=int, default=2, help="decode rounds per timing")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lanes, context = map(int, args.case.split("x"))
    from prefixd.gpu.default_model import default_model_path
    from prefixd.gpu.loading import load_checkpoint

    checkpoint = load_checkpoint(str(default_model_path()), device=torch.device("cpu"), dtype=torch.bfloat16)
    contexts = {lane: prompt_tokens(context, checkpoint.tokenizer.vocab_size, seed=100 + lane) for lane in range(lanes)}
    with tempfile.TemporaryDirectory() as tmp:
        extract_base(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        runs = {name: Lanes(pkg, dataclasses.replace(checkpoint, tensors=dict(checkpoint.tensors)), args.mode,
                            contexts, args.steps)
                for name, pkg in (("base", "prefixd_base"), ("tree", "prefixd"))}
        checked = [r.decode(6, logits=True) for r in runs.values()]
        same = all(a[:2] == b[:2] and torch.equal(a[2], b[2]) for a, b in zip(*checked))
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, r in runs.items():
                start = time.perf_counter()
                r.decode(args.steps)
                times[name].append((time.perf_counter() - start) / args.steps)
    per_round = {name: median(t) for name, t in times.items()}
    print(f"{args.case} {args.mode}, {torch.get_num_threads()} threads, base {args.base}: "
          f"tokens and logits bits equal: {same}")
    for name, s in per_round.items():
        print(f"  {name}: {1000 * s:.2f} ms a round, {lanes / s:.1f} tok/s")
    print(f"  tree / base speed: {per_round['base'] / per_round['tree']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
