"""Daemon benchmark: what the socket and the engine thread add on top of the model.

    python bench/daemon.py            # the full table (minutes; run it on an idle machine)
    python bench/daemon.py --quick    # a smoke run with small sizes
    python bench/daemon.py --overlap  # overlap on against off, on agent turns (two daemons, alternately)
    python bench/daemon.py --device cuda --model DIR   # the same on a GPU (bench/device_check.sh)

Spawns `prefixd serve` with 8 lanes and measures, through its socket:
- the round trip of `status` (median over N calls on one connection);
- per-token streaming overhead: the gap between token events seen by the client minus the
  engine's own gap between those tokens (the daemon's inter-token-latency histogram);
- aggregate decode tok/s with 8 clients on 8 connections, beside the runner's own 8-lane
  figure at the same context measured in this process, the two alternated in pairs taken back
  to back (on a shared machine a ratio of figures taken minutes apart measures the load);
and, in this process (the daemon does not report forward time), the share of each 8-lane
decode round that the engine spends outside the model forward.

With --overlap it measures instead two daemons that differ only in `--overlap on|off`, taken in
turns (the idle one spins nothing): the wall time of agent turns, clients sending each next
turn (prompt + reply + new text) as soon as the last one ends, so that requests keep arriving
while other lanes decode and are seated beside the round in flight.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import fmt_ratio, markdown_table, median, print_machine  # noqa: E402


@dataclass(frozen=True)
class DaemonHandle:
    socket: str
    metrics_url: str | None
    log: Path


@contextmanager
def spawn_daemon(flags: Sequence[str], *, model: str = "default", metrics: bool = False,
                 ready_timeout_s: float = 600.0) -> Iterator[DaemonHandle]:
    """Run `prefixd serve` with `flags` until the block ends (SIGTERM, then wait)."""
    with tempfile.TemporaryDirectory(prefix="prefixd-bench-") as tmp:
        sock, log = os.path.join(tmp, "prefixd.sock"), Path(tmp) / "daemon.log"
        cmd = [sys.executable, "-m", "prefixd.daemon.cli", "serve", "--model", model, "--socket", sock,
               "--metrics-addr", "127.0.0.1:0" if metrics else "", *flags]
        if "--disk-cache" not in flags:  # a fresh disk tier per run: never warm from an earlier one
            cmd += ["--disk-cache", os.path.join(tmp, "disk")]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            text = _wait_ready(proc, log, ready_timeout_s, metrics)
            port = re.search(r"metrics on [^:\s]+:(\d+)", text)
            url = f"http://127.0.0.1:{port.group(1)}/metrics" if port else None
            yield DaemonHandle(sock, url, log)
        finally:
            stop_process(proc)


def stop_process(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM (the daemon's graceful stop), then SIGKILL if it has not exited in `timeout_s`."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_ready(proc: subprocess.Popen, log: Path, timeout_s: float, metrics: bool) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text()
        if "prefixd: listening on" in text and ("metrics on" in text or not metrics):
            return text
        if proc.poll() is not None:
            raise RuntimeError(f"prefixd exited with {proc.returncode} before listening:\n{text[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"prefixd did not listen within {timeout_s:.0f} s")


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples of the daemon's Prometheus exposition, by name."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def histogram_mean(before: dict[str, float], after: dict[str, float], name: str) -> tuple[float, int]:
    """(mean, count) of the observations a histogram received between two scrapes."""
    count = int(after[f"{name}_count"] - before.get(f"{name}_count", 0.0))
    total = after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)
    return (total / count if count else float("nan")), count


@dataclass(frozen=True)
class Sizes:
    status_calls: int
    stream_prompt: int  # prompt tokens of the single streaming generate
    stream_tokens: int  # tokens it generates
    lanes: int
    lane_context: int  # prompt tokens of each of the 8 concurrent generates
    lane_tokens: int  # tokens each generates


FULL = Sizes(status_calls=500, stream_prompt=64, stream_tokens=128, lanes=8, lane_context=512, lane_tokens=64)
QUICK = Sizes(status_calls=50, stream_prompt=32, stream_tokens=16, lanes=8, lane_context=64, lane_tokens=24)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, vocab) for _ in range(n)]


async def socket_measures(handle: DaemonHandle, sizes: Sizes, vocab: int) -> dict[str, float]:
    import anyio

    from prefixd.ipc.client import AsyncClient
    from prefixd.ipc.events import TokenEvent

    out: dict[str, float] = {}
    async with await AsyncClient.connect(handle.socket) as client:
        await client.status()
        times = []
        for _ in range(sizes.status_calls):
            t0 = time.perf_counter()
            await client.status()
            times.append(time.perf_counter() - t0)
        out["status_rtt_s"] = median(times)
        await client.generate(tokens=prompt(8, vocab, 0), max_tokens=2).collect()  # warm-up
        before = scrape(handle.metrics_url) if handle.metrics_url else {}
        arrivals = []
        async for event in client.generate(tokens=prompt(sizes.stream_prompt, vocab, 1), max_tokens=sizes.stream_tokens):
            if isinstance(event, TokenEvent):
                arrivals.extend([time.perf_counter()] * len(event.ids))
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        out["client_gap_s"] = sum(gaps) / len(gaps)
        out["client_gap_median_s"] = median(gaps)
        if handle.metrics_url:
            after = scrape(handle.metrics_url)
            out["engine_gap_s"], _ = histogram_mean(before, after, "prefixd_inter_token_latency_seconds")
            out["engine_round_s"], _ = histogram_mean(before, after, "prefixd_round_duration_seconds")

    return out


async def aggregate_tok_s(handle: DaemonHandle, sizes: Sizes, vocab: int) -> float:
    """Decode tok/s of `sizes.lanes` clients on their own connections, counted while every lane decodes."""
    import anyio

    from prefixd.ipc.client import AsyncClient
    from prefixd.ipc.events import TokenEvent

    arrivals_by_lane: list[list[float]] = [[] for _ in range(sizes.lanes)]

    async def one(lane: int) -> None:
        async with await AsyncClient.connect(handle.socket) as c:
            tokens = prompt(sizes.lane_context, vocab, 100 + lane)
            async for event in c.generate(tokens=tokens, max_tokens=sizes.lane_tokens):
                if isinstance(event, TokenEvent):
                    arrivals_by_lane[lane].extend([time.perf_counter()] * len(event.ids))

    async with anyio.create_task_group() as tg:
        for lane in range(sizes.lanes):
            tg.start_soon(one, lane)
    start = max(a[0] for a in arrivals_by_lane)  # every lane decodes from here ...
    end = min(a[-1] for a in arrivals_by_lane)  # ... to here
    inside = sum(1 for a in arrivals_by_lane for t in a if start < t <= end)
    return inside / (end - start) if end > start else float("nan")


class RuntimeDecode:
    """The runner's own 8-lane decode loop (bench/runtime.py) in this process, timed on demand."""

    def __init__(self, model: str, sizes: Sizes, device: str = "cpu") -> None:
        import torch

        from bench.runtime import RunnerMeasure
        from bench.runtime import Sizes as RuntimeSizes
        from prefixd.gpu.families import resolve_mode
        from prefixd.gpu.loading import load_checkpoint

        device, dtype = torch.device(device), torch.bfloat16
        checkpoint = load_checkpoint(model, device=device, dtype=dtype)
        self.mode = resolve_mode("auto", checkpoint.config.family, device, dtype)  # the daemon's mode
        self.vocab = checkpoint.tokenizer.vocab_size
        self.sizes = sizes
        self.lanes = {lane: prompt(sizes.lane_context, self.vocab, 100 + lane) for lane in range(sizes.lanes)}
        rs = RuntimeSizes(prefill=(16,), decode_context=sizes.lane_context, lanes=sizes.lanes,
                          lane_context=sizes.lane_context, decode_steps=sizes.lane_tokens, repeats=1)
        self.measure = RunnerMeasure(checkpoint, device=device, dtype=dtype, mode=self.mode, sizes=rs, grid=256)
        self.measure.start_decode(self.lanes)
        self.measure.decode(self.lanes, sizes.lane_tokens)  # warm-up

    def tok_s(self) -> float:
        t0 = time.perf_counter()
        self.measure.decode(self.lanes, self.sizes.lane_tokens)
        return self.sizes.lanes * self.sizes.lane_tokens / (time.perf_counter() - t0)


def engine_measures(model: str, sizes: Sizes, vocab: int, mode: str, device: str = "cpu") -> dict[str, float]:
    """The engine's outside-forward share of an all-lanes decode round, in this process."""
    import torch

    from prefixd.gpu.loading import load_checkpoint
    from prefixd.gpu.runner import ModelRunner
    from prefixd.scheduler.config import SchedulerConfig
    from prefixd.scheduler.engine import Engine
    from prefixd.scheduler.observer import NullObserver
    from prefixd.scheduler.streams import StreamRequest

    device, dtype = torch.device(device), torch.bfloat16
    lanes = {lane: prompt(sizes.lane_context, vocab, 100 + lane) for lane in range(sizes.lanes)}
    out: dict[str, float] = {}

    class Rounds(NullObserver):
        def __init__(self) -> None:
            self.rows: list[tuple[float, float, int, int]] = []

        def on_round(self, duration_s: float, forward_s: float, num_rows: int, lanes_busy: int, waiting: int) -> None:
            self.rows.append((duration_s, forward_s, num_rows, lanes_busy))

    pages = sizes.lanes * (-(-(sizes.lane_context + sizes.lane_tokens + 32) // 16))
    checkpoint = load_checkpoint(model, device=device, dtype=dtype)
    runner = ModelRunner(checkpoint, device=device, dtype=dtype, num_lanes=sizes.lanes, num_pages=pages, mode=mode)
    observer = Rounds()
    engine = Engine(runner, SchedulerConfig(num_lanes=sizes.lanes, cache=False), observer=observer)
    for lane, tokens in lanes.items():
        engine.submit(StreamRequest(stream_id=lane, tokens=tuple(tokens), max_tokens=sizes.lane_tokens))
    while not engine.idle:
        engine.step()
    decode = [(d, f) for d, f, rows, busy in observer.rows if busy == sizes.lanes and rows == sizes.lanes]
    out["engine_rounds"] = len(decode)
    out["engine_round_s"] = median(d for d, _ in decode)
    out["outside_share"] = 1.0 - sum(f for _, f in decode) / sum(d for d, _ in decode)
    return out


async def agent_turns_s(handle: DaemonHandle, sizes: Sizes, vocab: int, seed: int, turns: int = 3) -> float:
    """Wall time of `sizes.lanes` clients each running `turns` turns back to back."""
    import anyio

    from prefixd.ipc.client import AsyncClient

    async def one(lane: int) -> None:
        tokens = prompt(sizes.lane_context, vocab, seed * 100 + lane)
        async with await AsyncClient.connect(handle.socket) as c:
            for turn in range(turns):
                result = await c.generate(tokens=tokens, max_tokens=sizes.lane_tokens // 2).collect()
                tokens = tokens + list(result.ids) + prompt(32, vocab, seed * 1000 + lane * 10 + turn)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for lane in range(sizes.lanes):
            tg.start_soon(one, lane)
    return time.perf_counter() - t0


def compare_overlap(args: argparse.Namespace, sizes: Sizes) -> int:
    """Agent turns on a daemon with --overlap on against one with it off, in alternate pairs."""
    import anyio

    from prefixd.ipc.client import AsyncClient

    async def vocab_of(handle: DaemonHandle) -> int:
        async with await AsyncClient.connect(handle.socket) as client:
            return int((await client.status())["model"]["vocab_size"])

    flags = ["--lanes", str(sizes.lanes), "--max-context", "4096", "--device", args.device]
    rows = []
    with spawn_daemon([*flags, "--overlap", "off"], model=args.model) as off, \
            spawn_daemon([*flags, "--overlap", "on"], model=args.model) as on:
        vocab = anyio.run(vocab_of, off)
        anyio.run(agent_turns_s, off, QUICK, vocab, 0)  # warm-up, both
        anyio.run(agent_turns_s, on, QUICK, vocab, 0)
        for i in range(args.pairs):
            pair = {}
            for name, handle in (("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off)):
                pair[name] = anyio.run(agent_turns_s, handle, sizes, vocab, i + 1)
            rows.append((pair["off"], pair["on"], os.getloadavg()[0]))
            print(f"pair {i + 1}: off {pair['off']:.2f} s, on {pair['on']:.2f} s", file=sys.stderr, flush=True)
    print_machine({"model": args.model, "lanes": str(sizes.lanes)})
    table = [[str(i + 1), f"{a:.2f}", f"{b:.2f}", fmt_ratio(a, b), f"{load:.2f}"] for i, (a, b, load) in enumerate(rows)]
    table.append(["median", f"{median(a for a, _, _ in rows):.2f}", f"{median(b for _, b, _ in rows):.2f}",
                  f"{median(a / b for a, b, _ in rows):.2f}x", ""])
    print(markdown_table(["pair", "overlap off (s)", "overlap on (s)", "speed-up (off / on)", "load avg (1 min)"],
                         table))
    print(f"\n- {sizes.lanes} clients, 3 turns each: {sizes.lane_context} prompt tokens, then each turn adds its "
          f"reply ({sizes.lane_tokens // 2} tokens) and 32 new tokens; the two daemons alternate which goes first")
    return 0


def render(sock: dict[str, float], local: dict[str, float], sizes: Sizes) -> str:
    ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731
    per_token = sock["client_gap_s"] - sock.get("engine_gap_s", float("nan"))
    rows = [
        ["status round trip (median)", ms(sock["status_rtt_s"]) + " ms", "", ""],
        ["token gap at the client (mean)", ms(sock["client_gap_s"]) + " ms", "", ""],
        ["token gap in the engine (mean)", ms(sock.get("engine_gap_s", float("nan"))) + " ms", "", ""],
        ["per-token streaming overhead", ms(per_token) + " ms",
         f"{per_token / sock['client_gap_s']:.1%} of a token gap", ""],
        [f"share of a {sizes.lanes}-lane decode round outside the forward (in-process)",
         f"{local['outside_share']:.1%}", f"{int(local['engine_rounds'])} rounds", "< 5%"],
        [f"aggregate decode, {sizes.lanes} clients @ {sizes.lane_context} ctx, socket (median)",
         f"{sock['socket_tok_s']:.1f} tok/s", f"{sock['pair_ratio']:.2f}x of runtime (median of pairs)", ">= 0.90x"],
        [f"runtime {sizes.lanes}-lane decode @ {sizes.lane_context} ctx (in-process, median)",
         f"{sock['runtime_tok_s']:.1f} tok/s", "", ""],
    ]
    return markdown_table(["measure", "value", "ratio", "goal"], rows)


def alternate(handle: DaemonHandle, runtime: RuntimeDecode, sizes: Sizes, pairs: int) -> list[tuple[float, float, float]]:
    """(runtime tok/s, socket tok/s, 1-min load average) per pair, the two measured back to back.

    On a shared machine the load changes from one minute to the next: only measures taken
    side by side are compared.
    """
    import anyio

    rows = []
    for _ in range(pairs):
        local = runtime.tok_s()
        sock = anyio.run(aggregate_tok_s, handle, sizes, runtime.vocab)
        rows.append((local, sock, os.getloadavg()[0]))
        print(f"pair {len(rows)}: runtime {local:.1f} tok/s, socket {sock:.1f} tok/s, load {rows[-1][2]:.2f}",
              file=sys.stderr, flush=True)  # survives a run cut short
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    import anyio

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--pairs", type=int, default=5, help="runtime/socket aggregate pairs, measured alternately")
    parser.add_argument("--overlap", action="store_true", help="agent turns with --overlap on against off")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: the daemon's and the in-process runtime's")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the spawned daemon is stopped too
    sizes = QUICK if args.quick else FULL
    if args.overlap:
        return compare_overlap(args, sizes)
    runtime = RuntimeDecode(args.model, sizes, args.device)
    flags = ["--lanes", str(sizes.lanes), "--max-context", "4096", "--device", args.device]
    with spawn_daemon(flags, model=args.model, metrics=True) as handle:
        sock = anyio.run(socket_measures, handle, sizes, runtime.vocab)
        pairs = alternate(handle, runtime, sizes, args.pairs)
    vocab, mode = runtime.vocab, runtime.mode
    del runtime
    local = engine_measures(args.model, sizes, vocab, mode, args.device)
    sock["runtime_tok_s"] = median(r for r, _, _ in pairs)
    sock["socket_tok_s"] = median(t for _, t, _ in pairs)
    sock["pair_ratio"] = median(t / r for r, t, _ in pairs)
    print_machine({"model": args.model, "lanes": str(sizes.lanes), "mode": mode, "device": args.device})
    print(render(sock, local, sizes))
    print()
    print(markdown_table(["pair", "runtime tok/s", "socket tok/s", "ratio", "load avg (1 min)"],
                         [[str(i + 1), f"{r:.1f}", f"{t:.1f}", fmt_ratio(t, r), f"{load:.2f}"]
                          for i, (r, t, load) in enumerate(pairs)]))
    print(f"\n- status: median of {sizes.status_calls} calls on one connection; token gaps: one generate of "
          f"{sizes.stream_tokens} tokens after {sizes.stream_prompt} prompt tokens, the engine's gaps from the "
          "daemon's prefixd_inter_token_latency_seconds histogram over the same tokens")
    print(f"- aggregate: {sizes.lanes} connections, {sizes.lane_tokens} tokens each, counted while every lane decodes;"
          f" runtime: bench/runtime.py's runner loop, same lanes, context and tokens; {len(pairs)} pairs, each runtime "
          "then socket back to back (the machine is shared: only side-by-side figures are compared)")
    print("- outside-forward share: Engine.step() duration vs RoundResult.forward_s over rounds where every lane "
          "decodes one row, measured in-process (the daemon reports no forward time)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
