"""Restart: how long a request waits when the engine process is killed just before it.

    python bench/restart.py                # the measurement, 3 kills, ~1 min (run it on an idle machine)
    python bench/restart.py --quick        # a smoke run (1 kill)

Starts `prefixd serve` on the default model with its disk tier in a temp dir, serves a
warm-up turn (the reference output: greedy, logits digests) and waits for the disk tier to
settle. Then --runs times: reads the engine's pid from status["engine"]["pid"], kills it
with SIGKILL, and sends the same request at once (it waits for the restart); measured from
the kill to that request's first token event. A request refused meanwhile (the daemon says
`busy` or the stream ends with an error) is sent again, up to --tries times, and the clock
keeps running.

It prints one table: each run's killed and new pid, the time from the kill to the first
token, the tries it took, the back-off the daemon announced, the cache result of the
request (a hit from the disk tier after a restart), and whether its output (ids and logits
digests) equals the warm-up's; then the medians. The front restarts a second death within
60 s of the last after a back-off (1 s, doubling), shown in its own column; --gap-seconds
spaces the kills. Every wait is bounded by a timeout.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import ServedDaemon, markdown_table, median, print_machine  # noqa: E402
from prefixd.ipc.client import AsyncClient  # noqa: E402
from prefixd.ipc.errors import ClientError  # noqa: E402
from prefixd.ipc.events import TokenEvent  # noqa: E402

PROMPT = "Explain in one sentence why the sky is blue."
MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 180.0  # a restart loads the model again: a liveness bound
SETTLE_TIMEOUT_S = 30.0
NEW_PID_TIMEOUT_S = 180.0


@dataclass
class Run:
    killed_pid: int
    new_pid: int | None
    kill_to_token_s: float | None
    tries: int
    backoff_s: float
    cache: str
    equal: bool
    errors: list[str]


def request() -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "sampling": {"temperature": 0.0, "seed": 3},
            "logits": True, "stop_ids": []}


async def generate(client: AsyncClient) -> tuple[tuple, float | None, str]:
    """(ids and digests, perf_counter of the first token event, the usage's cache result)."""
    first: float | None = None
    ids: list[int] = []
    digests: list[str] = []
    async with client.generate(**request()) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                first = first if first is not None else time.perf_counter()
                ids.extend(event.ids)
                digests.extend(event.logits_sha256 or ())
    done = stream.done
    if done is None or done.finish_reason not in ("length", "stop"):
        raise ClientError("error", f"ended with {done.finish_reason if done else 'nothing'}: {done.note if done else ''}")
    return (tuple(ids), tuple(digests)), first, done.usage.cache


async def settle(client: AsyncClient) -> None:
    """Until no lane is busy, nothing waits and the disk tier's figures stop moving (its
    writes have landed), or the timeout."""
    last: object = None
    with anyio.move_on_after(SETTLE_TIMEOUT_S):
        while True:
            status = await client.status()
            disk = status.get("disk")
            if status["lanes_busy"] == 0 and status["waiting"] == 0 and disk == last:
                break
            last = disk
            await anyio.sleep(0.25)


async def one_kill(socket: str, reference: tuple, tries: int) -> Run:
    async with await AsyncClient.connect(socket) as client:
        await settle(client)
        pid = int((await client.status())["engine"]["pid"])
    os.kill(pid, signal.SIGKILL)
    killed = time.perf_counter()
    errors: list[str] = []
    output, first, cache, attempt = None, None, "n/a", 0
    with anyio.move_on_after(REQUEST_TIMEOUT_S):
        for attempt in range(1, tries + 1):
            try:
                output, first, cache = await generate_on_new_connection(socket)
                break
            except (ClientError, OSError) as e:
                errors.append(getattr(e, "code", type(e).__name__))
                await anyio.sleep(0.05)
    new_pid = await wait_new_pid(socket, pid)
    return Run(pid, new_pid, None if first is None else first - killed, attempt, 0.0, cache,
               output == reference, errors)


async def generate_on_new_connection(socket: str) -> tuple[tuple, float | None, str]:
    """`generate` on a connection of its own; its error raised as itself, not in a group."""
    error: Exception | None = None
    async with await AsyncClient.connect(socket) as client:
        try:
            return await generate(client)
        except ClientError as e:
            error = e
    raise error


async def wait_new_pid(socket: str, old: int) -> int | None:
    with anyio.move_on_after(NEW_PID_TIMEOUT_S):
        async with await AsyncClient.connect(socket) as client:
            while True:
                engine = (await client.status())["engine"]
                if engine["pid"] not in (None, old) and engine["state"] == "ready":
                    return int(engine["pid"])
                await anyio.sleep(0.1)
    return None


def announced_backoffs(log: str) -> list[float]:
    """The back-offs the daemon printed before restarts, in order."""
    return [float(s) for s in re.findall(r"^prefixd: restarting the engine in ([0-9.]+)s", log, re.MULTILINE)]


def report(runs: list[Run], warm_s: float) -> str:
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v * 1e3:.0f}"

    rows = [[i + 1, r.killed_pid, r.new_pid or "n/a", ms(r.kill_to_token_s), r.tries, f"{r.backoff_s:g}", r.cache,
             "yes" if r.equal else "no", ", ".join(r.errors) or "none"] for i, r in enumerate(runs)]
    times = [r.kill_to_token_s for r in runs if r.kill_to_token_s is not None]
    rows.append(["median", "", "", ms(median(times)) if times else "n/a", median(r.tries for r in runs), "", "",
                 f"{sum(r.equal for r in runs)}/{len(runs)} equal", ""])
    table = markdown_table(["run", "killed pid", "new pid", "kill -> first token ms", "tries", "back-off s",
                            "cache", "output equal", "refusals"], rows)
    return f"{table}\n\n- warm-up turn (first request, cold): {warm_s * 1e3:.0f} ms to its first token"


async def warm_up(socket: str) -> tuple[tuple, float]:
    async with await AsyncClient.connect(socket) as client:
        start = time.perf_counter()
        output, first, _ = await generate(client)
        await generate(client)  # the second from the RAM cache: the store holds it now
        await settle(client)
    return output, (first or start) - start


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="engine kills")
    parser.add_argument("--tries", type=int, default=20, help="sends of the request after a kill, at most")
    parser.add_argument("--gap-seconds", type=float, default=0.0,
                        help="wait between runs (>= 60 resets the daemon's back-off)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--daemon-root", default=str(ROOT), help="the source tree the daemon runs from")
    parser.add_argument("--quick", action="store_true", help="a smoke run: one kill")
    parser.add_argument("--verbose", action="store_true", help="the daemon's log on stderr")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs = 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the daemon is stopped too
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="prefixd-restart-") as disk:
        flags = ["--lanes", "8", "--disk-cache", disk]
        with ServedDaemon(flags, model=args.model, root=args.daemon_root) as daemon:
            reference, warm_s = anyio.run(warm_up, daemon.socket)
            for i in range(args.runs):
                if i and args.gap_seconds:
                    time.sleep(args.gap_seconds)
                log_before = len(daemon.log_text())
                runs.append(anyio.run(one_kill, daemon.socket, reference, args.tries))
                runs[-1].backoff_s = sum(announced_backoffs(daemon.log_text()[log_before:]))
                print(f"run {i + 1}: {runs[-1]}", file=sys.stderr, flush=True)
            if args.verbose:
                print(f"daemon log:\n{daemon.log_text()[-6000:]}", file=sys.stderr)
    print_machine({"model": args.model, "runs": str(args.runs), "gap": f"{args.gap_seconds:g} s",
                   "daemon code": args.daemon_root})
    print(report(runs, warm_s))
    print(f"- request: {MAX_TOKENS} greedy tokens of a {len(PROMPT.split())}-word prompt with logits digests, "
          "sent right after SIGKILL to the engine process; output equal: ids and digests equal the warm-up's")
    return 0 if all(r.equal for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
