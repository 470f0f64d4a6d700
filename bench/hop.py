"""Hop: what the engine process and its link cost greedy decode, against the engine in-process.

    python bench/hop.py                    # the measurement, about a minute (run it on an idle machine)
    python bench/hop.py --quick            # a smoke run with small sizes
    python bench/hop.py --device cuda      # the same on a GPU
    python bench/hop.py --draft off        # the round rate alone (no draft policy in the ratio)

Loads the model in this process the way the engine process does (`load_runtime` from the
same `serve` flags) and drives its `Engine` directly, round by round; and starts
`prefixd serve` with those flags (metrics on). The same greedy workload, at 1 lane and at 8
lanes (8 concurrent streams, one connection each): 128-token prompts, 128 generated tokens
each, fresh prompts for every pair. In-process and socket are measured back to back, in
pairs (on a shared machine only side-by-side figures compare), the first side alternating
from pair to pair, each side starting `SWITCH_PAUSE_S` after the other ended (its spinning
threads asleep). Before both, the side that ran second read slower by a few % on this machine,
whichever it was (in one run of ten pairs at eight lanes, the daemon's median ratio was 0.948x
where it ran second and 0.966x where it ran first).

It prints one table: decode tok/s in-process and through the daemon, their ratio (goal
>= 0.97x), whether the generated ids are equal, the rounds per second on each side (the
daemon's from its round-duration histogram), and the bytes one round message carries over
the engine link: each in-process round's events and observer calls encoded and framed as
the engine process sends a round's with `--stream-interval 0` (`contract.encode`,
`link.pack`; by default it joins a stream's later tokens over several rounds into one
message), with the link's bytes per second at the daemon's round rate. tok/s counts tokens while every lane decodes (prefill
left out); rounds/s counts every round from the first submit to the last token.

A second table accounts for the CPU a round takes in each process: the in-process engine
(this process), and through the daemon its engine process, its front process and the client
(this process again, reading its 8 connections). On a machine whose cores the engine's
threads fill, the front's and the client's CPU is taken from the engine's team: their share
of the cores bounds the ratio (a team member preempted for a millisecond holds its partner
at the next barrier for as long). It also splits a round's wall time on each side into the
round's own (`Engine.step`, the duration the engine reports to its observer; the daemon's from
the same histogram) and the rest of the span a round (the loop around the step, the link):
where the daemon's rounds are slower, its own rounds show whether the loss is in the rounds
(team members waiting for a core) or between them.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import SWITCH_PAUSE_S, ServedDaemon, fmt_ratio, markdown_table, median, print_machine  # noqa: E402
from bench.daemon import scrape  # noqa: E402
from prefixd.gpu.threads import own_cpu_s, process_cpu_s  # noqa: E402
from prefixd.ipc.client import AsyncClient  # noqa: E402
from prefixd.ipc.events import TokenEvent  # noqa: E402

MAX_ROUNDS = 100_000  # in-process rounds of one run, at most
REQUEST_TIMEOUT_S = 300.0
ROUND_METRIC = "prefixd_round_duration_seconds"
GOAL_RATIO = 0.97


@dataclass(frozen=True)
class Sizes:
    prompt: int
    tokens: int
    lanes: tuple[int, ...]
    pairs: int


FULL = Sizes(prompt=128, tokens=128, lanes=(1, 8), pairs=3)
QUICK = Sizes(prompt=32, tokens=16, lanes=(1, 8), pairs=1)


@dataclass
class Decode:
    """One run: per stream, the arrival time of each token, and its ids."""

    arrivals: list[list[float]]
    ids: list[tuple[int, ...]]
    span_s: float  # first submit to last token
    rounds: int
    round_bytes: list[int] = field(default_factory=list)  # in-process: each round message's frame
    step_s: float = 0.0  # the rounds' own wall time (the engine's on_round durations), summed
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds in the run, by process

    def tok_s(self) -> float:
        """Tokens per second while every stream decodes (after the last first token, before the first last one)."""
        start = max(a[0] for a in self.arrivals)
        end = min(a[-1] for a in self.arrivals)
        if len(self.arrivals) == 1:
            start, end = self.arrivals[0][0], self.arrivals[0][-1]
        inside = sum(1 for a in self.arrivals for t in a if start < t <= end)
        return inside / (end - start) if end > start else float("nan")

    def rounds_s(self) -> float:
        return self.rounds / self.span_s

    def tokens_per_round(self) -> float:
        return sum(len(i) for i in self.ids) / self.rounds if self.rounds else float("nan")

    def step_ms(self) -> float:
        """A round's own wall time, mean (`Engine.step`: plan, device, land)."""
        return 1e3 * self.step_s / self.rounds if self.rounds else float("nan")

    def between_ms(self) -> float:
        """Wall time a round that is not its own, mean: the span's rest (the loop around the
        step, the link, a team member's wait for a core)."""
        return 1e3 * self.span_s / self.rounds - self.step_ms() if self.rounds else float("nan")

    def cpu_ms_per_round(self, who: str) -> float:
        return 1e3 * self.cpu_s[who] / self.rounds if self.rounds else float("nan")


def cpu_by_process(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of the processes in `pids` (by role) and of this one, the client."""
    return {who: process_cpu_s(pid) for who, pid in pids.items()} | {"client": own_cpu_s()}


def prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, vocab) for _ in range(length)] for _ in range(num)]


def serve_flags(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--device", args.device, "--lanes", "8", "--disk-cache", "", "--draft", args.draft]


class InProcess:
    """The engine process's runtime, in this process: rounds driven one by one, each one's
    round message framed as the engine process would send it."""

    def __init__(self, flags: Sequence[str]) -> None:
        from prefixd.daemon.cli import build_parser
        from prefixd.daemon.config import config_from_args
        from prefixd.engine.process import RecordingObserver
        from prefixd.engine.runtime import load_runtime

        cfg = config_from_args(build_parser().parse_args(["serve", *flags]))
        self.observer = RecordingObserver()
        self.runtime = load_runtime(cfg, observer=self.observer)
        self.vocab = int(self.runtime.model_info["vocab_size"])
        self._ids = iter(range(1, 1 << 30))

    def decode(self, lane_prompts: list[list[int]], max_tokens: int) -> Decode:
        from prefixd.engine.contract import encode, message
        from prefixd.engine.link import pack
        from prefixd.ipc.framing import close_fds
        from prefixd.scheduler.streams import StreamRequest
        from prefixd.scheduler.streams import TokenEvent as EngineToken

        engine, runtime = self.runtime.engine, self.runtime
        order = {}
        start, cpu_start = time.perf_counter(), own_cpu_s()
        for lane, tokens in enumerate(lane_prompts):
            sid = next(self._ids)
            order[sid] = lane
            engine.submit(StreamRequest(stream_id=sid, tokens=tuple(tokens), max_tokens=max_tokens))
        arrivals: list[list[float]] = [[] for _ in lane_prompts]
        ids: list[list[int]] = [[] for _ in lane_prompts]
        run = Decode(arrivals, [], 0.0, 0)
        self.observer.take()
        for _ in range(MAX_ROUNDS):
            if engine.idle:
                break
            if runtime.before_round is not None:
                runtime.before_round()
            events = engine.step()
            now = time.perf_counter()
            run.rounds += 1
            for event in events:
                if isinstance(event, EngineToken):
                    arrivals[order[event.stream_id]].extend([now] * len(event.ids))
                    ids[order[event.stream_id]].extend(event.ids)
            allocator = engine.allocator
            observed = self.observer.take()
            run.step_s += sum(args[0] for name, args in observed if name == "on_round")
            data, fds = pack(message("round", events=[encode(e) for e in events], observed=observed,
                                     pages=[allocator.num_free, allocator.num_used]))
            close_fds(fds)
            run.round_bytes.append(len(data))
        run.span_s = max(a[-1] for a in arrivals) - start
        run.ids = [tuple(i) for i in ids]
        run.cpu_s = {"engine": own_cpu_s() - cpu_start}
        return run


async def socket_decode(socket: str, metrics_url: str, lane_prompts: list[list[int]], max_tokens: int,
                        pids: dict[str, int]) -> Decode:
    """The same workload through the daemon, one connection per stream; rounds from its metrics;
    the CPU of the processes in `pids` (by role) and of this one (the client)."""
    arrivals: list[list[float]] = [[] for _ in lane_prompts]
    ids: list[list[int]] = [[] for _ in lane_prompts]

    async def one(lane: int) -> None:
        async with await AsyncClient.connect(socket) as client:
            request = client.generate(tokens=lane_prompts[lane], max_tokens=max_tokens, stop_ids=[],
                                      sampling={"temperature": 0.0})
            async for event in request:
                if isinstance(event, TokenEvent):
                    arrivals[lane].extend([time.perf_counter()] * len(event.ids))
                    ids[lane].extend(event.ids)

    before = await anyio.to_thread.run_sync(scrape, metrics_url)
    cpu_before = cpu_by_process(pids)
    start = time.perf_counter()
    with anyio.fail_after(REQUEST_TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            for lane in range(len(lane_prompts)):
                tg.start_soon(one, lane)
    span = max(a[-1] for a in arrivals) - start
    cpu_after = cpu_by_process(pids)
    await anyio.sleep(0.2)  # the last round's observer calls reach the front's metrics
    after = await anyio.to_thread.run_sync(scrape, metrics_url)
    rounds = int(after.get(f"{ROUND_METRIC}_count", 0) - before.get(f"{ROUND_METRIC}_count", 0))
    step_s = after.get(f"{ROUND_METRIC}_sum", 0.0) - before.get(f"{ROUND_METRIC}_sum", 0.0)
    return Decode(arrivals, [tuple(i) for i in ids], span, rounds, step_s=step_s,
                  cpu_s={who: cpu_after[who] - cpu_before[who] for who in cpu_before})


async def engine_pid(socket: str) -> int:
    async with await AsyncClient.connect(socket) as client:
        return int((await client.status())["engine"]["pid"])


@dataclass
class Pair:
    lanes: int
    local: Decode
    sock: Decode


def measure(args: argparse.Namespace, sizes: Sizes) -> tuple[list[Pair], str]:
    local = InProcess(serve_flags(args))
    warm = prompts(8, sizes.prompt, local.vocab, seed=999)
    local.decode(warm, 4)  # warm-up
    pairs: list[Pair] = []
    with ServedDaemon(serve_flags(args)[2:], model=args.model, metrics=True, root=args.daemon_root) as daemon:
        assert daemon.metrics_url is not None, "metrics=True"
        assert daemon.proc is not None
        pids = {"engine": anyio.run(engine_pid, daemon.socket), "front": daemon.proc.pid}
        anyio.run(socket_decode, daemon.socket, daemon.metrics_url, warm, 4, pids)
        for p in range(sizes.pairs):
            for lanes in sizes.lanes:
                work = prompts(lanes, sizes.prompt, local.vocab, seed=p * 100 + lanes)
                sides = {"in-process": lambda: local.decode(work, sizes.tokens),
                         "socket": lambda: anyio.run(socket_decode, daemon.socket, daemon.metrics_url, work,
                                                     sizes.tokens, pids)}
                order = list(sides) if p % 2 == 0 else list(sides)[::-1]  # the first side alternates
                runs = {}
                for side in order:
                    time.sleep(SWITCH_PAUSE_S)  # the other side's spinning threads are not this side's neighbours
                    runs[side] = sides[side]()
                mine, theirs = runs["in-process"], runs["socket"]
                pairs.append(Pair(lanes, mine, theirs))
                print(f"pair {p + 1}, {lanes} lanes ({order[0]} first): in-process "
                      f"{mine.tok_s():.1f} tok/s, socket {theirs.tok_s():.1f} tok/s, ratio "
                      f"{theirs.tok_s() / mine.tok_s():.3f}, load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    return pairs, str(local.runtime.model_info.get("mode"))


def report(pairs: list[Pair], sizes: Sizes) -> str:
    rows = []
    for lanes in sizes.lanes:
        mine = [p for p in pairs if p.lanes == lanes]
        local_tok = median(p.local.tok_s() for p in mine)
        sock_tok = median(p.sock.tok_s() for p in mine)
        ratio = median(p.sock.tok_s() / p.local.tok_s() for p in mine)
        equal = all(p.local.ids == p.sock.ids for p in mine)
        decode_bytes = [b for p in mine for b in p.local.round_bytes]
        per_round = median(decode_bytes)
        sock_rounds = median(p.sock.rounds_s() for p in mine)
        rows.append([lanes, f"{local_tok:.1f}", f"{sock_tok:.1f}", f"{ratio:.3f}x",
                     "met" if ratio >= GOAL_RATIO else "MISSED", "yes" if equal else "no",
                     f"{median(p.local.rounds_s() for p in mine):.1f}", f"{sock_rounds:.1f}",
                     f"{median(p.local.tokens_per_round() for p in mine):.2f} / "
                     f"{median(p.sock.tokens_per_round() for p in mine):.2f}",
                     f"{per_round:.0f}", f"{per_round * sock_rounds / 1024:.1f}"])
    return markdown_table(["lanes", "in-process tok/s", "socket tok/s", "ratio (socket / in-process)",
                           f"goal >= {GOAL_RATIO}x", "ids equal", "in-process rounds/s", "daemon rounds/s",
                           "tokens / round (in-process / daemon)", "link bytes / round (median)", "link KiB/s at daemon rounds/s"], rows)


def cpu_report(pairs: list[Pair], sizes: Sizes) -> str:
    """CPU milliseconds a round, by process (medians over the pairs), and the share of the
    machine's cores the front and the client took while the daemon decoded."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    rows = []
    for lanes in sizes.lanes:
        mine = [p for p in pairs if p.lanes == lanes]
        beside = median((p.sock.cpu_s["front"] + p.sock.cpu_s["client"]) / p.sock.span_s / cores for p in mine)
        rows.append([lanes, f"{median(p.local.cpu_ms_per_round('engine') for p in mine):.2f}",
                     *(f"{median(p.sock.cpu_ms_per_round(who) for p in mine):.2f}" for who in ("engine", "front", "client")),
                     f"{100 * beside:.1f} %",
                     f"{median(p.local.step_ms() for p in mine):.2f} / {median(p.sock.step_ms() for p in mine):.2f}",
                     f"{median(p.local.between_ms() for p in mine):.2f} / {median(p.sock.between_ms() for p in mine):.2f}"])
    return markdown_table(["lanes", "in-process engine CPU ms / round", "daemon: engine", "front", "client",
                           f"front + client, share of {cores} cores", "round wall ms, own (in-process / daemon)",
                           "between rounds ms (in-process / daemon)"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, one pair (a smoke run)")
    parser.add_argument("--pairs", type=int, default=None, help="in-process/socket pairs per lane count")
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: the daemon's and the in-process engine's")
    parser.add_argument("--draft", default="auto", choices=["auto", "ngram", "mtp", "off"],
                        help="`serve --draft` on both sides; off takes the draft policy's choices out of the "
                             "ratio, which then measures the round rate alone (default: %(default)s)")
    parser.add_argument("--daemon-root", default=str(ROOT), help="the source tree the daemon runs from")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.pairs is not None:
        sizes = Sizes(sizes.prompt, sizes.tokens, sizes.lanes, max(1, args.pairs))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the daemon is stopped too
    pairs, mode = measure(args, sizes)
    print_machine({"model": args.model, "device": args.device, "mode": mode, "draft": args.draft,
                   "pairs": str(sizes.pairs),
                   "daemon code": args.daemon_root})
    print(report(pairs, sizes))
    print()
    print(cpu_report(pairs, sizes))
    print(f"\n- workload: {sizes.prompt}-token prompts, {sizes.tokens} greedy tokens each, no stop ids; 8 lanes: "
          "8 streams at once (8 connections on the socket side); in-process and socket back to back, in turns "
          "(the first side alternating), fresh prompts each pair; tok/s counted while every stream decodes, ratio the median of the pairs'")
    print("- link bytes / round: every in-process round's `round` message (events, observer calls, pages) "
          "through contract.encode and link.pack, as the engine process frames it; rounds/s from first submit "
          "to last token (the daemon's from prefixd_round_duration_seconds_count); tokens / round: all generated tokens over "
          "those rounds (drafts verified raise it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
