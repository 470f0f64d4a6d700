"""HTTP front benchmark: what the OpenAI-compatible front costs beside the msgpack socket,
and what constrained decoding costs beside unconstrained, on one daemon.

    python bench/http_front.py            # the full table (minutes; run it on an idle machine)
    python bench/http_front.py --quick    # a smoke run with small sizes
    python bench/http_front.py --only c --repeats 3   # one measure, fewer pairs

Spawns `prefixd serve --lanes 8 --http 127.0.0.1:0` on the default model and measures, with
the same chat prompts, seeds and max_tokens through both fronts, taken back to back in pairs:
- (a) aggregate tokens/s of 8 concurrent streams: HTTP server-sent events vs the socket;
- (b) time to first token of a cached turn (turns 2+ of a multi-turn chat) through each front,
  each conversation in its own namespace so both fronts see the same cache state;
- (c) 8-lane decode tokens/s of constrained (a regex grammar, masked at every row) vs
  unconstrained generates through the socket, in the same run.
Goals (issue 12): (a) at most 5% loss, (b) at most 1.1x, (c) at most 10% loss.
Nothing here asserts a time; figures on a busy machine measure the load.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any, Awaitable, Callable  # noqa: E402

from bench.common import markdown_table, median, print_machine  # noqa: E402
from bench.daemon import DaemonHandle, spawn_daemon  # noqa: E402

SAMPLING = {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
TOPICS = ["rivers", "bread", "comets", "violins", "glaciers", "bees", "lighthouses", "chess"]
FOLLOW_UPS = ["Tell me more.", "Why does that matter?", "Give one example.", "Sum it up in a sentence."]
# Letters and spaces only, longer than any reply: every lane decodes until max_tokens.
CONSTRAINT = {"type": "regex", "regex": "[a-z ]{2000}"}


@dataclass(frozen=True)
class Sizes:
    lanes: int
    max_tokens: int  # tokens each concurrent stream generates
    repeats: int  # pairs of back-to-back runs; medians over these
    turns: int  # turns of each TTFT conversation (turn 1 cold, the rest cached)
    turn_tokens: int  # tokens each TTFT turn generates


FULL = Sizes(lanes=8, max_tokens=128, repeats=5, turns=4, turn_tokens=32)
QUICK = Sizes(lanes=8, max_tokens=4, repeats=1, turns=2, turn_tokens=4)


def messages_for(lane: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long, plain description of {TOPICS[lane % len(TOPICS)]}."}]


@dataclass
class Fronts:
    """One daemon's two doors: an HTTP client on its /v1 and the socket path."""

    handle: DaemonHandle
    base_url: str

    async def socket_stream(self, messages: list[dict[str, Any]], *, seed: int, max_tokens: int,
                            namespace: str = "", response_format: dict[str, Any] | None = None,
                            ) -> tuple[float, float, int, str]:
        """(send time, first-token time, completion tokens, text) of one generate on its own connection."""
        from prefixd.ipc.client import AsyncClient
        from prefixd.ipc.events import DoneEvent, TokenEvent

        extra = {"response_format": response_format} if response_format else {}
        first, tokens, text = 0.0, 0, ""
        async with await AsyncClient.connect(self.handle.socket) as client:
            t0 = time.perf_counter()
            async for event in client.generate(messages=messages, max_tokens=max_tokens, namespace=namespace,
                                               sampling={**SAMPLING, "seed": seed}, **extra):
                if isinstance(event, TokenEvent):
                    first = first or time.perf_counter()
                    text += event.text
                elif isinstance(event, DoneEvent):
                    tokens = event.usage.completion_tokens
        return t0, first, tokens, text

    async def http_stream(self, http: Any, messages: list[dict[str, Any]], *, seed: int, max_tokens: int,
                          namespace: str = "") -> tuple[float, float, int, str]:
        """The same through POST /v1/chat/completions with stream=true."""
        body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "seed": seed, "stream": True,
                "stream_options": {"include_usage": True}, **SAMPLING}
        headers = {"X-Prefixd-Namespace": namespace} if namespace else {}
        first, tokens, text = 0.0, 0, ""
        t0 = time.perf_counter()
        async with http.stream("POST", f"{self.base_url}/chat/completions", json=body, headers=headers) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"HTTP stream failed: {chunk['error']}")
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", ()):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        text += piece
        return t0, first, tokens, text


async def concurrent_tok_s(run_one: Callable[[int], Awaitable[tuple[float, float, int, str]]], lanes: int) -> float:
    """Completion tokens of `lanes` concurrent streams over the wall time from the first send to the last done."""
    import anyio

    results: list[tuple[float, float, int, str]] = []

    async def one(lane: int) -> None:
        results.append(await run_one(lane))

    async with anyio.create_task_group() as tg:
        for lane in range(lanes):
            tg.start_soon(one, lane)
    end = time.perf_counter()
    start = min(r[0] for r in results)
    return sum(r[2] for r in results) / (end - start)


async def streaming_overhead(fronts: Fronts, http: Any, sizes: Sizes) -> tuple[list[float], list[float], bool]:
    """(a): socket and HTTP tok/s of 8 concurrent streams, alternated; and whether their texts agreed."""
    sock_rates, http_rates, texts = [], [], {}

    async def via_socket(lane: int) -> tuple[float, float, int, str]:
        out = await fronts.socket_stream(messages_for(lane), seed=1000 + lane, max_tokens=sizes.max_tokens)
        texts[("socket", lane)] = out[3]
        return out

    async def via_http(lane: int) -> tuple[float, float, int, str]:
        out = await fronts.http_stream(http, messages_for(lane), seed=1000 + lane, max_tokens=sizes.max_tokens)
        texts[("http", lane)] = out[3]
        return out

    await concurrent_tok_s(via_socket, sizes.lanes)  # warm-up: every prompt is cached for both fronts alike
    for _ in range(sizes.repeats):
        sock_rates.append(await concurrent_tok_s(via_socket, sizes.lanes))
        http_rates.append(await concurrent_tok_s(via_http, sizes.lanes))
    same = all(texts[("socket", lane)] == texts[("http", lane)] for lane in range(sizes.lanes))
    return sock_rates, http_rates, same


async def cached_turn_ttft(fronts: Fronts, http: Any, sizes: Sizes) -> tuple[list[float], list[float]]:
    """(b): TTFT of turns 2.. of the same conversation through each front, each in a fresh namespace."""
    ttfts: dict[str, list[float]] = {"socket": [], "http": []}

    async def conversation(front: str, namespace: str) -> None:
        messages = messages_for(0)
        for turn in range(sizes.turns):
            if front == "socket":
                t0, first, _, text = await fronts.socket_stream(messages, seed=7 + turn, max_tokens=sizes.turn_tokens,
                                                                namespace=namespace)
            else:
                t0, first, _, text = await fronts.http_stream(http, messages, seed=7 + turn,
                                                              max_tokens=sizes.turn_tokens, namespace=namespace)
            if turn > 0 and first:
                ttfts[front].append(first - t0)
            messages = [*messages, {"role": "assistant", "content": text},
                        {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]

    await conversation("socket", "ttft-warm")
    for rep in range(sizes.repeats):
        await conversation("socket", f"ttft-socket-{rep}")
        await conversation("http", f"ttft-http-{rep}")
    return ttfts["socket"], ttfts["http"]


async def constrained_decode(fronts: Fronts, sizes: Sizes) -> tuple[list[float], list[float]]:
    """(c): 8-lane tok/s unconstrained vs constrained by a regex grammar, alternated, through the socket."""
    free, masked = [], []

    def runner(fmt: dict[str, Any] | None) -> Callable[[int], Awaitable[tuple[float, float, int, str]]]:
        async def run(lane: int) -> tuple[float, float, int, str]:
            return await fronts.socket_stream(messages_for(lane), seed=2000 + lane, max_tokens=sizes.max_tokens,
                                              response_format=fmt)
        return run

    await concurrent_tok_s(runner(CONSTRAINT), sizes.lanes)  # warm-up: the grammar compiled, prompts cached
    for _ in range(sizes.repeats):
        free.append(await concurrent_tok_s(runner(None), sizes.lanes))
        masked.append(await concurrent_tok_s(runner(CONSTRAINT), sizes.lanes))
    return free, masked


async def measure(fronts: Fronts, sizes: Sizes, only: str | None = None) -> list[list[str]]:
    """The table's rows: every measure, or only (a), (b) or (c)."""
    import httpx

    rows = []
    limits = httpx.Limits(max_connections=sizes.lanes * 2)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as http:
        if only in (None, "a"):
            progress("(a) streaming overhead")
            sock_rates, http_rates, same = await streaming_overhead(fronts, http, sizes)
            rows.append([f"(a) {sizes.lanes} streams, tok/s", f"{median(sock_rates):.1f}", f"{median(http_rates):.1f}",
                         f"{median(http_rates) / median(sock_rates):.3f}", ">= 0.95", "same" if same else "DIFFER"])
        if only in (None, "b"):
            progress("(b) cached-turn TTFT")
            sock_ttft, http_ttft = await cached_turn_ttft(fronts, http, sizes)
            rows.append(["(b) cached-turn TTFT, ms", f"{median(sock_ttft) * 1e3:.1f}", f"{median(http_ttft) * 1e3:.1f}",
                         f"{median(http_ttft) / median(sock_ttft):.3f}", "<= 1.10", f"{len(http_ttft)} turns"])
    if only in (None, "c"):
        progress("(c) constrained decoding")
        free, masked = await constrained_decode(fronts, sizes)
        pairs = " ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(free, masked))
        rows.append([f"(c) {sizes.lanes} lanes, tok/s (unconstrained, constrained)", f"{median(free):.1f}",
                     f"{median(masked):.1f}", f"{median(masked) / median(free):.3f}", ">= 0.90", f"socket; {pairs}"])
    return rows


def progress(what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def http_base_url(handle: DaemonHandle, timeout_s: float = 60.0) -> str:
    """The /v1 URL the daemon printed once its HTTP front was bound."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"OpenAI-compatible HTTP on (http://\S+/v1)", handle.log.read_text())
        if found:
            return found.group(1)
        time.sleep(0.1)
    raise RuntimeError(f"the daemon printed no HTTP address within {timeout_s:.0f} s")


def main() -> None:
    import anyio

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--model", default="default")
    parser.add_argument("--only", choices=("a", "b", "c"), help="run one measure")
    parser.add_argument("--repeats", type=int, help="pairs of runs (default: 5, or 1 with --quick)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.repeats is not None:
        sizes = dataclasses.replace(sizes, repeats=args.repeats)
    print_machine({"sizes": str(sizes)})
    flags = ["--lanes", str(sizes.lanes), "--http", "127.0.0.1:0"]
    progress("starting the daemon")
    with spawn_daemon(flags, model=args.model) as handle:
        fronts = Fronts(handle, http_base_url(handle))
        rows = anyio.run(measure, fronts, sizes, args.only)
    print(markdown_table(["measure", "socket / unconstrained", "http / constrained", "ratio", "goal", "note"], rows))


if __name__ == "__main__":
    main()
