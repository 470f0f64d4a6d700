"""The hybrid family's reply re-prefill, measured on the agent trace (bench/hybrid.py --trace).

A hybrid model resumes only at cut points of a request's own prefill schedule, so each later
turn restores the cut at the start of the previous reply and prefills that reply again. This
replays bench/trace.py's quick agent trace through a daemon serving a random-weight hybrid
model (store on, one request at a time; each reply goes back into the history as a stand-in
text of as many tokens as were generated, since a random model's tokens do not re-tokenize
to themselves) and reports per turn: new tokens (the turn's own
message), reply tokens prefilled again (prefilled - new) and what they cost. The cost is
timed in this process after the replay: message starts are chunk starts, so the reply is
prefilled by chunks of its own; the runner runs the daemon's chunks from the resume point
up to the new message (the re-prefill) and all of them (the turn's prefill), and the
re-prefill's time is quoted against the daemon's own TTFT of the turn.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import markdown_table
from bench.trace import QUICK_TRACE, TraceShape, build_trace

PAGE = 16
GRID = 256
MAX_TOKENS = 32


@dataclass(frozen=True)
class TurnCost:
    conversation: int
    index: int
    context: int
    cached: int
    prefilled: int
    new: int  # rows of the turn's own message (from its start to the end of the prompt)
    reply: int  # tokens the daemon generated
    ttft_s: float  # the daemon's
    prefill_s: float  # this process: the chunks from the resume point (what the daemon ran)
    reprefill_s: float  # this process: those chunks before the new message

    @property
    def reprefilled(self) -> int:
        return self.prefilled - self.new


def write_model_dir(path: Path, fields: dict, dtype: torch.dtype) -> Path:
    """A random-weight `qwen3_5_text` HF directory with the default model's tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from prefixd.gpu.default_model import default_model_path
    from prefixd.gpu.families.qwen3_5_config import hybrid_config_from_hf
    from prefixd.gpu.families.qwen3_5_tiny import random_tensors

    gguf = Path(default_model_path())
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    path.mkdir(parents=True, exist_ok=True)
    tok.backend_tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": tok.chat_template, "tokenizer_class": "PreTrainedTokenizerFast"}))
    raw = {"model_type": "qwen3_5_text", **fields, "vocab_size": len(tok), "rms_norm_eps": 1e-6}
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    tensors = random_tensors(hybrid_config_from_hf(raw), seed=0, dtype=dtype)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


_REPLY_WORDS = ["the", "result", "shows", "the", "parser", "reads", "each", "record", "and", "the", "cache", "keeps", "the", "last", "page", "so", "the", "next", "request", "resumes", "from", "there", "while", "the", "worker", "checks", "the", "index"]


def _reply_text(num_tokens: int, count_tokens) -> str:
    """English words up to `num_tokens` tokens: what a real model's reply would put back."""
    words: list[str] = []
    while count_tokens(" ".join(words + [_REPLY_WORDS[len(words) % len(_REPLY_WORDS)]])) <= num_tokens:
        words.append(_REPLY_WORDS[len(words) % len(_REPLY_WORDS)])
    return " ".join(words)


async def _replay(socket: str, shape: TraceShape, system: str, turns, count_tokens) -> list[tuple]:
    from prefixd.ipc.client import AsyncClient

    history: dict[int, list[dict[str, str]]] = {c: [] for c in range(shape.num_conversations)}
    out = []
    async with await AsyncClient.connect(socket) as client:
        for turn in turns:
            messages = [{"role": "system", "content": system}, *history[turn.conversation], turn.message]
            rendered = await client.tokenize(messages=messages)
            result = await client.generate(messages=messages, max_tokens=MAX_TOKENS).collect()
            reply = _reply_text(result.usage.completion_tokens, count_tokens)
            history[turn.conversation] += [turn.message, {"role": "assistant", "content": reply}]
            starts = tuple(rendered.message_starts or ())
            # starts has one entry per message, then the generation prompt's
            out.append((turn, tuple(rendered.ids), starts, starts[len(messages) - 1], result.usage))
    return out


def _prefill_s(runner, ids: tuple[int, ...], chunks: list[tuple[int, int]], pages: tuple[int, ...]) -> float:
    from prefixd.scheduler.records import LaneWork, RoundPlan

    t0 = time.perf_counter()
    for i, (a, b) in enumerate(chunks):
        rows = (b - a - 1,) if i == len(chunks) - 1 else ()
        work = LaneWork(0, a, ids[a:b], pages[: math.ceil(b / PAGE)], True, sample_rows=rows)
        runner.run_round(RoundPlan((work,)))
    return time.perf_counter() - t0


def measure(fields: dict, dtype: torch.dtype, shape: TraceShape = QUICK_TRACE, repeats: int = 3) -> list[TurnCost]:
    """Replay `shape` through a daemon on a random hybrid model; time each turn's re-prefill."""
    import anyio

    from bench.daemon import spawn_daemon
    from prefixd.gpu.loading import load_checkpoint
    from prefixd.gpu.runner import ModelRunner
    from prefixd.scheduler.chunks import plan_schedule
    from prefixd.scheduler.records import RoundPlan, SamplerSetup, SamplingParams

    with tempfile.TemporaryDirectory(prefix="prefixd-hybrid-") as tmp:
        model = write_model_dir(Path(tmp) / "model", fields, dtype)
        checkpoint = load_checkpoint(str(model), device=torch.device("cpu"), dtype=dtype)
        count_tokens = lambda s: len(checkpoint.tokenizer.encode(s))
        trace = build_trace(shape, count_tokens)
        max_context = 4096
        flags = ["--lanes", "1", "--max-context", str(max_context), "--grid", str(GRID),
                 "--dtype", "bf16" if dtype == torch.bfloat16 else "fp32", "--cache-budget", "2G"]
        print("replaying the agent trace through a daemon (store on)", file=sys.stderr)
        with spawn_daemon(flags, model=str(model)) as handle:
            replies = anyio.run(_replay, handle.socket, shape, trace.system, trace.turns, count_tokens)
        pages = tuple(range(math.ceil(max_context / PAGE)))
        runner = ModelRunner(checkpoint, device=torch.device("cpu"), dtype=dtype, num_lanes=1,
                             num_pages=len(pages), page_size=PAGE)
        out = []
        for turn, ids, starts, new_start, usage in replies:
            n = len(ids)
            schedule = plan_schedule(n, sorted({s for s in starts if 0 < s < n}), GRID)
            new = n - new_start
            runner.run_round(RoundPlan(samplers=(SamplerSetup(0, SamplingParams(), tuple(ids)),)))
            chunks = schedule.chunks(usage.cached_tokens)
            reply_chunks = [c for c in chunks if c[1] <= new_start]
            full = statistics.median(_prefill_s(runner, ids, chunks, pages) for _ in range(repeats))
            again = statistics.median(_prefill_s(runner, ids, reply_chunks, pages) for _ in range(repeats))
            out.append(TurnCost(turn.conversation, turn.index, n, usage.cached_tokens, usage.prefilled_tokens,
                                new, usage.completion_tokens, usage.ttft_s, full, again))
        return out


def table(costs: list[TurnCost]) -> str:
    """Per turn: tokens by kind, the daemon's TTFT, the re-prefill's time and its share of the
    turn's prefill timed here (both back to back) and of the daemon's TTFT."""
    rows = []
    for c in costs:
        later = c.index > 0  # a first turn has no reply before it
        rows.append([c.conversation, c.index, c.context, c.cached, c.prefilled, c.new, c.reply,
                     c.reprefilled if later else "-", f"{c.ttft_s * 1e3:,.0f}", f"{c.prefill_s * 1e3:,.0f}",
                     f"{c.reprefill_s * 1e3:,.0f}" if later else "-",
                     f"{c.reprefill_s / c.prefill_s:.1%}" if later else "-",
                     f"{c.reprefill_s / c.ttft_s:.1%}" if later else "-"])
    headers = ["conv", "turn", "context", "cached", "prefilled", "new", "reply tokens", "re-prefilled",
               "daemon TTFT ms", "prefill ms (here)", "re-prefill ms (here)", "share of prefill (here)",
               "share of daemon TTFT"]
    return markdown_table(headers, rows)
