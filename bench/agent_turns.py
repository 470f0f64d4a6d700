"""An agent's turns end to end, prefixd's daemon beside llama.cpp with a slot per conversation.

    python bench/agent_turns.py            # two conversations growing to ~3.6K tokens, 3 passes each
    python bench/agent_turns.py --quick    # a smoke run (small sizes, one pass)

The workload: `--conversations` conversations (2) share nothing but the model. Each starts
with a system prompt of `--system` ids (1,000), and every turn appends `--user` new ids (300)
and then the reply of `--reply` tokens (128), for `--turns` turns (6), so the last turn's prompt
is about 1,000 + 6 x 300 + 5 x 128 = 3,440 ids and its context ends near 3,570. The
conversations are interleaved: turn 1 of each, then turn 2 of each, and so on, one turn at a
time. The ids are drawn from a seeded generator above the special-token range (the runtime
bench's pseudo-text), so that replies run their full length.

A turn's time is the wall time from sending its request to its last token: its time to first
token (the new ids' prefill, after a resume) plus its decode.

- **prefixd**: a fresh `prefixd serve --disk-cache ""` (no disk tier to warm from), every turn a
  socket `generate` of the conversation's ids so far (system, turns, its own replies), greedy,
  `max_tokens` the reply length: the daemon resumes from what it kept (a resident lane, or the
  store) and prefills the rest.
- **llama.cpp** (llama-cpp-python, the same GGUF and thread count, one context with a sequence
  per conversation, its slot): each turn prefills only the new ids on top of what the slot
  holds, then decodes the reply greedily (argmax of each row's logits) token by token. To keep
  the two engines' work identical, llama.cpp decodes prefixd's reply ids of the same turn (the
  same count; each step still reads its logits and takes their argmax), so both hold the same
  contexts throughout.

Engines run one at a time (never side by side: two thread teams on two cores change every
figure), in `--passes` alternating passes; the tables show medians over passes. The ratio
column is prefixd / llama.cpp of the same turn (lower is faster).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import LlamaCppBaseline, ServedDaemon, fmt_ratio, markdown_table, median, print_machine  # noqa: E402


@dataclass(frozen=True)
class Shape:
    conversations: int
    system: int
    user: int
    reply: int
    turns: int

    @property
    def context(self) -> int:
        """The last turn's context once its reply is in."""
        return self.system + self.turns * (self.user + self.reply)


FULL = Shape(conversations=2, system=1000, user=300, reply=128, turns=6)
QUICK = Shape(conversations=2, system=200, user=64, reply=16, turns=2)


def ids(n: int, vocab: int, seed: int) -> list[int]:
    """Seeded pseudo-text: ids above the special-token range."""
    rng = random.Random(seed)
    return [rng.randrange(32, vocab) for _ in range(n)]


def user_ids(shape: Shape, vocab: int, conv: int, turn: int) -> list[int]:
    """What turn `turn` of conversation `conv` adds before its reply (the system prompt too at turn 0)."""
    new = ids(shape.user, vocab, 1000 * conv + turn + 1)
    return ids(shape.system, vocab, 1000 * conv) + new if turn == 0 else new


@dataclass
class TurnTime:
    conv: int
    turn: int
    prompt: int  # the turn's prompt ids
    ttft_s: float
    total_s: float
    engine_ttft_s: float | None = None  # prefixd: the engine's own, from its submit (usage.ttft_s)


def order(shape: Shape) -> list[tuple[int, int]]:
    """(conversation, turn) pairs, interleaved."""
    return [(c, t) for t in range(shape.turns) for c in range(shape.conversations)]


@dataclass
class Served:
    """What prefixd gave in one pass, by (conversation, turn)."""

    replies: dict[tuple[int, int], list[int]]
    cached: dict[tuple[int, int], int]
    cache: dict[tuple[int, int], str]
    draft_tokens: int
    accepted_tokens: int

    def digest(self) -> str:
        """sha256 of every reply's ids in turn order (equal across runs: drafted = undrafted)."""
        import hashlib

        return hashlib.sha256(repr(sorted(self.replies.items())).encode()).hexdigest()[:16]


def run_prefixd(shape: Shape, vocab: int | None, model: str,
                flags: Sequence[str]) -> tuple[list[TurnTime], Served, int]:
    """One pass through a fresh daemon: each turn's times, what it gave, and the vocabulary size
    the ids were drawn under (the daemon's, when `vocab` is None)."""
    import anyio

    from prefixd.ipc.client import AsyncClient
    from prefixd.ipc.events import DoneEvent, TokenEvent

    replies: dict[tuple[int, int], list[int]] = {}
    cached: dict[tuple[int, int], int] = {}
    kinds: dict[tuple[int, int], str] = {}
    drafted = [0, 0]  # tokens drafted and verified, of them accepted
    times: list[TurnTime] = []

    async def go(socket: str) -> None:
        nonlocal vocab
        history: dict[int, list[int]] = {c: [] for c in range(shape.conversations)}
        async with await AsyncClient.connect(socket) as client:
            if vocab is None:
                vocab = int((await client.status())["model"]["vocab_size"])
            for conv, turn in order(shape):
                history[conv] += user_ids(shape, vocab, conv, turn)
                prompt = list(history[conv])
                out: list[int] = []
                first = None
                engine_ttft = None
                t0 = time.perf_counter()
                async for event in client.generate(tokens=prompt, max_tokens=shape.reply):
                    if isinstance(event, TokenEvent) and event.ids:
                        first = first if first is not None else time.perf_counter()
                        out.extend(event.ids)
                    elif isinstance(event, DoneEvent):
                        cached[conv, turn] = event.usage.cached_tokens
                        engine_ttft = event.usage.ttft_s
                        kinds[conv, turn] = event.usage.cache
                        drafted[0] += event.usage.draft_tokens
                        drafted[1] += event.usage.accepted_tokens
                end = time.perf_counter()
                times.append(TurnTime(conv, turn, len(prompt), (first or end) - t0, end - t0, engine_ttft))
                replies[conv, turn] = out
                history[conv] += out

    with ServedDaemon(["--disk-cache", "", *flags], model=model) as daemon:
        anyio.run(go, daemon.socket)
    assert vocab is not None
    return times, Served(replies, cached, kinds, drafted[0], drafted[1]), vocab


def run_llama_cpp(model_path: str, shape: Shape, vocab: int, replies: dict[tuple[int, int], list[int]],
                  threads: int) -> list[TurnTime]:
    """One pass through llama.cpp, a sequence (slot) per conversation, decoding prefixd's replies."""
    import llama_cpp
    import numpy as np

    n_ctx = 256 * -(-shape.conversations * (shape.context + 64) // 256)  # every slot's context, in 256s
    llama = LlamaCppBaseline(model_path, threads=threads, n_ctx=n_ctx, num_seqs=shape.conversations)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llama._model.model))
    llama.prefill(ids(64, vocab, 7))  # warm-up (its first calls set up buffers), as the daemon warms up at start
    llama.clear()

    def argmax() -> int:
        row = llama_cpp.llama_get_logits_ith(llama._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(n_vocab,))))

    held = {c: 0 for c in range(shape.conversations)}  # positions the slot holds
    pending: dict[int, list[int]] = {c: [] for c in range(shape.conversations)}  # sampled, not yet fed
    times: list[TurnTime] = []
    try:
        for conv, turn in order(shape):
            new = pending[conv] + user_ids(shape, vocab, conv, turn)
            reply = replies[conv, turn]
            t0 = time.perf_counter()
            llama.prefill(new, seq=conv, start=held[conv])
            held[conv] += len(new)
            argmax()  # the first reply token
            first = time.perf_counter()
            for token in reply[:-1]:  # each reply token fed back as the slot samples it
                llama.decode([(conv, held[conv], token)])
                held[conv] += 1
                argmax()
            end = time.perf_counter()
            pending[conv] = reply[-1:]  # fed with the next turn's ids, as a slot does
            times.append(TurnTime(conv, turn, held[conv] - len(reply) + 1, first - t0, end - t0))
    finally:
        del llama
    return times


def by_turn(passes: list[list[TurnTime]]) -> dict[tuple[int, int], tuple[float, float, float | None]]:
    """(median TTFT, median turn time, median engine TTFT or None) in seconds by (conversation,
    turn), over passes."""
    out = {}
    for key in {(t.conv, t.turn) for p in passes for t in p}:
        rows = [t for p in passes for t in p if (t.conv, t.turn) == key]
        engine = [t.engine_ttft_s for t in rows if t.engine_ttft_s is not None]
        out[key] = (median([t.ttft_s for t in rows]), median([t.total_s for t in rows]),
                    median(engine) if engine else None)
    return out


def ms(s: float | None) -> str:
    return "—" if s is None else f"{s * 1e3:,.0f}"


def render(shape: Shape, ours: list[list[TurnTime]], theirs: list[list[TurnTime]], served: Served) -> str:
    """The per-turn table and the totals."""
    a, b = by_turn(ours), by_turn(theirs) if theirs else {}
    prompts = {(t.conv, t.turn): t.prompt for t in ours[0]}
    rows = []
    for key in order(shape):
        conv, turn = key
        pa, pb = a[key], b.get(key)
        rows.append([conv + 1, turn + 1, f"{prompts[key]:,}", f"{served.cached[key]:,} ({served.cache[key]})",
                     f"{ms(pa[0])} ({ms(pa[2])})", ms(pb[0] if pb else None), ms(pa[1]), ms(pb[1] if pb else None),
                     fmt_ratio(pa[1], pb[1]) if pb else "—"])
    table = markdown_table(["conv", "turn", "prompt ids", "prefixd cached", "prefixd TTFT ms (engine's)",
                            "llama.cpp TTFT ms", "prefixd turn ms", "llama.cpp turn ms", "turn prefixd / llama.cpp"],
                           rows)

    def totals(passes: list[list[TurnTime]], later: bool) -> tuple[float, float]:
        keep = [[t for t in p if t.turn > 0 or not later] for p in passes]
        return median([sum(t.ttft_s for t in p) for p in keep]), median([sum(t.total_s for t in p) for p in keep])

    sums = []
    for label, later in (("every turn", False), ("turns 2 on (resumed)", True)):
        ta, tb = totals(ours, later), totals(theirs, later) if theirs else None
        sums.append([label, ms(ta[0]), ms(tb[0] if tb else None), fmt_ratio(ta[0], tb[0]) if tb else "—",
                     ms(ta[1]), ms(tb[1] if tb else None), fmt_ratio(ta[1], tb[1]) if tb else "—"])
    summary = markdown_table(["sum over turns", "prefixd TTFT ms", "llama.cpp TTFT ms", "TTFT ratio",
                              "prefixd turn ms", "llama.cpp turn ms", "turn time ratio"], sums)
    return table + "\n\n" + summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, one pass (a smoke run)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--passes", type=int, default=None, help="passes of each engine (default 3; --quick 1)")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--flag", action="append", default=[], help="an extra `prefixd serve` flag (repeatable)")
    args = parser.parse_args(argv)
    import torch

    from prefixd.gpu.default_model import default_model_path

    shape = QUICK if args.quick else FULL
    passes = args.passes or (1 if args.quick else 3)
    path = default_model_path() if args.model == "default" else args.model
    vocab: int | None = None
    threads = torch.get_num_threads()
    llama_ok = not args.no_llama_cpp and str(path).endswith(".gguf")
    if llama_ok:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            llama_ok = False
            print("llama.cpp skipped: llama-cpp-python is not importable", file=sys.stderr)
    ours: list[list[TurnTime]] = []
    theirs: list[list[TurnTime]] = []
    first: Served | None = None
    same = True
    for i in range(passes):
        times, served, vocab = run_prefixd(shape, vocab, args.model, args.flag)
        ours.append(times)
        if first is None:
            first = served
        same = same and served.replies == first.replies
        print(f"pass {i + 1}: prefixd {sum(t.total_s for t in times):.2f} s", file=sys.stderr, flush=True)
        if llama_ok:
            theirs.append(run_llama_cpp(str(path), shape, vocab, first.replies, threads))
            print(f"pass {i + 1}: llama.cpp {sum(t.total_s for t in theirs[-1]):.2f} s", file=sys.stderr, flush=True)
    assert first is not None
    extra = {"model": str(path), "threads": str(threads), "passes": str(passes),
             "workload": f"{shape.conversations} conversations, system {shape.system}, +{shape.user} ids and a "
                         f"{shape.reply}-token reply a turn, {shape.turns} turns (context to {shape.context:,})"}
    if llama_ok:
        import llama_cpp

        extra["llama-cpp-python"] = llama_cpp.__version__
    print_machine(extra)
    print(render(shape, ours, theirs, first))
    short = sorted(k for k, r in first.replies.items() if len(r) < shape.reply)
    print(f"- medians over {passes} passes; engines one at a time, alternating; prefixd through a fresh daemon each "
          f"pass (`--disk-cache \"\"`{''.join(' ' + f for f in args.flag)}), greedy")
    print(f"- prefixd's replies equal in every pass: {'yes' if same else 'NO'}; replies shorter than "
          f"{shape.reply} (an end token): {len(short)}; replies' sha256 {first.digest()}; drafted tokens "
          f"{first.draft_tokens:,}, accepted {first.accepted_tokens:,} (the first pass)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
