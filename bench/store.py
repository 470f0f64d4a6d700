"""Prefix store benchmark: an agent trace replayed through the daemon, store off and on.

    python bench/store.py            # 4 conversations x 10 turns to ~7.5K tokens (tens of minutes)
    python bench/store.py --quick    # 2 conversations x 3 turns, ~2K tokens (a couple of minutes)
    python bench/store.py --restart  # the disk tier across a restart (bench/store_restart.py)

Three daemons replay the same trace (bench/trace.py), one request at a time, conversations
interleaved, greedy replies of `--max-tokens` appended as history: the store off
(`--no-cache`), a budget that fits the working set, and half that budget. Per turn it
records time to first token, cached tokens and the store's bytes; then, in this process,
the floor of each cached turn (the runner prefilling only its new rows after its cached
context) and two simulations over the same token streams: an unbounded cache (the longest
prefix any earlier request computed) and a plain LRU cache of KV pages keyed by the hash of
the page's token prefix, at the half budget. Writes bench/out/store.md and bench/out/store.png.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine_description, markdown_table, median  # noqa: E402
from bench.daemon import DaemonHandle, spawn_daemon  # noqa: E402
from bench.store_restart import add_flags as add_restart_flags  # noqa: E402
from bench.store_restart import run_restart  # noqa: E402
from bench.store_restart import write as write_restart  # noqa: E402
from bench.trace import (FULL_TRACE, PAGE, QUICK_TRACE, Trace, TurnRecord, build_trace,  # noqa: E402
                         distinct_prompt_tokens, lcp, lru_cached, unbounded_cached)

OUT = ROOT / "bench" / "out"


@dataclass(frozen=True)
class Run:
    name: str
    turns: list[TurnRecord]
    wall_s: float  # generates only, summed
    store: dict  # the store's stats after the last turn ({} when off)
    floors: list[float | None]  # per turn, when measured


async def replay(handle: DaemonHandle, trace: Trace, max_tokens: int,
                 floor: FloorMeter | None) -> tuple[list[TurnRecord], float, dict, list[float | None]]:
    """Replay `trace` one request at a time; with `floor`, measure each turn's floor right after it
    (the daemon idles meanwhile, so both see the same machine)."""
    from prefixd.ipc.client import AsyncClient

    history: dict[int, list[dict[str, str]]] = {c: [] for c in range(trace.shape.num_conversations)}
    records, wall_s, store, floors = [], 0.0, {}, []
    async with await AsyncClient.connect(handle.socket) as client:
        for turn in trace.turns:
            messages = [{"role": "system", "content": trace.system}, *history[turn.conversation], turn.message]
            rendered = await client.tokenize(messages=messages)
            t0 = time.perf_counter()
            result = await client.generate(messages=messages, max_tokens=max_tokens).collect()
            wall_s += time.perf_counter() - t0
            history[turn.conversation] += [turn.message, {"role": "assistant", "content": result.text}]
            store = (await client.status()).get("store") or {}
            u = result.usage
            if u.prompt_tokens != len(rendered.ids):
                raise RuntimeError(f"tokenize gave {len(rendered.ids)} ids, generate {u.prompt_tokens}")
            records.append(TurnRecord(turn.conversation, turn.index, tuple(rendered.ids),
                                      tuple(rendered.message_starts or ()), result.ids, u.cached_tokens, u.cache,
                                      u.ttft_s, int(store.get("bytes", 0))))
            floors.append(floor.measure(records[-1]) if floor is not None else None)
    return records, wall_s, store, floors


def run_daemon(name: str, flags: list[str], trace: Trace, args: argparse.Namespace,
               floor: FloorMeter | None = None) -> Run:
    import anyio

    print(f"replaying the trace: {name} ({' '.join(flags)})", file=sys.stderr)
    with spawn_daemon(flags, model=args.model) as handle:
        turns, wall_s, store, floors = anyio.run(replay, handle, trace, args.max_tokens, floor)
    return Run(name, turns, wall_s, store, floors)


# -- the floor: prefill only the new rows after the cached context, in this process --------

class FloorMeter:
    """The floor of a turn: the runner prefilling only rows [cached, n) after its cached rows,
    chunked as the daemon chunks them, sampling the last row (best of 2). Each conversation's
    rows live in their own pages, so earlier turns' rows are the context of later ones."""

    def __init__(self, checkpoint: object, num_conversations: int, max_context: int, grid: int) -> None:
        import torch

        from prefixd.engine.memory import retain_freed_memory
        from prefixd.gpu.runner import ModelRunner

        retain_freed_memory()  # as the daemon does: the floor must not pay page faults it does not
        per_conv = math.ceil(max_context / PAGE)
        self.pages = [tuple(range(c * per_conv, (c + 1) * per_conv)) for c in range(num_conversations)]
        self.runner = ModelRunner(checkpoint, device=torch.device("cpu"), dtype=torch.bfloat16, num_lanes=1,
                                  num_pages=num_conversations * per_conv, page_size=PAGE)
        self.grid = grid
        self.written: dict[int, tuple[int, ...]] = {}  # rows whose KV the pages hold, per conversation

    def measure(self, t: TurnRecord) -> float | None:
        """Seconds to the first token from the cached rows; None when nothing was cached."""
        from prefixd.scheduler.chunks import plan_schedule
        from prefixd.scheduler.records import RoundPlan, SamplerSetup, SamplingParams

        ids, n = t.prompt_ids, t.context
        self.runner.run_round(RoundPlan(samplers=(SamplerSetup(0, SamplingParams(), tuple(ids)),)))
        valid = lcp(self.written.get(t.conversation, ()), ids)
        self._prefill(t.conversation, ids, [(a, min(a + self.grid, t.cached)) for a in range(valid, t.cached, self.grid)])
        chunks = plan_schedule(n, [s for s in t.starts if 0 < s < n], self.grid).chunks(t.cached)
        times = []
        for _ in range(2 if t.cached and chunks else 1):
            t0 = time.perf_counter()
            self._prefill(t.conversation, ids, chunks)
            times.append(time.perf_counter() - t0)
        self.written[t.conversation] = ids
        return min(times) if t.cached and chunks else None

    def _prefill(self, conv: int, ids: tuple[int, ...], chunks: list[tuple[int, int]]) -> None:
        from prefixd.scheduler.records import LaneWork, RoundPlan

        for i, (a, b) in enumerate(chunks):
            rows = (b - a - 1,) if i == len(chunks) - 1 else ()
            work = LaneWork(0, a, ids[a:b], self.pages[conv][: math.ceil(b / PAGE)], True, sample_rows=rows)
            self.runner.run_round(RoundPlan((work,)))


# -- report ----------------------------------------------------------------------------------

def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:,.0f}"


def _x(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def per_turn_table(runs: dict[str, Run], floors: list[float | None]) -> str:
    off, fit, half = runs["off"].turns, runs["fit"].turns, runs["half"].turns
    rows = []
    for i, t in enumerate(fit):
        rows.append([t.conversation, t.index, t.context, t.cached, t.cache, _ms(off[i].ttft_s), _ms(t.ttft_s),
                     _ms(floors[i]), _x(t.ttft_s, floors[i]), _x(off[i].ttft_s, t.ttft_s), half[i].cached,
                     f"{t.store_bytes / 2**20:.1f}"])
    headers = ["conv", "turn", "context", "cached", "cache", "cold TTFT ms", "TTFT ms", "floor ms", "TTFT / floor",
               "cold / TTFT", "cached, half budget", "store MiB"]
    return markdown_table(headers, rows)


def summary_table(runs: dict[str, Run], floors: list[float | None], kv_bytes_per_token: float,
                  lru_half: list[int], unbounded: list[int]) -> str:
    off, fit, half = runs["off"].turns, runs["fit"].turns, runs["half"].turns
    ratios = [t.ttft_s / f for t, f in zip(fit, floors) if f]
    last = max(t.index for t in fit)
    cold_last = median(t.ttft_s for t in off if t.index == last)
    warm_last = median(t.ttft_s for t in fit if t.index == last)
    ctx_last = median(t.context for t in fit if t.index == last)
    store = runs["fit"].store
    rows_held = store.get("pages", 0) * PAGE
    distinct = distinct_prompt_tokens(fit)
    frac = lambda turns: sum(t.cached for t in turns) / sum(t.context for t in turns)  # noqa: E731
    rows = [
        ["cached turn TTFT / floor (median; worst)", f"{median(ratios):.2f}x; {max(ratios):.2f}x" if ratios else "n/a",
         "<= 1.15x"],
        [f"cold TTFT / cached TTFT at the last turn (~{ctx_last:,.0f} tokens)", _x(cold_last, warm_last), ">= 10x"],
        ["cached tokens, fitting budget / unbounded cache", _x(sum(t.cached for t in fit), sum(unbounded)), ">= 0.95x"],
        ["cached tokens, half budget / LRU page cache, half budget", _x(sum(t.cached for t in half), sum(lru_half)),
         ">= 1.00x"],
        ["store bytes / (rows held x raw KV bytes per row)", _x(store.get("bytes"), rows_held * kv_bytes_per_token),
         "<= 1.05x"],
        ["store bytes / (distinct prompt tokens x raw KV bytes per token)",
         _x(store.get("bytes"), distinct * kv_bytes_per_token), "<= 1.05x"],
        ["cached-token fraction: off / fit / half / unbounded / LRU half",
         f"{frac(off):.1%} / {frac(fit):.1%} / {frac(half):.1%} / {sum(unbounded) / sum(t.context for t in fit):.1%}"
         f" / {sum(lru_half) / sum(t.context for t in fit):.1%}", ""],
        ["wall time of the generates: off / fit / half",
         " / ".join(f"{runs[k].wall_s:.1f} s" for k in ("off", "fit", "half")), ""],
        ["store budget: fit / half", " / ".join(f"{runs[k].store.get('budget_bytes', 0) / 2**20:.1f} MiB"
                                                for k in ("fit", "half")), ""],
        ["requests by cache kind: fit / half", " / ".join(_kinds(runs[k].turns) for k in ("fit", "half")), ""],
        ["evictions; refused keeps; skipped saves: fit / half",
         " / ".join(_pressure(runs[k].store) for k in ("fit", "half")), ""],
    ]
    return markdown_table(["measure", "value", "goal"], rows)


def _pressure(store: dict) -> str:
    evicted = sum((store.get("evictions") or {}).values())
    return f"{evicted}; {store.get('refused_keeps', 0)}; {store.get('skipped_saves', 0)}"


def _kinds(turns: list[TurnRecord]) -> str:
    counts: dict[str, int] = {}
    for t in turns:
        counts[t.cache] = counts.get(t.cache, 0) + 1
    return " ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def plot(runs: dict[str, Run], floors: list[float | None], path: Path) -> str:
    try:
        import matplotlib
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, style in (("off", "o"), ("fit", "s"), ("half", "^")):
        turns = runs[name].turns
        left.scatter([t.context for t in turns], [t.ttft_s * 1e3 for t in turns], marker=style, label=f"store {name}")
        if name != "off":
            right.plot([t.store_bytes / 2**20 for t in turns], marker=style, label=f"store {name}")
    fit = runs["fit"].turns
    left.scatter([t.context for t, f in zip(fit, floors) if f], [f * 1e3 for f in floors if f], marker="x",
                 color="black", label="floor (new rows only)")
    left.set(xlabel="prompt tokens", ylabel="TTFT ms", yscale="log", title="time to first token per turn")
    right.set(xlabel="request (replay order)", ylabel="MiB", title="bytes held by the store")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"plot: {path.relative_to(ROOT)}"


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from prefixd.gpu.loading import load_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 conversations x 3 turns (a smoke run)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32, help="reply tokens per turn (greedy)")
    parser.add_argument("--grid", type=int, default=256)
    add_restart_flags(parser)
    args = parser.parse_args(argv)
    shape = QUICK_TRACE if args.quick else FULL_TRACE
    checkpoint = load_checkpoint(args.model, device=torch.device("cpu"), dtype=torch.bfloat16)
    cfg = checkpoint.config
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16
    trace = build_trace(shape, count_tokens=lambda s: len(checkpoint.tokenizer.encode(s)))
    # an upper bound on the working set; the fitting run tells what the store really holds
    per_conv = shape.system_tokens + shape.num_turns * (shape.turn_tokens[1] + args.max_tokens + 16)
    max_context = 4096 if args.quick else 8192
    common = ["--lanes", str(args.lanes), "--max-context", str(max_context), "--grid", str(args.grid)]
    fit_flag = int(1.2 * shape.num_conversations * per_conv * kv_bytes_per_token) + 2**30
    if args.restart:
        write_restart(run_restart(args, trace, common, kv_bytes_per_token), OUT)
        return 0
    runs = {"off": run_daemon("off", [*common, "--no-cache"], trace, args)}
    floor = FloorMeter(checkpoint, shape.num_conversations, max_context, args.grid)
    runs["fit"] = run_daemon("fit", [*common, "--cache-budget", str(fit_flag)], trace, args, floor)
    del floor
    reserved = fit_flag - runs["fit"].store["budget_bytes"]
    half_budget = runs["fit"].store["bytes"] // 2
    runs["half"] = run_daemon("half", [*common, "--cache-budget", str(reserved + half_budget)], trace, args)
    for name, run in runs.items():
        if [t.prompt_ids for t in run.turns] != [t.prompt_ids for t in runs["fit"].turns]:
            print(f"warning: the {name} run saw other prompts than the fitting run", file=sys.stderr)
    floors = runs["fit"].floors
    kv_bytes_per_page = kv_bytes_per_token * PAGE
    lru_half = lru_cached(runs["fit"].turns, runs["half"].store["budget_bytes"] // kv_bytes_per_page)
    unbounded = unbounded_cached(runs["fit"].turns)
    OUT.mkdir(parents=True, exist_ok=True)
    note = plot(runs, floors, OUT / "store.png")
    machine = markdown_table(["machine", "value"], machine_description(
        {"model": args.model, "lanes": str(args.lanes), "trace": f"{shape}", "reply tokens": str(args.max_tokens)}))
    text = "\n\n".join([machine, summary_table(runs, floors, kv_bytes_per_token, lru_half, unbounded),
                        per_turn_table(runs, floors), f"- {note}"])
    (OUT / "store.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
