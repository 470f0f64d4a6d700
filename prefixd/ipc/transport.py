"""Frames over a Unix stream socket, with memfd payloads riding as SCM_RIGHTS.

One task receives, any number of tasks send (sends are serialized). A send blocks while
the socket's kernel buffer is full, so a peer that never reads costs the sender at most
one frame in flight; with `send_timeout_s` such a send fails with TimeoutError instead of
waiting forever. A send that fails or is cancelled part-way leaves the stream broken:
later sends raise anyio.BrokenResourceError and the owner should close it.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import anyio
from anyio.abc import UNIXSocketStream

from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.framing import Frame, FrameDecoder, Limits, close_fds, encode_frame
from prefixd.ipc.memfd import extract_payloads, resolve_payloads

RECV_BYTES = 64 << 10


class FramedStream:
    """A connection that sends and receives msgpack maps (see framing.py, memfd.py).

    `memfd_payloads=False` keeps every field inline (frames over the limit then fail).
    """

    def __init__(
        self,
        stream: UNIXSocketStream,
        limits: Limits | None = None,
        send_timeout_s: float | None = None,
        memfd_payloads: bool = True,
    ) -> None:
        self.stream = stream
        self.limits = limits or Limits()
        self.send_timeout_s = send_timeout_s
        self.memfd_payloads = memfd_payloads
        self._decoder = FrameDecoder(self.limits)
        self._frames: deque[Frame] = deque()
        self._send_lock = anyio.Lock()
        self._broken = False
        self._closed = False

    @classmethod
    async def connect(cls, path: str | os.PathLike[str], **kwargs: Any) -> FramedStream:
        """Connect to the Unix socket at `path`; kwargs as for the constructor."""
        return cls(await anyio.connect_unix(path), **kwargs)

    async def send(self, msg: dict[str, Any]) -> None:
        """Send one map. Raises ProtocolError(frame_too_large) before sending anything when
        it does not fit, TimeoutError after send_timeout_s, anyio.BrokenResourceError when the
        peer is gone or an earlier send broke the stream."""
        fds: list[int] = []
        try:
            if self.memfd_payloads:
                msg, fds = extract_payloads(msg, self.limits)
            data = encode_frame(msg, self.limits)
            async with self._send_lock:
                if self._broken:
                    raise anyio.BrokenResourceError("an earlier send failed part-way")
                try:
                    with anyio.fail_after(self.send_timeout_s):
                        if fds:
                            await self.stream.send_fds(data, fds)
                        else:
                            await self.stream.send(data)
                except BaseException:
                    self._broken = True  # part of the frame may be on the wire
                    raise
        finally:
            close_fds(fds)  # the peer holds its own references once sent

    async def receive(self) -> dict[str, Any]:
        """The next map, its memfd fields resolved (int32 as list[int], else bytes). Raises anyio.EndOfStream at a clean end, ProtocolError for bad input:
        `error.fatal` tells whether the connection must be closed."""
        while not self._frames:
            try:
                data, fds = await self.stream.receive_fds(RECV_BYTES, self.limits.max_fds_per_frame)
            except anyio.EndOfStream:
                if self._decoder.buffered_bytes:
                    raise ProtocolError(ErrorCode.BAD_FRAME, "connection closed mid-frame") from None
                raise
            self._frames.extend(self._decoder.feed_fds(data, fds))
        return resolve_payloads(self._frames.popleft(), self.limits)

    async def aclose(self) -> None:
        """Close the socket and every received descriptor not handed out."""
        if self._closed:
            return
        self._closed = True
        while self._frames:
            close_fds(self._frames.popleft().fds)
        self._decoder.close()
        await self.stream.aclose()

    async def __aenter__(self) -> FramedStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
