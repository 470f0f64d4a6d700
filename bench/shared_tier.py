"""A turn resumed from the shared snapshot tier: its time to first token against a local hit
and a cold prefill, at 1K and 4K tokens of context.

    python bench/shared_tier.py                  # 1K and 4K, 5 repetitions, the default model
    python bench/shared_tier.py --repeats 3      # fewer repetitions (a smoke run)
    python bench/shared_tier.py --contexts 1024,2048,4096 --new-tokens 128

Needs `redis-server` or `valkey-server` on PATH and the redis package. It starts the server
on a Unix socket in a temporary directory and three daemons on the same model, one lane each
(so every turn is seated alone), each on its own socket:

- A: `--disk-cache DIR_A --shared-cache unix://...`: serves a conversation's first turn
  (`context` tokens), which it writes to its disk and sends to the server;
- B: `--disk-cache DIR_B --shared-cache unix://...`, its RAM and disk cold for that
  conversation: serves the next turn (the first turn, then `new-tokens` more) from the
  shared tier (`usage.cache` is `shared`);
- A again, after an unrelated request took its lane (so its lane is not resident): serves
  another next turn of the same length from its RAM store (`hit`), the local hit;
- C: `--disk-cache ""`, no shared tier: serves both next turns with `cache: false`, the
  cold prefills, whose token ids and logits digests the other two must equal bit for bit.

Each repetition uses a conversation of its own (seeded token ids), so no daemon holds one
repetition's rows in the next; the two next turns differ from their first token on, so A's
local turn cannot fetch B's. One warm-up repetition per context is not counted. The time is
the daemon's own `usage.ttft_s` (receipt of the request to its first token), median over the
repetitions (for B, over the turns the shared tier served); the table also says what the cache
gave each turn and whether every output was bit-equal to the cold one. The shared tier runs
with `wait=30` (`--wait`): a 4K-token conversation is some 90 MB of entry files, which a
busy machine may not fetch and check within the daemon's default second (that lookup is then
a miss, and the table shows it). Nothing here asserts a time.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from contextlib import ExitStack, contextmanager  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Iterator  # noqa: E402

from bench.common import ServedDaemon, fmt_ratio, markdown_table, median, print_machine  # noqa: E402
from prefixd.ipc.client import AsyncClient  # noqa: E402

READY_S = 30.0  # bound on waiting for the Redis server to answer
PUBLISH_S = 300.0  # bound on waiting for A's entries to reach the server
FIRST_ID, LAST_ID = 1000, 40000  # token ids drawn for the conversations: ordinary vocabulary


@dataclass
class Samples:
    """One context size's measurements over its repetitions."""

    cold_s: list[float] = field(default_factory=list)
    local_s: list[float] = field(default_factory=list)
    shared_s: list[float] = field(default_factory=list)
    caches: Counter = field(default_factory=Counter)  # (who, usage.cache) seen
    cached_tokens: Counter = field(default_factory=Counter)  # (who, cached_tokens) seen
    equal: bool = True


@contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    """A Redis or Valkey server on a Unix socket in `tmp`, no TCP port; yields its URL."""
    import redis

    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        raise SystemExit("needs valkey-server or redis-server on PATH")
    sock = tmp / "redis.sock"
    proc = subprocess.Popen([binary, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp), "--maxmemory", "8gb",
                             "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(unix_socket_path=str(sock))
    try:
        deadline = time.monotonic() + READY_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{binary} did not start") from None
                time.sleep(0.05)
        yield f"unix://{sock}"
    finally:
        client.close()
        proc.kill()
        proc.wait(30)


def conversation(seed: int, context: int, new_tokens: int) -> tuple[list[int], list[int], list[int]]:
    """A first turn of `context` ids and two next turns, each `new_tokens` more, that differ
    from their first new token on."""
    rng = random.Random(seed)
    first = [rng.randint(FIRST_ID, LAST_ID) for _ in range(context)]
    local = [rng.randint(FIRST_ID, LAST_ID) for _ in range(new_tokens)]
    shared = [rng.randint(FIRST_ID, LAST_ID) for _ in range(new_tokens)]
    if shared[0] == local[0]:
        shared[0] = local[0] + 1
    return first, first + local, first + shared


async def generate(daemon: ServedDaemon, tokens: list[int], max_tokens: int, starts: list[int],
                   **kw: Any) -> Any:
    async with await AsyncClient.connect(daemon.socket) as client:
        return await client.generate(tokens=tokens, max_tokens=max_tokens, logits=True,
                                     chunk_starts=starts, **kw).collect()


async def disk_status(daemon: ServedDaemon) -> dict[str, Any]:
    async with await AsyncClient.connect(daemon.socket) as client:
        return (await client.status())["disk"]


async def wait_published(daemon: ServedDaemon) -> None:
    """Until every entry the daemon's disk holds was written and sent to the server."""
    deadline = time.monotonic() + PUBLISH_S
    while True:
        s = await disk_status(daemon)
        if s["shared_published"] + s["shared_skipped"] >= s["entries"]:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"A's entries did not reach the shared server in {PUBLISH_S:.0f} s: {s}")
        await asyncio.sleep(0.05)


async def repetition(a: ServedDaemon, b: ServedDaemon, c: ServedDaemon, seed: int, context: int,
                     args: argparse.Namespace, out: Samples | None) -> None:
    """One conversation through the three daemons; `out` None: a warm-up, not counted."""
    first, local, shared = conversation(seed, context, args.new_tokens)
    starts = [context]  # the first turn's end is a chunk start of the next turn, as a chat front makes it
    await generate(a, first, args.max_tokens, [])
    await wait_published(a)
    from_shared = await generate(b, shared, args.max_tokens, starts)
    filler = random.Random(-seed).sample(range(FIRST_ID, LAST_ID), 16)
    await generate(a, filler, 1, [], cache=False)  # takes A's one lane: the next turn is a store hit
    from_ram = await generate(a, local, args.max_tokens, starts)
    cold_local = await generate(c, local, args.max_tokens, starts, cache=False)
    cold_shared = await generate(c, shared, args.max_tokens, starts, cache=False)
    if out is None:
        return
    out.cold_s += [cold_local.usage.ttft_s, cold_shared.usage.ttft_s]
    out.local_s.append(from_ram.usage.ttft_s)
    if from_shared.usage.cache == "shared":  # a fetch past `wait` is a miss: counted below, not timed here
        out.shared_s.append(from_shared.usage.ttft_s)
    for who, got in (("A", from_ram), ("B", from_shared)):
        out.caches[(who, got.usage.cache)] += 1
        out.cached_tokens[(who, got.usage.cached_tokens)] += 1
    for who, got, cold in (("local", from_ram, cold_local), ("shared", from_shared, cold_shared)):
        if (got.ids, got.logits_sha256) != (cold.ids, cold.logits_sha256):
            out.equal = False
            print(f"context {context} seed {seed}: the {who} turn differs from its cold run: "
                  f"{got.ids} against {cold.ids}", file=sys.stderr)
    if from_shared.usage.cache != "shared":
        print(f"context {context} seed {seed}: B's turn says {from_shared.usage.cache} "
              f"({from_shared.usage.cached_tokens} cached); B's disk tier: {await disk_status(b)}", file=sys.stderr)


def seen(counts: Counter, who: str) -> str:
    return ", ".join(f"{value} x{n}" for (w, value), n in sorted(counts.items(), key=str) if w == who)


async def run(args: argparse.Namespace, a: ServedDaemon, b: ServedDaemon, c: ServedDaemon) -> list[list[str]]:
    rows = []
    for context in args.contexts:
        samples = Samples()
        await repetition(a, b, c, 1_000_000 + context, context, args, None)
        for i in range(args.repeats):
            await repetition(a, b, c, context * 1000 + i, context, args, samples)
        cold, local = median(samples.cold_s), median(samples.local_s)
        shared = median(samples.shared_s) if samples.shared_s else None
        rows.append([f"{context:,}", f"{cold * 1e3:,.1f}", f"{local * 1e3:,.1f}",
                     "n/a" if shared is None else f"{shared * 1e3:,.1f}",
                     fmt_ratio(shared, local), fmt_ratio(cold, shared), "yes" if samples.equal else "NO",
                     f"local: {seen(samples.caches, 'A')} ({seen(samples.cached_tokens, 'A')} cached); "
                     f"shared: {seen(samples.caches, 'B')} ({seen(samples.cached_tokens, 'B')} cached)"])
        print(f"context {context}: cold {cold * 1e3:.1f} ms, local {local * 1e3:.1f} ms, shared "
              f"{'n/a' if shared is None else f'{shared * 1e3:.1f} ms'}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--contexts", default="1024,4096", help="first-turn lengths in tokens, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens the next turn adds")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens each turn generates")
    ap.add_argument("--repeats", type=int, default=5, help="counted repetitions per context (after one warm-up)")
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--wait", type=float, default=30.0,
                    help="the shared tier's wait= (seconds a lookup may take; the daemon's default is 1)")
    args = ap.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    if max(args.contexts) + args.new_tokens + args.max_tokens > args.max_context:
        ap.error("--max-context is too small for the longest context, its new tokens and its reply")

    common = ["--lanes", "1", "--max-context", str(args.max_context)]
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pxs-")))
        url = stack.enter_context(redis_server(tmp))
        shared_flags = [*common, "--shared-cache", f"{url}?wait={args.wait:g}"]
        a = stack.enter_context(ServedDaemon([*shared_flags, "--disk-cache", str(tmp / "a")], model=args.model))
        b = stack.enter_context(ServedDaemon([*shared_flags, "--disk-cache", str(tmp / "b")], model=args.model))
        c = stack.enter_context(ServedDaemon([*common, "--disk-cache", ""], model=args.model))
        rows = asyncio.run(run(args, a, b, c))

    print_machine({"model": args.model, "repetitions": str(args.repeats), "new tokens": str(args.new_tokens),
                   "generated": str(args.max_tokens)})
    print(markdown_table(
        ["context", "cold ms", "local hit ms", "shared ms", "shared / local", "cold / shared", "bit-equal",
         "cache results"], rows))


if __name__ == "__main__":
    main()
