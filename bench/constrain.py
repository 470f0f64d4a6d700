"""Per-token cost of the grammar mask (llguidance) beside the default model's decode round.

    .venv/bin/python bench/constrain.py [--lanes 8] [--tokens 64]

Prints, for a JSON-schema grammar driven along a fixed valid reply: the median time of
GrammarMask.apply (bitmask from llguidance, unpacked, applied to one fp32 logits row) per
token, times the lanes (each lane masks its own row), and an 8-lane decode round of the
default model measured in the same run, so the ratio is the mask's share of a round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from prefixd.gpu.constrain import GrammarMask
from prefixd.gpu.default_model import default_model_path
from prefixd.gpu.loading import load_checkpoint
from prefixd.gpu.runner import ModelRunner
from prefixd.scheduler.records import LaneWork, RoundPlan, SamplerSetup, SamplingParams
from prefixd.text.grammar import grammar_of, ll_tokenizer

SCHEMA = {"type": "object", "required": ["name", "tags", "score"], "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}, "score": {"type": "number"}}}
REPLY = {"name": "a fairly long name for a thing", "tags": ["alpha", "beta", "gamma", "delta"], "score": 0.75}


def mask_cost_s(runner: ModelRunner, num_tokens: int) -> tuple[float, float]:
    """Median seconds per token of (the allowed-id mask alone, the mask applied to a row)."""
    tok = runner.tokenizer
    grammar = grammar_of({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    mask = GrammarMask(ll_tokenizer(tok), grammar, vocab_size=runner.config.vocab_size)
    ids = tok.encode(json.dumps(REPLY))[:num_tokens]
    row = torch.randn(runner.config.vocab_size)
    alone, applied = [], []
    for token in ids:
        t0 = time.perf_counter()
        mask.allowed()
        t1 = time.perf_counter()
        mask.apply(row)
        applied.append(time.perf_counter() - t1)
        alone.append(t1 - t0)
        mask.advance(token)
    return statistics.median(alone), statistics.median(applied)


def decode_round_s(runner: ModelRunner, num_lanes: int, rounds: int = 8) -> float:
    page_size = runner.info.page_size
    runner.run_round(RoundPlan(samplers=tuple(SamplerSetup(lane, SamplingParams(), ()) for lane in range(num_lanes))))
    tables = [tuple(range(lane * 8, lane * 8 + 8)) for lane in range(num_lanes)]
    prompt = tuple(runner.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2))
    runner.run_round(RoundPlan(tuple(LaneWork(lane, 0, prompt, tables[lane], prefill=True, sample_rows=(len(prompt) - 1,))
                                     for lane in range(num_lanes))))
    times, pos = [], len(prompt)
    for _ in range(rounds):
        plan = RoundPlan(tuple(LaneWork(lane, pos, (42,), tables[lane], prefill=False, sample_rows=(0,))
                               for lane in range(num_lanes)))
        t0 = time.perf_counter()
        runner.run_round(plan)
        times.append(time.perf_counter() - t0)
        pos += 1
    assert pos < 8 * page_size, "the bench's page tables hold the rows it writes"
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    ckpt = load_checkpoint(default_model_path(), device=torch.device("cpu"), dtype=torch.bfloat16)
    runner = ModelRunner(ckpt, device=torch.device("cpu"), dtype=torch.bfloat16, num_lanes=args.lanes,
                         num_pages=8 * args.lanes, page_size=16)
    alone_s, mask_s = mask_cost_s(runner, args.tokens)
    round_s = decode_round_s(runner, args.lanes)
    print(f"allowed ids per token {alone_s * 1e6:.0f} us; applied to a row {mask_s * 1e6:.0f} us; "
          f"x{args.lanes} lanes {mask_s * args.lanes * 1e3:.2f} ms; {args.lanes}-lane decode round "
          f"{round_s * 1e3:.1f} ms; mask share {mask_s * args.lanes / round_s:.1%}")


if __name__ == "__main__":
    main()
