"""Hostile clients for bench/soak.py: each action is one bounded misbehaviour through the socket.

Every action opens its own connection, does one bad thing, reads what comes back for a
short while, and closes. Error codes seen are tallied; nothing here asserts.
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


@dataclass
class Tally:
    """Hostile requests sent and the error codes (or finish reasons) they got back."""

    sent: int = 0
    codes: Counter = field(default_factory=Counter)
    cpu_s: float = 0.0  # the hostile process's own CPU time (user + system)

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
    messages = [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(CHAT_MESSAGES)]
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
