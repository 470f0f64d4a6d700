"""Soak: honest clients beside hostile ones against a real daemon, for a stated time.

    python bench/soak.py --seconds 120      # the measurement (run it on an idle machine)
    python bench/soak.py --seconds 20       # a short check that it works

Starts `prefixd serve` on the default model (Unix socket only, metrics off), then:
1. reference: each of a fixed list of seeded generates (token prompts, seeded sampling,
   logits digests) once, alone; baseline: the honest clients alone for --baseline-seconds,
   each sending the list in turn; every output must equal the reference;
2. soak: the same honest clients for --seconds beside hostile ones (in a child process of
   their own, as a hostile app would be; `--actions` picks some): malformed frames, huge
   memfd payloads, trickling slow clients, floods of cheap frames, NaN images, sampling
   edges, huge chat renders (some abandoned mid-render), clients that leave mid-stream; with
   `--http` also hostile HTTP callers (bodies that are not JSON or nest too deep, bodies over
   the limit, a body trickled a byte at a time, huge chats, streams left after one event,
   floods of completions at sampling edges) beside the same honest socket clients.
   Baseline and soak alternate in --windows pairs of windows (a sixth of each time by
   default), so that a slow spell of a shared machine falls on both phases, not on one; a
   soak window ends when every hostile action has returned, and the next baseline window
   starts then. RSS "before" is read after the first baseline window;
3. settle: wait until no lane is busy and both processes' idle trims have run (each hands
   freed heap back once after IDLE_TRIM_S idle; status counts them; the same wait precedes
   the "before" reading), then read RSS (by process too), fds and pages again.

It prints one table: requests served, errors by code, honest p50/p99 TTFT with and without
hostile clients and their ratio, whether honest outputs are bit-equal to the reference,
honest failures, RSS before/peak/after, fds and pages before and after, and the CPU the
daemon used per second of each phase (the front process's event-loop thread, the engine
process with all its threads, the front's worker threads, and the heavy render worker
processes, which run at the lowest priority in the moments the engine leaves). RSS is the
front's and its child processes' together (the engine, and the heavy worker a warm-up render
starts before the baseline), and so are fds. Every loop is bounded by the deadline and a
count; every wait by a timeout. It stops by itself.

With `--trace FILE` it also writes every honest request (phase, start, TTFT) and every
hostile action (name, start, end) as JSON lines, in time.monotonic() seconds: a run's p99
rests on its ~20 slowest requests, and the trace shows what each of them ran beside.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import markdown_table, print_machine  # noqa: E402
from bench.soak_hostile import HOSTILE_ACTIONS, HTTP_HOSTILE_ACTIONS, Tally, huge_chat_messages  # noqa: E402
from bench.soak_proc import Daemon  # noqa: E402
from prefixd.ipc.client import AsyncClient  # noqa: E402
from prefixd.ipc.errors import ClientError  # noqa: E402
from prefixd.ipc.messages import TokenEvent  # noqa: E402

REQUEST_TIMEOUT_S = 120.0  # one honest request; a liveness bound, reported as a failure
MAX_LOOPS = 100_000  # iterations of any client loop, besides the deadline
SETTLE_TIMEOUT_S = 60.0


@dataclass
class HonestRun:
    """What the honest clients saw in one phase."""

    ttft_s: list[float] = field(default_factory=list)
    served: int = 0
    failures: int = 0
    mismatches: int = 0
    failure_kinds: Counter = field(default_factory=Counter)
    cpu_s: dict[str, float] = field(default_factory=dict)  # the daemon's threads over the phase
    starts: list[float] = field(default_factory=list)  # each ttft_s entry's request start (time.monotonic())


def honest_requests(vocab: int, count: int, seed: int) -> list[dict[str, Any]]:
    """Seeded generates: token prompts of 24-96 ids, seeded sampling, logits digests, no stops."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        tokens = [rng.randrange(16, vocab) for _ in range(rng.randint(24, 96))]
        sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + k}
        out.append({"tokens": tokens, "max_tokens": 12, "sampling": sampling, "logits": True,
                    "stop_ids": []})
    return out


async def honest_client(path: str, requests: list[dict[str, Any]], offset: int, deadline: float,
                        run: HonestRun, reference: dict[int, tuple]) -> None:
    """Send `requests` in turn (from `offset`) until the deadline; record TTFT and outputs."""
    async with await AsyncClient.connect(path) as client:
        for i in range(MAX_LOOPS):
            if time.monotonic() >= deadline:
                return
            key = (offset + i) % len(requests)
            started = time.monotonic()
            try:
                with anyio.fail_after(REQUEST_TIMEOUT_S):
                    output, ttft = await _one_generate(client, requests[key])
            except (ClientError, TimeoutError, OSError) as e:
                run.failures += 1
                run.failure_kinds[getattr(e, "code", type(e).__name__)] += 1
                continue
            run.served += 1
            run.ttft_s.append(ttft)
            run.starts.append(started)
            if output != reference[key]:
                run.mismatches += 1


async def _one_generate(client: AsyncClient, request: dict[str, Any]) -> tuple[tuple, float]:
    start = time.perf_counter()
    first: float | None = None
    ids: list[int] = []
    digests: list[str] = []
    async with client.generate(**request) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                first = first if first is not None else time.perf_counter()
                ids.extend(event.ids)
                digests.extend(event.logits_sha256 or ())
    assert stream.done is not None, "iteration ends after done"
    if stream.done.finish_reason not in ("length", "stop"):
        raise ClientError(stream.done.finish_reason, stream.done.note or "honest generate did not finish")
    return (tuple(ids), tuple(digests), stream.done.finish_reason), (first or time.perf_counter()) - start


async def run_phase(daemon: Daemon, requests: list[dict[str, Any]], seconds: float, num_honest: int,
                    reference: dict[int, tuple], hostile: Hostile | None, tally: Tally,
                    run: HonestRun | None = None) -> HonestRun:
    """Honest clients (and the hostile ones, in their own process) until `seconds` pass; the
    daemon threads' CPU time over the phase is added to `run.cpu_s`. `run`: a phase's record
    that earlier windows of the same phase started (a fresh one when None)."""
    run = HonestRun() if run is None else run
    if hostile is not None:
        await anyio.to_thread.run_sync(hostile.ready.wait, 120.0)  # the child has imported everything
    cpu_before, children_before = daemon.thread_cpu_s(), daemon.children_cpu_s()
    deadline = time.monotonic() + seconds
    if hostile is not None:
        hostile.start(deadline)
    async with anyio.create_task_group() as tg:
        tg.start_soon(daemon.sample_rss, deadline)
        for c in range(num_honest):
            tg.start_soon(honest_client, daemon.socket, requests, c * 3, deadline, run, reference)
    used = _cpu_used(cpu_before, daemon.thread_cpu_s(), daemon.proc.pid)
    children = daemon.children_cpu_s()
    for role in ("engine", "heavy"):  # the engine process (all its threads); the heavy render workers
        used[role] = children.get(role, 0.0) - children_before.get(role, 0.0)
    for key, value in used.items():
        run.cpu_s[key] = run.cpu_s.get(key, 0.0) + value
    if hostile is not None:
        await anyio.to_thread.run_sync(hostile.collect, tally)  # every hostile action has returned
    return run


def _cpu_used(before: dict[int, float], after: dict[int, float], loop_tid: int) -> dict[str, float]:
    """CPU seconds of the front process's event-loop thread and of its other threads (workers);
    the engine process's are added by the caller."""
    used = {tid: cpu - before.get(tid, 0.0) for tid, cpu in after.items()}
    loop = used.pop(loop_tid, 0.0)
    return {"loop": loop, "other": sum(used.values())}


class Hostile:
    """The hostile clients, in a child process of their own (as a hostile app would be), so
    that their client-side work does not delay the honest clients' own event loop."""

    def __init__(self, daemon: Daemon, copies: int, actions: Sequence[str]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.ready, self._go, self._results = ctx.Event(), ctx.Queue(), ctx.Queue()
        target = {"socket": daemon.socket, "hidden": daemon.hidden, "http_url": daemon.http_url}
        self.proc = ctx.Process(target=_hostile_main, args=(target, copies, list(actions), self.ready,
                                                            self._go, self._results), daemon=True)
        self.proc.start()

    def start(self, deadline: float) -> None:
        self._go.put(deadline)  # time.monotonic() is the system's CLOCK_MONOTONIC: shared by processes

    def collect(self, tally: Tally) -> None:
        """Wait for the window `start` began to end (every hostile action returned) and add its counts."""
        sent, codes, cpu_s, spans = self._results.get(timeout=120.0)
        tally.sent += sent
        tally.codes.update(codes)
        tally.cpu_s += cpu_s
        tally.spans += spans

    def stop(self) -> None:
        self._go.put(None)
        self.proc.join(timeout=10.0)


def _hostile_main(target: dict[str, Any], copies: int, actions: list[str], ready: Any, go: Any,
                  results: Any) -> None:
    """One window of hostile actions per deadline `go` hands over, until it hands over None."""
    by_name = {action.__name__: action for action in [*HOSTILE_ACTIONS, *HTTP_HOSTILE_ACTIONS]}
    chosen = [by_name[name] for name in actions]
    ready.set()
    target = SimpleNamespace(**target)
    while (deadline := go.get()) is not None:
        tally = Tally()

        async def run() -> None:
            async with anyio.create_task_group() as tg:
                for _ in range(copies):
                    for action in chosen:
                        tg.start_soon(_hostile_loop, action, target, deadline, tally)

        cpu_before = time.process_time()
        anyio.run(run)
        results.put((tally.sent, dict(tally.codes), time.process_time() - cpu_before, tally.spans))


async def _hostile_loop(action: Any, daemon: Daemon, deadline: float, tally: Tally) -> None:
    for _ in range(MAX_LOOPS):
        if time.monotonic() >= deadline:
            return
        start = time.monotonic()
        with anyio.move_on_after(max(0.1, min(30.0, deadline - time.monotonic() + 5))):
            try:
                await action(daemon, tally)
            except (OSError, ClientError, anyio.BrokenResourceError, anyio.EndOfStream,
                    anyio.ClosedResourceError) as e:
                tally.note(getattr(e, "code", type(e).__name__))
        tally.spans.append((action.__name__, start, time.monotonic()))
        await anyio.sleep(0.01)


async def fill_reference(daemon: Daemon, requests: list[dict[str, Any]]) -> dict[int, tuple]:
    """Each honest request once, alone, untimed: the outputs every later run must equal (and
    the warm-up: the first forward passes are slow)."""
    reference: dict[int, tuple] = {}
    async with await AsyncClient.connect(daemon.socket) as client:
        for key, request in enumerate(requests):
            with anyio.fail_after(REQUEST_TIMEOUT_S):
                reference[key] = (await _one_generate(client, request))[0]
    return reference


async def start_heavy_worker(daemon: Daemon) -> None:
    """One heavy render (a huge_chat's), untimed: it starts the front's heavy worker process,
    a fixed cost kept for the daemon's life (prefixd/front/heavy.py), so RSS before and after
    the soak compare the same processes."""
    messages = huge_chat_messages()
    async with await AsyncClient.connect(daemon.socket) as client:
        with anyio.fail_after(REQUEST_TIMEOUT_S):
            await client.tokenize(messages=messages)


def write_trace(path: Path, base: HonestRun, soak: HonestRun, tally: Tally) -> None:
    """JSON lines, in time.monotonic() seconds: each honest request's phase, start and TTFT, and
    each hostile action's name, start and end, so a slow request can be set beside what ran
    with it."""
    with path.open("w") as f:
        for phase, run in (("baseline", base), ("soak", soak)):
            for start, ttft in zip(run.starts, run.ttft_s):
                f.write(json.dumps({"honest": phase, "start": start, "ttft_s": ttft}) + "\n")
        for name, start, end in tally.spans:
            f.write(json.dumps({"hostile": name, "start": start, "end": end}) + "\n")


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _cpu_text(cpu_s: dict[str, float], seconds: float) -> str:
    return " / ".join(f"{cpu_s.get(k, 0.0) / seconds:.2f}" for k in ("loop", "engine", "other", "heavy"))


def report(base: HonestRun, soak: HonestRun, tally: Tally, before: dict, after: dict, peak_rss: int,
           seconds: float, base_seconds: float, windows: int) -> str:
    def ms(v: float) -> str:
        return f"{v * 1000:.1f} ms"

    p50b, p99b = percentile(base.ttft_s, 0.5), percentile(base.ttft_s, 0.99)
    p50s, p99s = percentile(soak.ttft_s, 0.5), percentile(soak.ttft_s, 0.99)
    mib = 1 << 20
    rows = [
        ("soak time", f"{seconds:g} s"),
        ("windows (baseline and soak alternate)", str(windows)),
        ("honest requests served (baseline / soak)", f"{base.served} / {soak.served}"),
        ("hostile requests sent", str(tally.sent)),
        ("errors by code (hostile)", ", ".join(f"{k} {v}" for k, v in sorted(tally.codes.items())) or "none"),
        ("honest TTFT p50 (baseline / soak)", f"{ms(p50b)} / {ms(p50s)}"),
        ("honest TTFT p99 (baseline / soak)", f"{ms(p99b)} / {ms(p99s)}"),
        ("honest p99 ratio soak / baseline", f"{p99s / p99b:.2f}x" if p99b > 0 else "n/a"),
        ("honest outputs bit-equal to the reference", "yes" if soak.mismatches == 0 and soak.served else "no"),
        ("honest mismatches (baseline / soak)", f"{base.mismatches} / {soak.mismatches}"),
        ("honest failures (baseline / soak)", f"{base.failures} / {soak.failures}"),
        ("honest failures by kind (soak)", ", ".join(f"{k} {v}" for k, v in sorted(soak.failure_kinds.items())) or "none"),
        ("RSS before / peak / after", f"{before['rss'] / mib:.0f} / {peak_rss / mib:.0f} / {after['rss'] / mib:.0f} MiB"),
        ("RSS after / before", f"{after['rss'] / before['rss']:.3f}"),
        ("RSS before / after by process", ", ".join(
            f"{name} {before['rss_by'].get(name, 0) / mib:.0f} / {rss / mib:.0f} MiB" for name, rss in after["rss_by"].items())),
        ("processes before / after (the front and its children)", f"{before['processes']} / {after['processes']}"),
        ("fds before / after", f"{before['fds']} / {after['fds']}"),
        ("pages used before / after", f"{before['pages_used']} / {after['pages_used']}"),
        ("lanes busy / waiting after", f"{after['lanes_busy']} / {after['waiting']}"),
        ("CPU s per s, front loop / engine process / front threads / heavy workers (baseline)", _cpu_text(base.cpu_s, base_seconds)),
        ("CPU s per s, front loop / engine process / front threads / heavy workers (soak)", _cpu_text(soak.cpu_s, seconds)),
        ("hostile clients' own CPU s per s (their process)", f"{tally.cpu_s / seconds:.2f}"),
    ]
    return markdown_table(["measure", "value"], rows)


async def main_async(args: argparse.Namespace) -> int:
    with Daemon.spawn(args.model, args.flags, args.daemon_root, http=args.http) as daemon:
        hello = await daemon.hello()
        vocab = int(hello.model["vocab_size"])
        daemon.hidden = int(hello.model.get("hidden_size", 0))
        requests = honest_requests(vocab, args.requests, args.seed)
        tally = Tally()
        reference = await fill_reference(daemon, requests)
        await start_heavy_worker(daemon)
        hostile = Hostile(daemon, args.hostile, args.actions) if args.hostile else None
        base, soak, before = HonestRun(), HonestRun(), None
        for _ in range(args.windows):
            await run_phase(daemon, requests, args.baseline_seconds / args.windows, args.honest, reference, None,
                            tally, base)
            if before is None:  # after the first baseline window: every process started, nothing hostile yet
                before = await daemon.measure(SETTLE_TIMEOUT_S)
                daemon.peak_rss = before["rss"]
            await run_phase(daemon, requests, args.seconds / args.windows, args.honest, reference, hostile, tally,
                            soak)
        if hostile is not None:
            hostile.stop()
        after = await daemon.measure(SETTLE_TIMEOUT_S)
        print(report(base, soak, tally, before, after, daemon.peak_rss, args.seconds, args.baseline_seconds, args.windows))
        if args.trace is not None:
            write_trace(args.trace, base, soak, tally)
        if args.verbose:
            print(f"\ndaemon log tail:\n{daemon.log_tail(6000)}")
    return 0 if soak.failures == 0 and soak.mismatches == 0 and base.mismatches == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0, help="soak time with hostile clients")
    parser.add_argument("--baseline-seconds", type=float, default=None, help="honest-only time (default: seconds/2)")
    parser.add_argument("--windows", type=int, default=6,
                        help="baseline and soak alternate in this many pairs of windows (each a share of "
                             "--baseline-seconds, then of --seconds), so that a slow spell of the machine "
                             "falls on both; 1: the whole baseline, then the whole soak")
    parser.add_argument("--model", default="default")
    parser.add_argument("--honest", type=int, default=3, help="honest clients")
    parser.add_argument("--hostile", type=int, default=1, help="copies of each hostile client")
    parser.add_argument("--requests", type=int, default=8, help="distinct honest requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--http", action="store_true",
                        help="serve HTTP too, and add the hostile HTTP callers to the default actions")
    parser.add_argument("--actions", default=None,
                        help="the hostile actions to run, comma-separated (default: every socket one, "
                             "and with --http every HTTP one)")
    parser.add_argument("--daemon-root", type=Path, default=ROOT,
                        help="the source tree the daemon runs from (default: this one)")
    parser.add_argument("--flags", nargs=argparse.REMAINDER, default=[], help="extra `prefixd serve` flags")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write each honest request (phase, start, TTFT) and each hostile action "
                             "(name, start, end) to this file as JSON lines")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    offered = [*HOSTILE_ACTIONS, *(HTTP_HOSTILE_ACTIONS if args.http else [])]
    if args.actions is None:
        args.actions = ",".join(a.__name__ for a in offered)
    args.actions = [name for name in args.actions.split(",") if name]
    known = {a.__name__ for a in offered}
    if not set(args.actions) <= known:
        parser.error(f"--actions: unknown {sorted(set(args.actions) - known)}; known: {sorted(known)}"
                     + ("" if args.http else " (the http_ ones need --http)"))
    if args.baseline_seconds is None:
        args.baseline_seconds = max(5.0, args.seconds / 2)
    print_machine({"soak": f"{args.seconds:g} s, {args.honest} honest, {args.hostile}x{len(args.actions)} hostile",
                   "hostile actions": ", ".join(args.actions), "daemon code": str(args.daemon_root)})
    return anyio.run(main_async, args)


if __name__ == "__main__":
    raise SystemExit(main())
