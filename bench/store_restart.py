"""`bench/store.py --restart`: the disk tier across a restart, on the agent trace.

- restart: a daemon replays the trace up to its last turn, is stopped (SIGTERM, the disk tier
  flushed) and started again on the same --disk-cache; after one short unrelated request (a
  fresh process's first forward pays one-off costs), the last turn is sent to the new daemon
  (served from disk), then again with the cache off (cold). The same turn served from RAM
  comes from a daemon that replayed the whole trace without a restart.
- round time with the tier writing (the whole trace, --disk-cache on) against the tier off
  (--disk-cache ""), from the daemons' round histograms: mean, and the p99's bucket bound.
- disk bytes per cached token (the entry files after the writing run over the distinct prompt
  tokens of the trace) against raw KV bytes per token.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.common import markdown_table
from bench.daemon import DaemonHandle, spawn_daemon
from bench.trace import Trace, lcp

BUCKET = re.compile(r'^prefixd_round_duration_seconds_bucket\{le="([^"]+)"\} (\S+)$')


@dataclass
class Replay:
    ttft_s: list[float]
    cached: list[int]
    cache: list[str]
    messages: list[list[dict[str, str]]]
    prompts: list[tuple[int, ...]]

    def distinct_tokens(self) -> int:
        """Distinct token prefixes over every prompt: the rows a trie of the prompts holds."""
        total = 0
        for i, ids in enumerate(self.prompts):
            total += len(ids) - max((lcp(ids, s) for s in self.prompts[:i]), default=0)
        return total


async def _replay(handle: DaemonHandle, trace: Trace, max_tokens: int, upto: int) -> Replay:
    """Send turns [0, upto) one at a time, each conversation's replies fed back as history."""
    from prefixd.ipc.client import AsyncClient

    history: dict[int, list[dict[str, str]]] = {c: [] for c in range(trace.shape.num_conversations)}
    out = Replay([], [], [], [], [])
    async with await AsyncClient.connect(handle.socket) as client:
        for turn in trace.turns[:upto]:
            messages = [{"role": "system", "content": trace.system}, *history[turn.conversation], turn.message]
            rendered = await client.tokenize(messages=messages)
            result = await client.generate(messages=messages, max_tokens=max_tokens).collect()
            out.prompts.append(tuple(rendered.ids))
            history[turn.conversation] += [turn.message, {"role": "assistant", "content": result.text}]
            out.ttft_s.append(result.usage.ttft_s)
            out.cached.append(result.usage.cached_tokens)
            out.cache.append(result.usage.cache)
            out.messages.append(messages)
    return out


async def _one(handle: DaemonHandle, messages: list[dict[str, str]], max_tokens: int, cache: bool):
    from prefixd.ipc.client import AsyncClient

    async with await AsyncClient.connect(handle.socket) as client:
        return (await client.generate(messages=messages, max_tokens=max_tokens, cache=cache).collect()).usage


def _round_times(url: str) -> tuple[float, float, int]:
    """(mean, p99 bucket bound, count) of the daemon's round histogram."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    buckets = [(float(m.group(1)), float(m.group(2))) for m in map(BUCKET.match, text.splitlines()) if m]
    total = float(re.search(r"^prefixd_round_duration_seconds_sum (\S+)$", text, re.M).group(1))
    count = int(float(re.search(r"^prefixd_round_duration_seconds_count (\S+)$", text, re.M).group(1)))
    p99 = next((le for le, c in buckets if c >= 0.99 * count), float("inf"))
    return (total / count if count else float("nan")), p99, count


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*.pxc"))


def run_restart(args: argparse.Namespace, trace: Trace, common: list[str], kv_bytes_per_token: int) -> str:
    import anyio

    last = len(trace.turns)
    flags = [*common, "--cache-budget", str(args.restart_cache_budget)]
    with tempfile.TemporaryDirectory(prefix="prefixd-bench-disk-") as tmp:
        writing, restart = Path(tmp) / "writing", Path(tmp) / "restart"
        print("restart bench: the whole trace, tier writing", file=sys.stderr)
        with spawn_daemon([*flags, "--disk-cache", str(writing)], model=args.model, metrics=True) as h:
            ram = anyio.run(_replay, h, trace, args.max_tokens, last)
            on_rounds = _round_times(h.metrics_url)
        time.sleep(1)  # the daemon flushed on SIGTERM
        disk_bytes = _dir_bytes(writing)
        print("restart bench: the whole trace, tier off", file=sys.stderr)
        with spawn_daemon([*flags, "--disk-cache", ""], model=args.model, metrics=True) as h:
            anyio.run(_replay, h, trace, args.max_tokens, last)
            off_rounds = _round_times(h.metrics_url)
        print("restart bench: all but the last turn, then a restart", file=sys.stderr)
        with spawn_daemon([*flags, "--disk-cache", str(restart)], model=args.model) as h:
            anyio.run(_replay, h, trace, args.max_tokens, last - 1)
        with spawn_daemon([*flags, "--disk-cache", str(restart)], model=args.model) as h:
            # a fresh process's first forward pays one-off costs (allocator, kernels) that are not
            # the disk tier's: one short unrelated request first, with the cache off
            anyio.run(_one, h, [{"role": "user", "content": "warm up"}], 1, False)
            from_disk = anyio.run(_one, h, ram.messages[-1], args.max_tokens, True)
            cold = anyio.run(_one, h, ram.messages[-1], args.max_tokens, False)
    return _tables(ram, from_disk, cold, on_rounds, off_rounds, disk_bytes, ram.distinct_tokens(), kv_bytes_per_token)


def _tables(ram: Replay, from_disk, cold, on_rounds, off_rounds, disk_bytes: int, distinct_tokens: int,
            kv_bytes_per_token: int) -> str:
    ms = lambda s: f"{1000 * s:.0f} ms"  # noqa: E731
    turn = markdown_table(
        ["last turn of the trace", "prompt tokens", "cached", "served as", "TTFT", "vs RAM", "cold / this"],
        [["from RAM (no restart)", str(from_disk.prompt_tokens), str(ram.cached[-1]), ram.cache[-1],
          ms(ram.ttft_s[-1]), "1.00x", f"{cold.ttft_s / ram.ttft_s[-1]:.2f}x"],
         ["from disk (after a restart)", str(from_disk.prompt_tokens), str(from_disk.cached_tokens), from_disk.cache,
          ms(from_disk.ttft_s), f"{from_disk.ttft_s / ram.ttft_s[-1]:.2f}x", f"{cold.ttft_s / from_disk.ttft_s:.2f}x"],
         ["cold (cache off)", str(cold.prompt_tokens), "0", cold.cache, ms(cold.ttft_s),
          f"{cold.ttft_s / ram.ttft_s[-1]:.2f}x", "1.00x"]])
    rounds = markdown_table(
        ["disk tier", "rounds", "mean round", "p99 round (bucket bound)"],
        [["writing", str(on_rounds[2]), ms(on_rounds[0]), ms(on_rounds[1])],
         ["off", str(off_rounds[2]), ms(off_rounds[0]), ms(off_rounds[1])],
         ["writing / off", "", f"{on_rounds[0] / off_rounds[0]:.3f}x", f"{on_rounds[1] / off_rounds[1]:.3f}x"]])
    per_token = disk_bytes / max(distinct_tokens, 1)
    size = markdown_table(
        ["disk bytes", "distinct prompt tokens", "disk bytes / token", "raw KV bytes / token", "ratio"],
        [[str(disk_bytes), str(distinct_tokens), f"{per_token:.0f}", str(kv_bytes_per_token),
          f"{per_token / kv_bytes_per_token:.2f}x"]])
    return "\n\n".join(["### Disk tier across a restart", turn, rounds, size])


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--restart", action="store_true",
                        help="the disk tier across a restart (bench/store_restart.py) instead of the store runs")
    parser.add_argument("--restart-cache-budget", default=str(6 << 30), help="--cache-budget of the restart runs")


def write(text: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "store_restart.md").write_text(text + "\n")
    print(text)
    os.sync()
