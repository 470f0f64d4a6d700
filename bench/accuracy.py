"""Accuracy beside speed: how far each engine's logits are from an fp32 reference of the same file.

    python bench/accuracy.py                     # default model: int4 and invariant beside llama.cpp
    python bench/accuracy.py --tokens 1024       # a smoke run
    python bench/accuracy.py --modes int4,int4+head=4   # head variants side by side (bench/heads.py)
    python bench/accuracy.py --transformers      # also transformers' fp32 on the GGUF (checks the reference)

The text is the repository's own docs (docs/*.md, sorted, joined), tokenized by the model's
tokenizer and cut into windows of --window tokens, each evaluated from position 0 by every
engine on the same ids. The reference is prefixd's fp32 path (mode invariant, float32: the
GGUF's weights dequantized to fp32, fp32 math). Per engine, over every row of every window:
the mean KL divergence KL(reference || engine) of the next-token distributions, its 99th
percentile and maximum, the share of rows whose top-1 token is the reference's, and the
perplexity of the text. llama.cpp (llama-cpp-python, `Llama(logits_all=True)`) gets a row
when it is importable; else a note says why it is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import markdown_table, print_machine  # noqa: E402
from bench.heads import apply_head, split_mode  # noqa: E402
from prefixd.scheduler.records import LaneWork, RoundPlan  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW_BLOCK = 256  # rows compared at a time (float64 log-softmax of the vocabulary)


def docs_text(root: str = ROOT) -> str:
    """The repository's docs/*.md, sorted by name, joined by blank lines."""
    parts = []
    for path in sorted(glob.glob(os.path.join(root, "docs", "*.md"))):
        with open(path, encoding="utf-8") as f:
            parts.append(f.read())
    return "\n\n".join(parts)


class RunnerLogits:
    """fp32 logits of every row of a window from a prefixd runner (one lane, prefilled by grid)."""

    def __init__(self, checkpoint, *, mode: str, dtype: torch.dtype, window: int, grid: int = 256):
        from prefixd.gpu.runner import ModelRunner

        mode, head = split_mode(mode)
        self.page_size, self.grid = 16, grid
        self.runner = ModelRunner(checkpoint, device=torch.device("cpu"), dtype=dtype, num_lanes=1,
                                  num_pages=math.ceil(window / self.page_size), page_size=self.page_size, mode=mode)
        apply_head(self.runner.model, head)

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        rows = []
        for start in range(0, len(ids), self.grid):
            chunk = tuple(ids[start : start + self.grid])
            pages = tuple(range(math.ceil((start + len(chunk)) / self.page_size)))
            work = LaneWork(0, start, chunk, pages, True, logits_rows=tuple(range(len(chunk))))
            (lane,) = self.runner.run_round(RoundPlan((work,))).lanes
            if lane.error:
                raise RuntimeError(f"round failed: {lane.error}")
            rows.append(lane.logits.float())
        return torch.cat(rows)  # (len(ids), vocab)


class LlamaCppLogits:
    """llama.cpp's logits of every row of a window (llama-cpp-python, logits_all)."""

    def __init__(self, path: str, *, window: int, threads: int):
        from llama_cpp import Llama

        from bench.common import _quiet_llama_cpp
        import llama_cpp

        _quiet_llama_cpp(llama_cpp)
        self.version = llama_cpp.__version__
        self.llm = Llama(model_path=path, logits_all=True, n_ctx=window, n_batch=min(window, 512),
                         n_threads=threads, n_threads_batch=threads, verbose=False)

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(list(ids))
        return torch.tensor(self.llm.scores[: len(ids)], dtype=torch.float32)


class TransformersLogits:
    """transformers' fp32 logits of the same GGUF (its own dequantization and forward)."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                          torch_dtype=torch.float32).eval()

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(torch.tensor([list(ids)])).logits[0].float()


@dataclass
class Stats:
    """Sums over the rows of every window compared so far."""

    kl: list[torch.Tensor] = field(default_factory=list)  # per row, float64
    top1: int = 0
    nll: float = 0.0
    rows: int = 0
    predicted: int = 0  # rows whose next token is in the window (perplexity)

    def add(self, ref: torch.Tensor, logits: torch.Tensor, next_ids: torch.Tensor) -> None:
        for a in range(0, ref.shape[0], ROW_BLOCK):
            r = torch.log_softmax(ref[a : a + ROW_BLOCK].double(), dim=-1)
            m = torch.log_softmax(logits[a : a + ROW_BLOCK].double(), dim=-1)
            self.kl.append((r.exp() * (r - m)).sum(-1))
            self.top1 += int((r.argmax(-1) == m.argmax(-1)).sum())
            targets = next_ids[a : a + ROW_BLOCK]
            self.nll -= float(m[: len(targets)].gather(1, targets[:, None]).sum())
            self.predicted += len(targets)
            self.rows += r.shape[0]

    def row(self, name: str, reference: bool = False) -> list[object]:
        ppl = f"{math.exp(self.nll / self.predicted):.3f}"
        if reference:
            return [name, "—", "—", "—", "—", ppl]
        kl = torch.cat(self.kl)
        return [name, f"{float(kl.mean()):.5f}", f"{float(kl.quantile(0.99)):.4f}", f"{float(kl.max()):.3f}",
                f"{100 * self.top1 / self.rows:.2f} %", ppl]


def measure(model: str, modes: Sequence[str], *, tokens: int, window: int, llama_cpp: bool,
            transformers: bool) -> tuple[str, list[str], dict[str, str]]:
    """(the table, notes, versions) of every engine against prefixd's fp32 path."""
    from prefixd.gpu.loading import load_checkpoint

    ref_ckpt = load_checkpoint(model, device=torch.device("cpu"), dtype=torch.float32)
    path = str(ref_ckpt.path)
    ids = ref_ckpt.tokenizer.encode(docs_text())
    notes: list[str] = []
    if len(ids) < tokens:
        notes.append(f"the docs hold {len(ids)} tokens, fewer than the {tokens} asked")
    windows = [ids[i : i + window] for i in range(0, min(tokens, len(ids)) - window + 1, window)]
    versions = {"model": path, "text": f"docs/*.md, {len(windows)} windows of {window} tokens",
                "threads": str(torch.get_num_threads())}
    engines: dict[str, object] = {}
    low = load_checkpoint(model, device=torch.device("cpu"), dtype=torch.bfloat16)
    for mode in modes:
        try:
            engines[f"prefixd {mode}"] = RunnerLogits(dataclasses.replace(low, tensors=dict(low.tensors)),
                                                      mode=mode, dtype=torch.bfloat16, window=window)
        except (ValueError, NotImplementedError) as exc:
            notes.append(f"prefixd mode {mode!r} not available: {exc}")
    reference = RunnerLogits(ref_ckpt, mode="invariant", dtype=torch.float32, window=window)
    if not llama_cpp:
        notes.append("llama.cpp skipped (asked)")
    elif not path.endswith(".gguf"):
        notes.append("llama.cpp skipped: it reads a GGUF model only")
    else:
        try:
            engines["llama.cpp"] = ll = LlamaCppLogits(path, window=window, threads=torch.get_num_threads())
            versions["llama-cpp-python"] = ll.version
        except ImportError as exc:
            notes.append(f"llama.cpp skipped: llama-cpp-python is not importable ({exc}; "
                         "`.venv/bin/pip install llama-cpp-python` builds it, about 5 minutes on 2 cores)")
    if transformers:
        engines["transformers fp32"] = TransformersLogits(path)
    stats = {name: Stats() for name in ["reference", *engines]}
    for n, w in enumerate(windows):
        print(f"accuracy: window {n + 1} of {len(windows)}", file=sys.stderr, flush=True)
        ref = reference.logits(w)
        next_ids = torch.tensor(w[1:])
        stats["reference"].add(ref, ref, next_ids)
        for name, engine in engines.items():
            stats[name].add(ref, engine.logits(w), next_ids)
    headers = [f"against fp32 ({sum(map(len, windows))} tokens)", "mean KL", "p99 KL", "max KL", "top-1 agreement",
               "perplexity"]
    rows = [stats["reference"].row("prefixd fp32 (the reference)", reference=True)]
    rows += [stats[name].row(name) for name in engines]
    notes.append("KL(reference || engine) of each row's next-token distribution, in nats; top-1: the row's argmax "
                 "is the reference's; perplexity of the text's next tokens")
    return markdown_table(headers, rows), notes, versions


def report(*, model: str = "default", modes: Sequence[str] = ("int4", "invariant"), tokens: int = 4096,
           window: int = 1024, llama_cpp: bool = True, transformers: bool = False) -> str:
    """The table and its notes as one markdown string (what bench/runtime.py --accuracy prints)."""
    table, notes, versions = measure(model, modes, tokens=tokens, window=window, llama_cpp=llama_cpp,
                                     transformers=transformers)
    lines = [table, "", f"- text: {versions['text']}; llama-cpp-python {versions.get('llama-cpp-python', 'absent')}"]
    return "\n".join(lines + [f"- {n}" for n in notes])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help='"default", a .gguf path or a HF directory')
    parser.add_argument("--modes", default="int4,invariant", help="runner modes (bench/heads.py variants too)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of docs text compared")
    parser.add_argument("--window", type=int, default=1024, help="tokens per window, each from position 0")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--transformers", action="store_true", help="also transformers' fp32 forward of the GGUF")
    args = parser.parse_args(argv)
    table, notes, versions = measure(args.model, args.modes.split(","), tokens=args.tokens, window=args.window,
                                     llama_cpp=not args.no_llama_cpp, transformers=args.transformers)
    print_machine(versions)
    print(table)
    print()
    for note in notes:
        print(f"- {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
