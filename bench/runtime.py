"""Runtime benchmark: prefill and decode throughput of the round runner beside llama.cpp.

    python bench/runtime.py            # the full table (minutes; run it on an idle machine)
    python bench/runtime.py --quick    # a smoke run with small sizes

Prints one markdown table: prefill tok/s at 512/2048/4096 prompt tokens, single-lane
decode tok/s at 4K context, aggregate decode tok/s at 8 lanes, each beside llama.cpp
(llama-cpp-python, when importable) on the same GGUF file and thread count, measured in
the same run; medians of several repeats. Every runner mode that exists gets a column.

The engines take turns: each row's repeats alternate between them (prefixd's modes, then
llama.cpp, then again), and a ratio is the median of the repeats' own ratios, each of two
timings a few seconds apart. A machine whose speed drifts from minute to minute then moves
both sides of a ratio together; measured one engine after the other, minutes apart, the
same code read 1.55x in one run and 1.96x in the next. `--sequential` measures one engine
after the other (the order of earlier runs in docs/benchmarks.md).

    python bench/runtime.py --busy-core   # also: every row again beside one busy process
    python bench/runtime.py --accuracy    # also: bench/accuracy.py's table (KL, top-1 against fp32)

Below the table, the bytes a one-lane decode token reads (weights by kind, the head, K/V at the
context: bench/token_bytes.py, from the loaded tensors and the GGUF's), the read bandwidth a
streaming sum reaches on the same thread count in the same run (a read takes a turn beside
each repeat of a one-lane decode row, and the median of a row's reads is its bound; with
--sequential, the higher of two reads before and after the engines), and the fraction of that
bound each measured decode reaches.

With --busy-core the engines are measured quiet, then again while one other process spins
on a core, and a second table gives the busy rates and the slowdown (quiet / busy) of each
engine side by side. prefixd runs the daemon's thread policy (prefixd/gpu/threads.py:
torch threads = the cores other processes leave free, re-measured every second) unless
--fixed-threads.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    SWITCH_PAUSE_S,
    LlamaCppBaseline,
    fmt_rate,
    fmt_ratio,
    markdown_table,
    median,
    print_machine,
    rate,
    time_calls,
)
from bench.heads import apply_head, split_mode  # noqa: E402
from bench.token_bytes import (  # noqa: E402
    StreamRead,
    TokenBytes,
    gguf_account,
    read_bandwidth,
    render_account,
    runner_account,
)
from prefixd.gpu.threads import CpuThreads  # noqa: E402
from prefixd.scheduler.records import LaneWork, RoundPlan, SamplerSetup, SamplingParams  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    prefill: tuple[int, ...]  # prompt lengths for prefill tok/s
    decode_context: int  # context of the single-lane decode
    lanes: int  # lanes decoding together
    lane_context: int  # context of each of those lanes
    decode_steps: int  # decode rounds per timing
    repeats: int

    @property
    def longest(self) -> int:
        return max(*self.prefill, self.decode_context + self.decode_steps)

    @property
    def lane_rows(self) -> int:
        return self.lane_context + self.decode_steps


FULL = Sizes(prefill=(512, 2048, 4096), decode_context=4096, lanes=8, lane_context=512, decode_steps=32, repeats=3)
QUICK = Sizes(prefill=(128, 256), decode_context=256, lanes=8, lane_context=64, decode_steps=4, repeats=2)


def prompt_tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    """Deterministic pseudo-text: ids above the special-token range."""
    rng = random.Random(seed)
    return [rng.randrange(32, vocab) for _ in range(n)]


class Measure:
    """The four measurements, for one engine (a runner mode or llama.cpp)."""

    def prefill(self, tokens: Sequence[int]) -> None: ...
    def start_decode(self, contexts: dict[int, Sequence[int]]) -> None: ...
    def decode(self, contexts: dict[int, Sequence[int]], steps: int) -> None: ...


class RunnerMeasure(Measure):
    def __init__(self, checkpoint, *, device: torch.device, dtype: torch.dtype, mode: str, sizes: Sizes, grid: int,
                 threads: CpuThreads | None = None):
        from prefixd.gpu.runner import ModelRunner

        mode, head = split_mode(mode)  # a bench-only head variant ("int4+head=4x2": bench/heads.py)
        page_size = 16
        big = math.ceil(sizes.longest / page_size)
        small = math.ceil(sizes.lane_rows / page_size)
        self.runner = ModelRunner(
            checkpoint,
            device=device,
            dtype=dtype,
            num_lanes=sizes.lanes,
            num_pages=big + (sizes.lanes - 1) * small,
            page_size=page_size,
            mode=mode,
        )
        apply_head(self.runner.model, head)
        self.page_size = page_size
        self.tables = [tuple(range(big))] + [
            tuple(range(big + i * small, big + (i + 1) * small)) for i in range(sizes.lanes - 1)
        ]
        self.grid = grid
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.last: dict[int, int] = {}
        self.threads = threads  # ticked before each round, as the daemon's engine thread does

    def _pages(self, lane: int, rows: int) -> tuple[int, ...]:
        return self.tables[lane][: math.ceil(rows / self.page_size)]

    def _prefill_lanes(self, prompts: dict[int, Sequence[int]]) -> None:
        """Prefill every lane chunk by chunk (grid rows), lanes side by side in each round."""
        self.runner.run_round(RoundPlan(samplers=tuple(SamplerSetup(lane, SamplingParams(), tuple(tokens))
                                                       for lane, tokens in prompts.items())))
        num_rounds = max(math.ceil(len(t) / self.grid) for t in prompts.values())
        for r in range(num_rounds):
            work = []
            for lane, tokens in prompts.items():
                chunk = tuple(tokens[r * self.grid : (r + 1) * self.grid])
                if not chunk:
                    continue
                start = r * self.grid
                last = start + len(chunk) == len(tokens)
                work.append(
                    LaneWork(lane, start, chunk, self._pages(lane, start + len(chunk)), True,
                             sample_rows=(len(chunk) - 1,) if last else ())
                )
            self._run(work)
        self.sync()

    def _run(self, work: list[LaneWork]) -> None:
        if self.threads is not None:
            self.threads.tick()
        for result in self.runner.run_round(RoundPlan(tuple(work))).lanes:
            if result.sampled:
                self.last[result.lane] = result.sampled[-1]

    def prefill(self, tokens: Sequence[int]) -> None:
        self._prefill_lanes({0: tokens})

    def start_decode(self, contexts: dict[int, Sequence[int]]) -> None:
        self._prefill_lanes(contexts)
        self.first = dict(self.last)

    def decode(self, contexts: dict[int, Sequence[int]], steps: int) -> None:
        tokens = dict(self.first)  # every repeat decodes the same rows over the same context
        for step in range(steps):
            work = []
            for lane, ctx in contexts.items():
                pos = len(ctx) + step
                work.append(LaneWork(lane, pos, (tokens[lane],), self._pages(lane, pos + 1), False, sample_rows=(0,)))
            self._run(work)
            tokens.update(self.last)
        self.sync()


class LlamaCppMeasure(Measure):
    def __init__(self, model_path: str, *, threads: int, sizes: Sizes):
        n_ctx = max(sizes.longest, sizes.lanes * sizes.lane_rows) + 64
        self.llama = LlamaCppBaseline(model_path, threads=threads, n_ctx=256 * math.ceil(n_ctx / 256), num_seqs=sizes.lanes)

    def prefill(self, tokens: Sequence[int]) -> None:
        self.llama.clear()
        self.llama.prefill(tokens)

    def start_decode(self, contexts: dict[int, Sequence[int]]) -> None:
        self.llama.clear()
        for seq, ctx in contexts.items():
            self.llama.prefill(ctx, seq=seq)

    def decode(self, contexts: dict[int, Sequence[int]], steps: int) -> None:
        for seq, ctx in contexts.items():
            self.llama.truncate(seq, len(ctx))
        for step in range(steps):
            self.llama.decode([(seq, len(ctx) + step, ctx[-1]) for seq, ctx in contexts.items()])


def measure_all(m: Measure, sizes: Sizes, vocab: int, name: str = "") -> dict[str, float]:
    """tok/s per row label, one engine alone (`--sequential`); each row also on stderr as it is
    measured (a full run takes minutes)."""
    out: dict[str, float] = {}
    for row in table_rows(sizes, vocab):
        row.setup(m)
        out[row.label] = rate(row.count, time_calls(lambda: row.call(m), sizes.repeats, warmup=0))
        _progress(name, row.label, out)
    return out


@dataclass
class Row:
    """One row of the table: on an engine, `setup` (untimed), then timed calls of `call`, each
    of `count` tokens."""

    label: str
    count: int
    setup: Callable[[Measure], None]
    call: Callable[[Measure], None]


def table_rows(sizes: Sizes, vocab: int) -> list[Row]:
    rows = []
    for n in sizes.prefill:
        tokens = prompt_tokens(n, vocab, seed=n)
        rows.append(Row(f"prefill {n} tok", n, lambda m: None, lambda m, t=tokens: m.prefill(t)))
    for label, contexts in decode_cases(sizes, vocab):
        steps = sizes.decode_steps

        def setup(m: Measure, c: dict[int, list[int]] = contexts, s: int = steps) -> None:
            m.start_decode(c)
            m.decode(c, s)  # the warm-up call

        rows.append(Row(label, len(contexts) * steps, setup, lambda m, c=contexts, s=steps: m.decode(c, s)))
    return rows


def measure_turns(engines: dict[str, Measure], sizes: Sizes, vocab: int, reference: str | None,
                  tag: str = "", stream: StreamRead | None = None,
                  readings: dict[str, list[float]] | None = None) -> tuple[Results, Results]:
    """Every row on every engine, the repeats taking turns (engine by engine, repeat by
    repeat): rates (count / the median time) by engine, and each engine's ratio to
    `reference` (the median of the repeats' ratios) by engine. With `stream`, a one-lane
    decode row's repeats take one more turn each: a streaming read, into readings[label]."""
    results: Results = {name: {} for name in engines}
    ratios: Results = {name: {} for name in engines if reference is not None and name != reference}
    for row in table_rows(sizes, vocab):
        for m in engines.values():
            row.setup(m)
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(sizes.repeats):
            for name, m in engines.items():
                time.sleep(SWITCH_PAUSE_S)
                start = time.perf_counter()
                row.call(m)
                times[name].append(time.perf_counter() - start)
            if stream is not None and readings is not None and row.label.startswith("decode 1 lane"):
                time.sleep(SWITCH_PAUSE_S)
                readings.setdefault(row.label, []).append(stream.read())
        for name in engines:
            results[name][row.label] = rate(row.count, times[name])
            _progress(name + tag, row.label, results[name])
        for name in ratios:
            ratios[name][row.label] = median(theirs / ours for ours, theirs in zip(times[name], times[reference]))
    return results, ratios


def _progress(name: str, label: str, out: dict[str, float]) -> None:
    print(f"{name}: {label}: {fmt_rate(out[label])} tok/s", file=sys.stderr, flush=True)


def decode_cases(sizes: Sizes, vocab: int) -> list[tuple[str, dict[int, list[int]]]]:
    lanes = {lane: prompt_tokens(sizes.lane_context, vocab, seed=100 + lane) for lane in range(sizes.lanes)}
    return [
        (f"decode 1 lane @ {sizes.decode_context} ctx", {0: prompt_tokens(sizes.decode_context, vocab, seed=1)}),
        (f"decode 1 lane @ {sizes.lane_context} ctx", {0: lanes[0]}),
        (f"decode {sizes.lanes} lanes @ {sizes.lane_context} ctx (aggregate)", lanes),
    ]


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """One other process spinning on a core for the duration (a desktop's busy neighbour)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


Results = dict[str, dict[str, float]]


def measure_engine(m: Measure, name: str, sizes: Sizes, vocab: int, busy: bool,
                   results: Results, busy_results: Results) -> None:
    """Quiet rates into results[name]; with `busy`, the same again beside busy_core()."""
    results[name] = measure_all(m, sizes, vocab, name)
    if busy:
        with busy_core():
            busy_results[name] = measure_all(m, sizes, vocab, f"{name} (busy core)")


@dataclass
class Account:
    """The bytes account of a run: per engine, and the read bandwidth measured around the engines."""

    engines: dict[str, TokenBytes] = dataclasses.field(default_factory=dict)
    bandwidth: list[float] = dataclasses.field(default_factory=list)  # bytes/s, before and after
    turns: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # row label -> reads in its turns


def run_engines(args: argparse.Namespace, sizes: Sizes,
                account: Account) -> tuple[Results, Results, Results, list[str], dict[str, str]]:
    """Load every engine, measure (in turns, or one after the other with --sequential), and
    return rates, busy rates, ratios to llama.cpp (in turns only), notes and versions."""
    from prefixd.gpu.loading import load_checkpoint

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    checkpoint = load_checkpoint(args.model, device=device, dtype=dtype)
    vocab = checkpoint.tokenizer.vocab_size
    num_threads = torch.get_num_threads()  # llama.cpp's too; the policy may lower prefixd's per round
    results: Results = {}
    busy_results: Results = {}
    ratios: Results = {}
    notes: list[str] = []
    versions = {"model": str(checkpoint.path), "dtype": args.dtype, "grid": str(args.grid),
                "threads": str(num_threads),
                "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
                "order": "one engine after the other" if args.sequential else "in turns, repeat by repeat"}
    policy = None if args.fixed_threads or device.type != "cpu" else CpuThreads.up_to_current()
    account.bandwidth.append(read_bandwidth(num_threads))
    engines: dict[str, Measure] = {}

    def measure_one(name: str, m: Measure) -> None:
        if args.sequential:
            measure_engine(m, name, sizes, vocab, args.busy_core, results, busy_results)
            if args.profile and isinstance(m, RunnerMeasure):
                notes.extend(profile(m, sizes, vocab, name.removeprefix("prefixd ")))
        else:
            engines[name] = m

    for mode in args.modes.split(","):
        try:
            # the model takes the tensors it uses out of the dict: each mode gets its own dict
            own = dataclasses.replace(checkpoint, tensors=dict(checkpoint.tensors))
            m = RunnerMeasure(own, device=device, dtype=dtype, mode=mode, sizes=sizes, grid=args.grid,
                              threads=policy)
        except (ValueError, NotImplementedError) as exc:
            notes.append(f"prefixd mode {mode!r} not available: {exc}")
            continue
        graphs = m.runner.programs.status() if m.runner.programs is not None else None
        if graphs is not None:  # CUDA: decode rounds replay graphs (gpu/programs.py)
            notes.append(f"prefixd {mode}: decode programs captured as CUDA graphs: {graphs}")
        with contextlib.suppress(ValueError):  # a family without an account (hybrid) goes without
            account.engines[f"prefixd {mode}"] = runner_account(m.runner)
        m._prefill_lanes({0: prompt_tokens(min(2 * args.grid, sizes.longest), vocab)})  # warm-up: allocator, kernels
        measure_one(f"prefixd {mode}", m)
        del m
        gc.collect()
    if args.no_llama_cpp:
        notes.append("llama.cpp skipped (--no-llama-cpp)")
    elif str(checkpoint.path).endswith(".gguf") and args.device == "cpu":
        try:
            llama = LlamaCppMeasure(str(checkpoint.path), threads=num_threads, sizes=sizes)
        except ImportError:
            notes.append("llama.cpp skipped: llama-cpp-python is not importable (pip install llama-cpp-python)")
        else:
            versions["llama-cpp-python"] = llama.llama.version
            llama.prefill(prompt_tokens(min(2 * args.grid, sizes.longest), vocab))  # warm-up
            measure_one("llama.cpp", llama)
            account.engines["llama.cpp"] = gguf_account(str(checkpoint.path))
    else:
        notes.append("llama.cpp skipped: it is compared on the CPU with a GGUF model only")
    if engines:
        reference = "llama.cpp" if "llama.cpp" in engines else None
        quiet, ratios = measure_turns(engines, sizes, vocab, reference, stream=StreamRead(num_threads),
                                      readings=account.turns)
        results.update(quiet)
        if args.busy_core:
            with busy_core():
                busy_results.update(measure_turns(engines, sizes, vocab, None, " (busy core)")[0])
        if args.profile:
            for name, m in engines.items():
                if isinstance(m, RunnerMeasure):
                    notes.extend(profile(m, sizes, vocab, name.removeprefix("prefixd ")))
        engines.clear()
        gc.collect()
    if policy is not None:
        torch.set_num_threads(policy.max_threads)
    account.bandwidth.append(read_bandwidth(num_threads))
    if policy is not None:
        notes.append(f"prefixd thread policy: up to {policy.max_threads} threads, the free cores each second "
                     f"(last count {policy.threads})")
    return results, busy_results, ratios, notes, versions


def profile(m: RunnerMeasure, sizes: Sizes, vocab: int, mode: str) -> list[str]:
    """Top operators (self CPU time, by input shape) of one prefill, one single-lane decode and
    one 8-lane decode, and the top-level torch calls per decode round, as note lines."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    lines = []
    (one_label, one), (_, lanes) = decode_cases(sizes, vocab)[1:]  # 1 lane and all lanes @ lane_context
    n = sizes.prefill[-1]
    steps = sizes.decode_steps
    cases = [
        (f"prefill {n} tok", lambda: None, lambda: m.prefill(prompt_tokens(n, vocab)), 0),
        (one_label, lambda: m.start_decode(one), lambda: m.decode(one, steps), steps),
        (f"decode {sizes.lanes} lanes", lambda: m.start_decode(lanes), lambda: m.decode(lanes, steps), steps),
    ]
    for label, setup, fn, rounds in cases:
        setup()
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fn()
        table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12)
        if rounds:
            calls = sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))
            label += f" ({calls / rounds:.0f} top-level torch calls a round)"
        lines.append(f"profile, {mode}, {label}:\n```\n{table}\n```")
    return lines


def render(results: dict[str, dict[str, float]], sizes: Sizes, ratios: Results | None = None) -> str:
    """The rates table; a ratio column is `ratios`' (the repeats' median, measured in turns)
    where it has the row, else the ratio of the two medians."""
    ratios = ratios or {}
    engines = list(results)
    ours = [e for e in engines if e.startswith("prefixd")]
    theirs = results.get("llama.cpp")
    labels = list(next(iter(results.values()))) if results else []
    headers = ["tok/s", *engines, *(f"{e.removeprefix('prefixd ')} / llama.cpp" for e in ours if theirs)]
    rows = []
    for label in labels:
        row: list[object] = [label, *(fmt_rate(results[e].get(label)) for e in engines)]
        if theirs:
            row += [f"{ratios[e][label]:.2f}x" if label in ratios.get(e, {})
                    else fmt_ratio(results[e].get(label), theirs.get(label)) for e in ours]
        rows.append(row)
    lines = [markdown_table(headers, rows), ""]
    for e in engines:
        single = results[e].get(f"decode 1 lane @ {sizes.lane_context} ctx")
        agg = results[e].get(f"decode {sizes.lanes} lanes @ {sizes.lane_context} ctx (aggregate)")
        lines.append(f"- {e}: {sizes.lanes}-lane aggregate / single lane at {sizes.lane_context} ctx = {fmt_ratio(agg, single)}")
    return "\n".join(lines)


def render_busy(results: Results, busy: Results) -> str:
    """Busy-core rates and each engine's slowdown (quiet / busy), engines side by side."""
    engines = list(busy)
    labels = list(next(iter(busy.values()))) if busy else []
    headers = ["beside one busy core", *(f"{e} tok/s" for e in engines), *(f"{e} slowdown" for e in engines)]
    rows = []
    for label in labels:
        rates = [fmt_rate(busy[e].get(label)) for e in engines]
        slowdowns = [fmt_ratio(results[e].get(label), busy[e].get(label)) for e in engines]
        rows.append([label, *rates, *slowdowns])
    return markdown_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, fewer repeats (a smoke run)")
    parser.add_argument("--model", default="default", help='"default", a .gguf path or a HF directory')
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--modes", default="invariant,int4",
                        help="runner modes to measure, comma separated (bench/heads.py's head variants too)")
    parser.add_argument("--busy-core", action="store_true", help="measure again beside one spinning process")
    parser.add_argument("--fixed-threads", action="store_true", help="no thread policy: torch's count throughout")
    parser.add_argument("--grid", type=int, default=256, help="prefill chunk rows per round")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--sequential", action="store_true",
                        help="measure one engine after the other, not in turns (every engine's rows, then the next's)")
    parser.add_argument("--profile", action="store_true", help="print the top operators of each runner mode")
    parser.add_argument("--accuracy", action="store_true",
                        help="also bench/accuracy.py's table for the same modes and model")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.repeats:
        sizes = Sizes(sizes.prefill, sizes.decode_context, sizes.lanes, sizes.lane_context, sizes.decode_steps, args.repeats)
    account = Account()
    results, busy_results, ratios, notes, versions = run_engines(args, sizes, account)
    print_machine(versions)
    print(render(results, sizes, ratios))
    if busy_results:
        print()
        print(render_busy(results, busy_results))
    for note in notes:
        print(f"- {note}")
    print(f"- medians of {sizes.repeats} repeats; decode: {sizes.decode_steps} rounds per repeat, greedy"
          + ("" if args.sequential or not ratios else "; a ratio is the median of the repeats' ratios (engines "
             "in turns, a repeat each)"))
    if account.engines:
        print()
        print(render_bytes(account, results, sizes))
    if args.accuracy:
        from bench import accuracy

        print()
        print(accuracy.report(model=args.model, modes=args.modes.split(","), llama_cpp=not args.no_llama_cpp))
    return 0


def render_bytes(account: Account, results: Results, sizes: Sizes) -> str:
    """The bytes account of the one-lane decode rows beside their measured rates."""
    mean_ctx = lambda c: c + (sizes.decode_steps + 1) / 2  # noqa: E731 (a timed step at context+s reads context+s rows)
    contexts = {f"decode 1 lane @ {c} ctx": round(mean_ctx(c)) for c in (sizes.decode_context, sizes.lane_context)}
    bound = max(account.bandwidth)
    turns = {label: median(account.turns[label]) for label in contexts if account.turns.get(label)}
    lines = [render_account(account.engines, results, contexts, {label: turns.get(label, bound) for label in contexts}),
             f"- read bandwidth: {', then '.join(f'{b / 1e9:.2f}' for b in account.bandwidth)} GB/s (a streaming "
             f"sum over a 1 GiB fp32 buffer on {torch.get_num_threads()} threads, median of 5, before and after the "
             f"engines)" + (f"; the bound is the higher, {bound / 1e9:.2f} GB/s" if len(turns) < len(contexts) else ""),
             *(f"- {label}: the bound from the streaming reads taken in turns with the engines' repeats "
               f"(a 256 MiB buffer): {', '.join(f'{b / 1e9:.2f}' for b in account.turns[label])} GB/s, median "
               f"{turns[label] / 1e9:.2f}" for label in turns),
             "- K/V at the mean context the timed tokens read (context + steps / 2); bound = bandwidth / total"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
