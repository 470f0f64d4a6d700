"""Cost of the grammar mask (llguidance) beside the default model's decode, in one process.

    .venv/bin/python bench/constrain.py [--lanes 8] [--tokens 64] [--repeats 3]

Prints two things, measured in the same run:
- the mask alone: median time per token of building a grammar's mask (llguidance bitmask,
  unpacked) on the caller's thread and of applying it to one fp32 logits row, for a
  JSON-schema grammar driven along a fixed valid reply and for the regex of
  bench/http_front.py's measure (c);
- decode: `--lanes` streams of `--tokens` tokens each through the real engine (scheduler,
  runner, sampler at temperature 0.7), unconstrained and constrained by that regex, taken
  back to back in pairs; completion tokens over wall time, medians, and their ratio
  (issue 12's goal: constrained >= 0.90x unconstrained at 8 lanes).
Nothing here asserts a time; figures on a busy machine measure the load.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import torch  # noqa: E402

from bench.common import print_machine  # noqa: E402
from prefixd.gpu.constrain import GrammarMask  # noqa: E402
from prefixd.gpu.default_model import default_model_path  # noqa: E402
from prefixd.gpu.families import resolve_mode  # noqa: E402
from prefixd.gpu.loading import load_checkpoint  # noqa: E402
from prefixd.gpu.runner import ModelRunner  # noqa: E402
from prefixd.scheduler.config import SchedulerConfig  # noqa: E402
from prefixd.scheduler.engine import Engine  # noqa: E402
from prefixd.scheduler.records import SamplingParams  # noqa: E402
from prefixd.scheduler.streams import StreamRequest, TokenEvent  # noqa: E402
from prefixd.text.grammar import grammar_of, ll_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "required": ["name", "tags", "score"], "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}, "score": {"type": "number"}}}
REPLY = {"name": "a fairly long name for a thing", "tags": ["alpha", "beta", "gamma", "delta"], "score": 0.75}
REGEX = {"type": "regex", "regex": "[a-z ]{2000}"}  # bench/http_front.py (c): no lane ends before max_tokens
REGEX_REPLY = "the river runs slowly past old stone bridges and wide green fields toward the sea " * 4
TOPICS = ["rivers", "bread", "comets", "violins", "glaciers", "bees", "lighthouses", "chess"]


def mask_cost_s(runner: ModelRunner, response_format: dict[str, Any], text: str,
                num_tokens: int) -> tuple[float, float]:
    """Median seconds per token of (the mask built on this thread, the mask applied to a row)."""
    tok = runner.tokenizer
    mask = GrammarMask(ll_tokenizer(tok), grammar_of(response_format), vocab_size=runner.config.vocab_size,
                       background=False)
    row = torch.randn(runner.config.vocab_size)
    built, applied = [], []
    for token in tok.encode(text)[:num_tokens]:
        t0 = time.perf_counter()
        mask.forbidden()
        t1 = time.perf_counter()
        mask.apply(row)
        applied.append(time.perf_counter() - t1)
        built.append(t1 - t0)
        mask.advance(token)
    return statistics.median(built), statistics.median(applied)


def decode_tok_s(runner: ModelRunner, prompts: Sequence[tuple[int, ...]], grammar: str | None,
                 num_tokens: int) -> float:
    """Tokens/s of one stream per prompt, all admitted together, each decoding `num_tokens`."""
    engine = Engine(runner, SchedulerConfig(num_lanes=len(prompts), grid=8, cache=False))
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(temperature=0.7, seed=2000 + i, grammar=grammar)
        engine.submit(StreamRequest(i, prompt, num_tokens, sampling=sampling))
    count, t0 = 0, time.perf_counter()
    while not engine.idle:
        count += sum(len(e.ids) for e in engine.step() if isinstance(e, TokenEvent))
    return count / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print_machine({"lanes": str(args.lanes), "tokens": str(args.tokens), "repeats": str(args.repeats)})
    cpu, dtype = torch.device("cpu"), torch.bfloat16
    ckpt = load_checkpoint(default_model_path(), device=cpu, dtype=dtype)
    runner = ModelRunner(ckpt, device=cpu, dtype=dtype, num_lanes=args.lanes,
                         num_pages=args.lanes * (4 + args.tokens // 16), page_size=16,
                         mode=resolve_mode("auto", ckpt.config.family, cpu, dtype))
    for name, fmt, text in (("json schema", {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
                             json.dumps(REPLY)), ("regex", REGEX, REGEX_REPLY)):
        built_s, applied_s = mask_cost_s(runner, fmt, text, args.tokens)
        print(f"mask alone, {name}: built {built_s * 1e6:.0f} us, applied {applied_s * 1e6:.0f} us per token; "
              f"x{args.lanes} lanes {(built_s + applied_s) * args.lanes * 1e3:.2f} ms")
    prompts = [tuple(runner.tokenizer.encode(f"Write a long, plain description of {TOPICS[i % len(TOPICS)]}."))
               for i in range(args.lanes)]
    grammar = grammar_of(REGEX)
    decode_tok_s(runner, prompts, grammar, 4)  # warm-up
    free, masked = [], []
    for _ in range(args.repeats):
        free.append(decode_tok_s(runner, prompts, None, args.tokens))
        masked.append(decode_tok_s(runner, prompts, grammar, args.tokens))
    f, m = statistics.median(free), statistics.median(masked)
    print(f"decode, {args.lanes} lanes x {args.tokens} tokens: unconstrained {f:.1f} tok/s, "
          f"constrained (regex) {m:.1f} tok/s, ratio {m / f:.3f} (goal >= 0.90); pairs "
          + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(free, masked)))


if __name__ == "__main__":
    main()
