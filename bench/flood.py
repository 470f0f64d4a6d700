"""Flood: one honest client's short generates, alone and beside six clients flooding prefills.

    python bench/flood.py                  # the measurement, ~2 min: three 25 s phases (run it on an idle machine)
    python bench/flood.py --quick          # a smoke run (a few seconds a phase)

Starts `prefixd serve` on the default model (cold: `--disk-cache ""`, metrics off, the HTTP
front on a free loopback port). One honest client (this process, the Unix socket) sends
4-token greedy generates of a short prompt, with logits digests, one after another, and
records each one's TTFT (send to its first token event):
1. alone, for --seconds;
2. beside a socket flood: six other clients, each a process of its own (so the daemon's
   SO_PEERCRED tells them apart), each sending ~200-token prompts (words drawn per request,
   so the prefix cache cannot serve them) with max_tokens 1, back to back, for --seconds;
3. the same flood through HTTP (/v1/completions), each flood client its own namespace
   (`user` and x-prefixd-namespace).
Every honest output (token ids and logits digests) must equal the alone run's.

It prints one table: honest requests, p50/p99 TTFT and their ratios to alone, the honest
share of all requests served in the phase, flood requests served, and whether the honest
outputs are bit-equal; then the goals (printed, not asserted): p50 <= 3x alone, p99 <= 5x,
share >= 1/7. Every loop is bounded by the deadline and a count; every wait by a timeout.
"""

from __future__ import annotations

import argparse
import multiprocessing
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

from bench.common import ServedDaemon, markdown_table, median, percentile, print_machine  # noqa: E402
from prefixd.ipc.client import AsyncClient  # noqa: E402
from prefixd.ipc.errors import ClientError  # noqa: E402
from prefixd.ipc.events import TokenEvent  # noqa: E402

NUM_FLOOD = 6
HONEST_PROMPTS = ("The capital of France is", "Write one word about the sea:", "2 + 2 =", "Name a colour:")
HONEST_MAX_TOKENS = 4
FLOOD_WORDS = 200
REQUEST_TIMEOUT_S = 120.0  # one request; a liveness bound, counted as a failure
MAX_LOOPS = 100_000  # iterations of any client loop, besides the deadline
READY_TIMEOUT_S = 120.0  # flood processes importing their libraries
DRAIN_TIMEOUT_S = 60.0
GOAL_P50, GOAL_P99, GOAL_SHARE = 3.0, 5.0, 1 / 7
# Words the flood prompts are drawn from (mostly one token each with a leading space).
WORDS = tuple("""time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word business
issue side kind head house service friend father power hour game line end member law car city community
name president team minute idea kid body information back parent face others level office door health
person art war history party result change morning reason research girl guy moment air teacher force
education foot boy age policy music market sense nation plan college interest death experience effect
class control care field development role effort rate heart drug show leader light voice wife police
mind price report decision son view relationship town road arm difference value building action model
season society tax director position player record paper space ground form event official matter center
couple site project activity star table need court oil situation cost industry figure street image phone
data picture practice piece land product doctor wall patient worker news test movie north love support
technology step baby computer type attention film tree source organization hair window evidence
population truth song energy""".split())


@dataclass
class Honest:
    """What the honest client saw in one phase."""

    ttft_s: list[float] = field(default_factory=list)
    outputs: dict[int, set[tuple]] = field(default_factory=dict)  # prompt index -> distinct outputs
    failures: int = 0


@dataclass
class Phase:
    name: str
    honest: Honest
    flood_served: int = 0
    flood_failures: int = 0
    equal: bool = True


def honest_request(key: int) -> dict[str, Any]:
    return {"prompt": HONEST_PROMPTS[key % len(HONEST_PROMPTS)], "max_tokens": HONEST_MAX_TOKENS,
            "sampling": {"temperature": 0.0, "seed": 7}, "logits": True, "stop_ids": []}


async def honest_loop(socket: str, deadline: float, max_requests: int) -> Honest:
    """Generates in turn until the deadline (or `max_requests`); TTFT and outputs of each."""
    run = Honest()
    async with await AsyncClient.connect(socket) as client:
        await client.hello(client="flood-honest")
        for i in range(min(max_requests, MAX_LOOPS)):
            if time.monotonic() >= deadline:
                break
            key = i % len(HONEST_PROMPTS)
            try:
                with anyio.fail_after(REQUEST_TIMEOUT_S):
                    output, ttft = await one_generate(client, honest_request(key))
            except (ClientError, TimeoutError, OSError):
                run.failures += 1
                continue
            run.ttft_s.append(ttft)
            run.outputs.setdefault(key, set()).add(output)
    return run


async def one_generate(client: AsyncClient, request: dict[str, Any]) -> tuple[tuple, float]:
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
    done = stream.done
    if done is None or done.finish_reason not in ("length", "stop"):
        raise ClientError("error", f"generate ended with {done.finish_reason if done else 'nothing'}")
    return (tuple(ids), tuple(digests)), (first or time.perf_counter()) - start


def flood_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Flood:
    """`NUM_FLOOD` flood clients, one process each, started and ready before the phase."""

    def __init__(self, kind: str, socket: str, http_url: str | None, words: int, seed: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._results = ctx.Queue()
        self._procs, self._readies, self._gos = [], [], []
        for c in range(NUM_FLOOD):
            ready, go = ctx.Event(), ctx.Queue()
            proc = ctx.Process(target=_flood_main, daemon=True,
                               args=(kind, c, socket, http_url, words, seed * 100 + c, ready, go, self._results))
            proc.start()
            self._procs.append(proc)
            self._readies.append(ready)
            self._gos.append(go)

    def wait_ready(self) -> None:
        for ready in self._readies:
            if not ready.wait(READY_TIMEOUT_S):
                raise RuntimeError("a flood process did not start in time")

    def start(self, deadline: float) -> None:
        for go in self._gos:
            go.put(deadline)  # time.monotonic() is CLOCK_MONOTONIC: shared by processes

    def collect(self) -> tuple[int, int]:
        """(served, failed) over all flood clients; joins their processes."""
        served = failed = 0
        for _ in self._procs:
            s, f = self._results.get(timeout=REQUEST_TIMEOUT_S + 30)
            served, failed = served + s, failed + f
        for proc in self._procs:
            proc.join(timeout=10.0)
            if proc.is_alive():
                proc.kill()
        return served, failed


def _flood_main(kind: str, index: int, socket: str, http_url: str | None, words: int, seed: int,
                ready: Any, go: Any, results: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops them
    rng = random.Random(seed)
    loop = _socket_flood if kind == "socket" else _http_flood
    ready.set()
    deadline = go.get()
    tally = [0, 0]
    anyio.run(loop, index, socket, http_url, words, rng, deadline, tally)
    results.put((tally[0], tally[1]))


async def _socket_flood(index: int, socket: str, http_url: str | None, words: int, rng: random.Random,
                        deadline: float, tally: list[int]) -> None:
    async with await AsyncClient.connect(socket) as client:
        await client.hello(client=f"flood-{index}")
        for _ in range(MAX_LOOPS):
            if time.monotonic() >= deadline:
                return
            request = {"prompt": flood_prompt(rng, words), "max_tokens": 1, "stop_ids": []}
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                try:
                    with anyio.fail_after(REQUEST_TIMEOUT_S):
                        await client.generate(**request).collect()
                    tally[0] += 1
                except (ClientError, TimeoutError, OSError):
                    tally[1] += 1


async def _http_flood(index: int, socket: str, http_url: str | None, words: int, rng: random.Random,
                      deadline: float, tally: list[int]) -> None:
    import httpx

    namespace = f"flood-{index}"
    async with httpx.AsyncClient(base_url=http_url or "", timeout=REQUEST_TIMEOUT_S,
                                 headers={"x-prefixd-namespace": namespace}) as http:
        for _ in range(MAX_LOOPS):
            if time.monotonic() >= deadline:
                return
            body = {"model": "default", "prompt": flood_prompt(rng, words), "max_tokens": 1, "user": namespace}
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                try:
                    reply = await http.post("/v1/completions", json=body)
                    tally[0 if reply.status_code == 200 else 1] += 1
                except httpx.HTTPError:
                    tally[1] += 1


async def drain(socket: str) -> None:
    """Wait until no lane is busy and nothing waits (or the timeout passes)."""
    async with await AsyncClient.connect(socket) as client:
        with anyio.move_on_after(DRAIN_TIMEOUT_S):
            while True:
                status = await client.status()
                if status["lanes_busy"] == 0 and status["waiting"] == 0:
                    return
                await anyio.sleep(0.1)


def run_phase(daemon: ServedDaemon, name: str, kind: str | None, args: argparse.Namespace) -> Phase:
    flood = Flood(kind, daemon.socket, daemon.http_url, args.words, args.seed) if kind else None
    if flood is not None:
        flood.wait_ready()
    deadline = time.monotonic() + args.seconds
    if flood is not None:
        flood.start(deadline)
    honest = anyio.run(honest_loop, daemon.socket, deadline, args.max_requests)
    phase = Phase(name, honest)
    if flood is not None:
        phase.flood_served, phase.flood_failures = flood.collect()
    anyio.run(drain, daemon.socket)
    print(f"{name}: {len(honest.ttft_s)} honest, {phase.flood_served} flood served", file=sys.stderr, flush=True)
    return phase


def judge(phases: list[Phase]) -> None:
    """Each phase's honest outputs equal the alone phase's (one output per prompt)."""
    reference = phases[0].honest.outputs
    for phase in phases:
        outputs = phase.honest.outputs
        phase.equal = (phase.honest.failures == 0 and bool(outputs)
                       and all(len(got) == 1 and got == reference.get(key) for key, got in outputs.items()))


def report(phases: list[Phase]) -> str:
    alone = phases[0].honest
    a50, a99 = percentile(alone.ttft_s, 0.5), percentile(alone.ttft_s, 0.99)
    rows = []
    for phase in phases:
        h = phase.honest
        p50, p99 = percentile(h.ttft_s, 0.5), percentile(h.ttft_s, 0.99)
        served = len(h.ttft_s) + phase.flood_served
        rows.append([phase.name, len(h.ttft_s), f"{p50 * 1e3:.1f}", f"{p99 * 1e3:.1f}",
                     f"{p50 / a50:.2f}x", f"{p99 / a99:.2f}x", f"{len(h.ttft_s) / served:.3f}" if served else "n/a",
                     phase.flood_served, "yes" if phase.equal else "no"])
    table = markdown_table(["phase", "honest requests", "honest p50 TTFT ms", "p99 ms", "p50 ratio to alone",
                            "p99 ratio", "honest share", "flood requests", "outputs equal"], rows)
    goals = []
    for phase in phases[1:]:
        h = phase.honest
        p50, p99 = percentile(h.ttft_s, 0.5) / a50, percentile(h.ttft_s, 0.99) / a99
        share = len(h.ttft_s) / max(1, len(h.ttft_s) + phase.flood_served)
        goals.append([phase.name, _met(p50 <= GOAL_P50, f"{p50:.2f}x"), _met(p99 <= GOAL_P99, f"{p99:.2f}x"),
                      _met(share >= GOAL_SHARE, f"{share:.3f}"), f"{h.failures} / {phase.flood_failures}"])
    goal_table = markdown_table(["goal (not asserted)", f"p50 <= {GOAL_P50:g}x", f"p99 <= {GOAL_P99:g}x",
                                 f"share >= 1/7 ({GOAL_SHARE:.3f})", "failures honest / flood"], goals)
    return f"{table}\n\n{goal_table}"


def _met(ok: bool, text: str) -> str:
    return f"{text} {'met' if ok else 'MISSED'}"


def flood_prompt_tokens(socket: str, words: int, seed: int) -> float:
    """The median token count of a few flood prompts (the daemon's tokenizer)."""
    async def count() -> float:
        rng = random.Random(seed)
        async with await AsyncClient.connect(socket) as client:
            return median([len((await client.tokenize(flood_prompt(rng, words))).ids) for _ in range(5)])

    return anyio.run(count)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=25.0, help="length of each phase")
    parser.add_argument("--flood", choices=("socket", "http", "both"), default="both",
                        help="which flood phases to run after the alone phase")
    parser.add_argument("--max-requests", type=int, default=20_000, help="honest requests per phase, at most")
    parser.add_argument("--words", type=int, default=FLOOD_WORDS, help="words per flood prompt")
    parser.add_argument("--model", default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--daemon-root", default=str(ROOT), help="the source tree the daemon runs from")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 s phases")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = min(args.seconds, 4.0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the daemon is stopped too
    kinds = ["socket", "http"] if args.flood == "both" else [args.flood]
    flags = ["--lanes", "8", "--disk-cache", ""]
    with ServedDaemon(flags, model=args.model, http="http" in kinds, root=args.daemon_root) as daemon:
        prompt_tokens = flood_prompt_tokens(daemon.socket, args.words, args.seed)
        anyio.run(honest_loop, daemon.socket, time.monotonic() + 2.0, 2 * len(HONEST_PROMPTS))  # warm-up
        phases = [run_phase(daemon, "alone", None, args)]
        for kind in kinds:
            phases.append(run_phase(daemon, f"{kind} flood", kind, args))
    judge(phases)
    print_machine({"model": args.model, "phase": f"{args.seconds:g} s", "flood": f"{NUM_FLOOD} clients, "
                   f"~{prompt_tokens:.0f}-token prompts, max_tokens 1", "daemon code": args.daemon_root})
    print(report(phases))
    print(f"\n- honest: one socket client, {len(HONEST_PROMPTS)} short prompts in turn, max_tokens "
          f"{HONEST_MAX_TOKENS}, greedy, logits digests; TTFT is send to first token event; "
          "outputs equal: every honest output (ids and digests) equals the alone phase's for its prompt")
    print("- share: honest requests / (honest + flood) served in the phase; socket flood: one process and "
          "connection per client; http flood: /v1/completions, one namespace (user, x-prefixd-namespace) per client")
    return 0 if all(p.equal for p in phases) else 1


if __name__ == "__main__":
    raise SystemExit(main())
