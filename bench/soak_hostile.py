"""Hostile clients for bench/soak.py: each action is one bounded misbehaviour through the
socket (HOSTILE_ACTIONS) or through the HTTP front (HTTP_HOSTILE_ACTIONS, `soak.py --http`).

Every action opens its own connection, does one bad thing, reads what comes back for a
short while, and closes. Error codes (HTTP: statuses) seen are tallied; nothing here asserts.
"""

from __future__ import annotations

import fcntl
import math
import os
import random
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import anyio
import msgpack
import numpy as np

from prefixd.ipc.framing import Dtype, MemfdRef
from prefixd.ipc.transport import FramedStream

READ_S = 2.0  # how long an action reads replies before it leaves
HUGE_MEMFD_BYTES = 64 << 20
TRICKLE_BYTES = 64  # body bytes a slow client sends, one at a time, before it leaves
CHEAP_FLOOD = 600
CHAT_MESSAGES = 8000
HTTP_HUGE_BODY = 9 << 20  # over the HTTP front's 8 MiB body limit
HTTP_DEEP = 100  # JSON nesting, over the front's 64
HTTP_FLOOD = 20  # cheap requests at once


def huge_chat_messages() -> list[dict[str, str]]:
    """CHAT_MESSAGES tiny chat messages: a heavy render (about 250 ms on 2 cores)."""
    return [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(CHAT_MESSAGES)]


@dataclass
class Tally:
    """Hostile requests sent and the error codes (or finish reasons) they got back."""

    sent: int = 0
    codes: Counter = field(default_factory=Counter)
    cpu_s: float = 0.0  # the hostile process's own CPU time (user + system)
    spans: list = field(default_factory=list)  # (action, start, end) in time.monotonic(), for --trace

    def note(self, code: str) -> None:
        self.codes[str(code)] += 1


async def _read_for(framed: FramedStream, tally: Tally, seconds: float = READ_S, stop_after: int = 1) -> int:
    """Receive frames for `seconds` (or until `stop_after` done/error frames); tally errors."""
    ended = 0
    with anyio.move_on_after(seconds):
        while ended < stop_after:
            msg = await framed.receive()
            if msg.get("type") == "error":
                tally.note(msg.get("code"))
                ended += 1
            elif msg.get("type") == "done":
                if msg.get("finish_reason") == "error":
                    tally.note("finish:error")
                ended += 1
            elif msg.get("type") in ("text", "tokens", "ok", "status"):
                ended += 1
    return ended


async def malformed_frames(daemon: Any, tally: Tally) -> None:
    """Garbage bodies, a zero length, a length over the limit, a non-map body."""
    rng = random.Random()
    body = rng.choice([os.urandom(rng.randint(1, 64)), b"", msgpack.packb([1, 2, 3]), b"\xc1"])
    length = rng.choice([len(body), 0, 1 << 30])
    stream = await anyio.connect_unix(daemon.socket)
    async with stream:
        tally.sent += 1
        await stream.send(struct.pack(">I", length) + body)
        with anyio.move_on_after(READ_S):
            try:
                while await stream.receive():
                    pass
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                tally.note("closed")


def _memfd(num_bytes: int) -> int:
    fd = os.memfd_create("soak", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, num_bytes)  # sparse zeros: costs the sender nothing
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
    return fd


async def huge_memfd(daemon: Any, tally: Tally) -> None:
    """Three 64 MiB int32 segments: the prompt and two unknown fields."""
    fds = [_memfd(HUGE_MEMFD_BYTES) for _ in range(3)]
    try:
        msg = {"type": "generate", "id": 1, "max_tokens": 1, "cache": False,
               "tokens": MemfdRef(0, HUGE_MEMFD_BYTES, Dtype.INT32).to_ext(),
               "junk_a": MemfdRef(1, HUGE_MEMFD_BYTES, Dtype.INT32).to_ext(),
               "junk_b": MemfdRef(2, HUGE_MEMFD_BYTES, Dtype.INT32).to_ext()}
        body = msgpack.packb(msg, use_bin_type=True)
        stream = await anyio.connect_unix(daemon.socket)
        async with stream:
            tally.sent += 1
            await stream.send_fds(struct.pack(">I", len(body)) + body, fds)
            framed = FramedStream(stream)
            await _read_for(framed, tally)
    finally:
        for fd in fds:
            os.close(fd)


async def trickle(daemon: Any, tally: Tally) -> None:
    """Announce an 8 MiB frame, then send its body a byte at a time, then leave."""
    stream = await anyio.connect_unix(daemon.socket)
    async with stream:
        tally.sent += 1
        await stream.send(struct.pack(">I", 8 << 20))
        for _ in range(TRICKLE_BYTES):
            await stream.send(b"\x00")
            await anyio.sleep(0.05)


async def cheap_flood(daemon: Any, tally: Tally) -> None:
    """600 detokenize frames in one write, then read the replies."""
    frames = b"".join(struct.pack(">I", len(b)) + b for b in (
        msgpack.packb({"type": "detokenize", "id": i, "ids": [65, 66]}) for i in range(CHEAP_FLOOD)))
    stream = await anyio.connect_unix(daemon.socket)
    async with stream:
        tally.sent += CHEAP_FLOOD
        await stream.send(frames)
        await _read_for(FramedStream(stream), tally, seconds=5.0, stop_after=CHEAP_FLOOD)


async def nan_image(daemon: Any, tally: Tally) -> None:
    """A generate whose image rows are NaN."""
    hidden = daemon.hidden or 1
    rows = np.full((2, hidden), np.nan, dtype="<f4").tobytes()
    image = {"at": 1, "tokens": 2, "gh": 1, "gw": 2, "hash": os.urandom(8), "rows": rows}
    async with await FramedStream.connect(daemon.socket) as framed:
        tally.sent += 1
        await framed.send({"type": "generate", "id": 1, "tokens": [17] * 8, "images": [image],
                           "max_tokens": 4, "cache": False})
        await _read_for(framed, tally)


SAMPLING_EDGES = [
    {"temperature": 1e-38}, {"temperature": 1e-300}, {"temperature": 1e308}, {"top_p": 0.0},
    {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e300}, {"top_k": (1 << 31) - 1},
    {"min_p": 1.0}, {"temperature": math.inf}, {"temperature": math.nan},
]


async def sampling_edge(daemon: Any, tally: Tally) -> None:
    """A generate at one sampling edge (some legal, some not)."""
    sampling = {"temperature": 0.7, "seed": 3, **random.choice(SAMPLING_EDGES)}
    async with await FramedStream.connect(daemon.socket) as framed:
        tally.sent += 1
        await framed.send({"type": "generate", "id": 1, "tokens": [20, 21, 22, 23], "max_tokens": 4,
                           "sampling": sampling, "cache": False})
        await _read_for(framed, tally)


async def huge_chat(daemon: Any, tally: Tally) -> None:
    """8,000 tiny chat messages; half the time the client leaves before the render ends."""
    messages = huge_chat_messages()
    async with await FramedStream.connect(daemon.socket) as framed:
        tally.sent += 1
        await framed.send({"type": "tokenize", "id": 1, "messages": messages})
        if random.random() < 0.5:
            return
        await _read_for(framed, tally, seconds=10.0)


async def leave_mid_stream(daemon: Any, tally: Tally) -> None:
    """Start long generates, read one token, leave."""
    async with await FramedStream.connect(daemon.socket) as framed:
        for i in range(3):
            tally.sent += 1
            await framed.send({"type": "generate", "id": i, "tokens": [30 + i] * 16, "max_tokens": 200,
                               "cache": False})
        with anyio.move_on_after(READ_S):
            while (await framed.receive()).get("type") != "token":
                pass


HOSTILE_ACTIONS: list[Callable[[Any, Tally], Awaitable[None]]] = [
    malformed_frames, huge_memfd, trickle, cheap_flood, nan_image, sampling_edge, huge_chat, leave_mid_stream,
]


# -- through the HTTP front -------------------------------------------------------------------


def _chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "default", "messages": messages, **extra}


_HTTP: Any = None  # one client for the hostile process (a new connection a request: no keep-alive)


def _http(daemon: Any) -> Any:
    """The hostile process's HTTP client: made once, as building one (its TLS context) costs
    more CPU than the requests it sends."""
    global _HTTP
    if _HTTP is None:
        import httpx

        _HTTP = httpx.AsyncClient(base_url=daemon.http_url, timeout=READ_S,
                                  limits=httpx.Limits(max_keepalive_connections=0))
    return _HTTP


async def _http_post(daemon: Any, tally: Tally, path: str, content: bytes) -> None:
    import httpx

    tally.sent += 1
    try:
        reply = await _http(daemon).post(path, content=content, headers={"content-type": "application/json"})
        tally.note(f"http {reply.status_code}")
    except httpx.HTTPError as e:
        tally.note(type(e).__name__)


async def _raw_http(daemon: Any, head: str, body: bytes, tally: Tally, *, trickle: bool = False) -> None:
    """A request written by hand on a connection of its own: `head` (the request line and
    headers), then `body` at once or a byte every 50 ms; a reply is read for a short while."""
    host, port = daemon.http_url.removeprefix("http://").rsplit(":", 1)
    stream = await anyio.connect_tcp(host, int(port))
    async with stream:
        tally.sent += 1
        await stream.send(f"{head}host: {host}\r\n\r\n".encode())
        if trickle:
            for byte in body:
                await stream.send(bytes([byte]))
                await anyio.sleep(0.05)
            return
        with anyio.move_on_after(READ_S):
            try:
                await stream.send(body)
                reply = await stream.receive()
                tally.note(f"http {reply.split(b' ', 2)[1].decode()}")
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError, IndexError):
                tally.note("closed")


async def http_bad_json(daemon: Any, tally: Tally) -> None:
    """A body that is not JSON, or JSON nested past the front's depth limit."""
    body = random.choice([b"{not json", b"[" * HTTP_DEEP + b"]" * HTTP_DEEP,
                          b'{"messages": ' + b"[" * HTTP_DEEP + b"]" * HTTP_DEEP + b"}"])
    await _http_post(daemon, tally, "/v1/chat/completions", body)


async def http_huge_body(daemon: Any, tally: Tally) -> None:
    """A body announced at 9 MiB (over the limit), its first 64 KiB sent: costs the caller little."""
    head = f"POST /v1/completions HTTP/1.1\r\ncontent-type: application/json\r\ncontent-length: {HTTP_HUGE_BODY}\r\n"
    await _raw_http(daemon, head, b'{"prompt": "' + b"a" * (64 << 10), tally)


async def http_slow_body(daemon: Any, tally: Tally) -> None:
    """Headers for a 1 MiB body, then the body a byte at a time, then leave."""
    head = f"POST /v1/chat/completions HTTP/1.1\r\ncontent-type: application/json\r\ncontent-length: {1 << 20}\r\n"
    await _raw_http(daemon, head, b" " * TRICKLE_BYTES, tally, trickle=True)


async def http_huge_chat(daemon: Any, tally: Tally) -> None:
    """8,000 tiny chat messages (a heavy render); half the time the caller leaves at once."""
    import httpx

    messages = huge_chat_messages()
    tally.sent += 1
    try:
        if random.random() < 0.5:
            with anyio.move_on_after(0.05):
                await _http(daemon).post("/v1/chat/completions", json=_chat(messages, max_tokens=1))
            return
        reply = await _http(daemon).post("/v1/chat/completions", json=_chat(messages, max_tokens=1), timeout=10.0)
        tally.note(f"http {reply.status_code}")
    except httpx.HTTPError as e:
        tally.note(type(e).__name__)


async def http_leave_mid_stream(daemon: Any, tally: Tally) -> None:
    """A streamed chat of 200 tokens: read the first event, leave. (One prompt: the socket's
    version asks for no caching, which HTTP cannot, so the store does not fill with these.)"""
    import httpx

    body = _chat([{"role": "user", "content": "count to a thousand"}], max_tokens=200, stream=True)
    tally.sent += 1
    try:
        async with _http(daemon).stream("POST", "/v1/chat/completions", json=body) as reply:
            async for _ in reply.aiter_lines():
                break
    except httpx.HTTPError as e:
        tally.note(type(e).__name__)


async def http_flood(daemon: Any, tally: Tally) -> None:
    """Twenty cheap completions at once, with sampling at its edges (some legal, some not)."""
    import httpx

    edges = [{"temperature": 1e308}, {"top_p": 0.0}, {"temperature": -1}, {"top_k": -5}, {"max_tokens": 0}, {}]

    async def one(i: int) -> None:
        tally.sent += 1
        try:
            reply = await _http(daemon).post("/v1/completions", timeout=10.0, json={
                "model": "default", "prompt": f"x{i}", "max_tokens": 1, **random.choice(edges)})
            tally.note(f"http {reply.status_code}")
        except httpx.HTTPError as e:
            tally.note(type(e).__name__)

    async with anyio.create_task_group() as tg:
        for i in range(HTTP_FLOOD):
            tg.start_soon(one, i)


HTTP_HOSTILE_ACTIONS: list[Callable[[Any, Tally], Awaitable[None]]] = [
    http_bad_json, http_huge_body, http_slow_body, http_huge_chat, http_leave_mid_stream, http_flood,
]
