"""Frames over a Unix stream socket, with memfd payloads riding as SCM_RIGHTS.

One task receives, any number of tasks send (sends are serialized). A send blocks while
the socket's kernel buffer is full, so a peer that never reads costs the sender at most
one frame in flight; with `send_timeout_s` such a send fails with TimeoutError instead of
waiting forever. A send that fails or is cancelled part-way leaves the stream broken:
later sends raise anyio.BrokenResourceError and the owner should close it.

Receiving is bounded three ways (all optional, the daemon sets them): a frame must be
complete within `frame_deadline_s` of its first byte (idle time between frames is free);
the bytes of a frame in progress are reserved from a `BufferBudget` shared by every
connection before more of it is read; and a recvmsg that brings more descriptors than
`max_fds_per_frame` is a framing error.

With `off_loop_bytes`, a read that completes at least that many bytes of frames is decoded
and checked on a worker thread, not on the event loop: a ~220 KB map of 8,000 chat messages
takes ~6 ms of msgpack and tree checks, and every other connection's frames would wait for
it (the daemon sets it; docs/protocol.md).
"""

from __future__ import annotations

import array
import math
import os
import socket
from collections import deque
from typing import Any, Sequence

import anyio
from anyio.abc import SocketAttribute, UNIXSocketStream

from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.framing import Frame, FrameDecoder, Limits, close_fds, encode_frame, too_many_fds
from prefixd.ipc.memfd import extract_payloads, resolve_payloads

RECV_BYTES = 64 << 10
_SCM_MAX_FD = 253  # the most descriptors one sendmsg can carry on Linux
_ANCILLARY_BYTES = socket.CMSG_SPACE(_SCM_MAX_FD * 4)


class BufferBudget:
    """Bytes of incomplete frames that all connections together may hold.

    `take` waits (until a deadline) for others to `give` back; nothing is ever overdrawn.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._freed = anyio.Event()

    def try_take(self, num_bytes: int) -> bool:
        if self.used_bytes + num_bytes > self.max_bytes:
            return False
        self.used_bytes += num_bytes
        return True

    async def take(self, num_bytes: int) -> bool:
        """Reserve `num_bytes`, waiting for room; False at once if it can never fit."""
        while not self.try_take(num_bytes):
            if num_bytes > self.max_bytes:
                return False
            if self._freed.is_set():
                self._freed = anyio.Event()
            await self._freed.wait()
        return True

    def give(self, num_bytes: int) -> None:
        if num_bytes > self.used_bytes:
            raise RuntimeError(f"giving back {num_bytes} bytes, only {self.used_bytes} are taken")
        self.used_bytes -= num_bytes
        self._freed.set()


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
        frame_deadline_s: float | None = None,
        budget: BufferBudget | None = None,
        off_loop_bytes: int | None = None,
    ) -> None:
        self.stream = stream
        self.limits = limits or Limits()
        self.send_timeout_s = send_timeout_s
        self.memfd_payloads = memfd_payloads
        self.frame_deadline_s = frame_deadline_s
        self.budget = budget
        self.off_loop_bytes = off_loop_bytes
        self.reserved_bytes = 0  # taken from `budget` for the frame in progress
        self.peak_buffered_bytes = 0
        self._sock: socket.socket | None = stream.extra(SocketAttribute.raw_socket, None)
        self._frame_started_s = math.inf
        self._decoder = FrameDecoder(self.limits)
        self._frames: deque[Frame] = deque()
        self._send_lock = anyio.Lock()
        self._broken = False
        self._closed = False

    @classmethod
    async def connect(cls, path: str | os.PathLike[str], **kwargs: Any) -> FramedStream:
        """Connect to the Unix socket at `path`; kwargs as for the constructor."""
        return cls(await anyio.connect_unix(path), **kwargs)

    @property
    def buffered_bytes(self) -> int:
        return self._decoder.buffered_bytes

    async def send(self, msg: dict[str, Any]) -> None:
        """Send one map. Raises ProtocolError(frame_too_large) before sending anything when
        it does not fit, TimeoutError after send_timeout_s, anyio.BrokenResourceError when the
        peer is gone or an earlier send broke the stream."""
        await self.send_many((msg,))

    async def send_many(self, msgs: Sequence[dict[str, Any]]) -> None:
        """Send maps in order, those without descriptors together in one write (a burst of
        replies costs one system call, not one each). Raises as `send`; a map that does not
        fit is not sent: the maps before it are, then it raises."""
        pending: list[bytes] = []
        for msg in msgs:
            fds: list[int] = []
            try:
                try:
                    if self.memfd_payloads:
                        msg, fds = extract_payloads(msg, self.limits)
                    data = encode_frame(msg, self.limits)
                except BaseException:
                    await self._write(b"".join(pending))
                    raise
                if not fds:
                    pending.append(data)
                    continue
                await self._write(b"".join(pending))
                pending.clear()
                await self._write(data, fds)
            finally:
                close_fds(fds)  # the peer holds its own references once sent
        await self._write(b"".join(pending))

    async def _write(self, data: bytes, fds: list[int] | None = None) -> None:
        if not data:
            return
        view, partial = memoryview(data), False
        if not fds and not self._broken and not self._send_lock.locked():
            # No send in flight: one send() now, as a read tries recvmsg before it waits. A
            # token frame fits the socket's buffer, so it costs no trip through the event loop.
            sent = self._send_now(view)
            if sent == len(view):
                return
            view, partial = view[sent:], sent > 0
        try:
            async with self._send_lock:
                if self._broken:
                    raise anyio.BrokenResourceError("an earlier send failed part-way")
                try:
                    with anyio.fail_after(self.send_timeout_s):
                        if fds:
                            await self.stream.send_fds(view, fds)
                        else:
                            await self.stream.send(view)
                except BaseException:
                    self._broken = True  # part of the frame may be on the wire
                    raise
        except BaseException:
            if partial:  # the frame's first bytes went out at once
                self._broken = True
            raise

    def _send_now(self, view: memoryview) -> int:
        """Bytes of `view` the socket takes at once (0 where it takes none, or fails: the
        awaited send that follows then raises as anyio does)."""
        if self._sock is None:
            return 0
        try:
            return self._sock.send(view)
        except OSError:
            return 0

    async def receive(self) -> dict[str, Any]:
        """The next map, its memfd fields resolved (int32 as list[int], else bytes). Raises anyio.EndOfStream at a clean end, ProtocolError for bad input:
        `error.fatal` tells whether the connection must be closed."""
        return resolve_payloads(await self.receive_frame(), self.limits)

    async def receive_frame(self) -> Frame:
        """The next frame with its memfd refs unresolved; the caller owns (and closes) its fds.

        Raises as `receive`, and ProtocolError(frame_timeout) or (busy) when a frame in
        progress misses its deadline or finds no room in the shared budget before it."""
        while not self._frames:
            await self._reserve()
            data, fds = await self._receive_chunk()
            had_partial = self._decoder.buffered_bytes > 0
            if self._decodes_off_loop(len(data)):  # the reader awaits it: no one else uses the decoder meanwhile
                frames = await anyio.to_thread.run_sync(self._decoder.feed_fds, data, fds)
            else:
                frames = self._decoder.feed_fds(data, fds)
            self._frames.extend(frames)
            self.peak_buffered_bytes = max(self.peak_buffered_bytes, self._decoder.buffered_bytes)
            if not self._decoder.buffered_bytes:
                self._frame_started_s = math.inf
            elif frames or not had_partial:
                self._frame_started_s = anyio.current_time()
        self._release(self._decoder.frame_bytes_needed)
        return self._frames.popleft()

    def _decodes_off_loop(self, num_bytes: int) -> bool:
        """Whether feeding `num_bytes` more completes at least `off_loop_bytes` of frames: the
        buffered and new bytes reach that much, and the frame in progress ends within them
        (a read that only adds to a big frame's bytes decodes nothing)."""
        if self.off_loop_bytes is None:
            return False
        have = self._decoder.buffered_bytes + num_bytes
        return have >= self.off_loop_bytes and self._decoder.frame_bytes_needed <= have

    def _remaining_s(self) -> float:
        if self.frame_deadline_s is None:
            return math.inf
        return self._frame_started_s + self.frame_deadline_s - anyio.current_time()

    async def _reserve(self) -> None:
        """Hold budget for the whole frame in progress before reading more of it."""
        need = self._decoder.frame_bytes_needed
        if self.budget is None or need <= self.reserved_bytes:
            return
        with anyio.move_on_after(self._remaining_s()):
            if await self.budget.take(need - self.reserved_bytes):
                self.reserved_bytes = need
                return
        raise ProtocolError(
            ErrorCode.BUSY, f"no room to buffer a frame of {need} bytes: the daemon's frame buffers are full"
        )

    def _release(self, keep_bytes: int) -> None:
        if self.budget is not None and self.reserved_bytes > keep_bytes:
            self.budget.give(self.reserved_bytes - keep_bytes)
            self.reserved_bytes = keep_bytes

    async def _receive_chunk(self) -> tuple[bytes, list[int]]:
        remaining = self._remaining_s()
        if remaining == math.inf:  # no frame in progress has a deadline: no cancel scope a read
            return await self._recv()
        with anyio.move_on_after(remaining):
            return await self._recv()
        raise ProtocolError(
            ErrorCode.FRAME_TIMEOUT, f"a frame was not completed within {self.frame_deadline_s:g} s of its first byte"
        )

    async def _recv(self) -> tuple[bytes, list[int]]:
        sock = self._sock if self._sock is not None else self.stream.extra(SocketAttribute.raw_socket)
        try:
            return await _recv_with_fds(sock, self.limits)
        except anyio.EndOfStream:
            if self._decoder.buffered_bytes:
                raise ProtocolError(ErrorCode.BAD_FRAME, "connection closed mid-frame") from None
            raise

    async def aclose(self) -> None:
        """Close the socket and every received descriptor not handed out."""
        if self._closed:
            return
        self._closed = True
        while self._frames:
            close_fds(self._frames.popleft().fds)
        self._decoder.close()
        self._release(0)
        await self.stream.aclose()

    async def __aenter__(self) -> FramedStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def _recv_with_fds(sock: socket.socket, limits: Limits) -> tuple[bytes, list[int]]:
    """One recvmsg with room for every descriptor a sender can attach, so that a frame
    with too many is seen (and all of them closed) rather than silently cut by the kernel."""
    while True:
        try:
            data, ancdata, flags, _ = sock.recvmsg(RECV_BYTES, _ANCILLARY_BYTES)
        except BlockingIOError:
            await anyio.wait_readable(sock)
            continue
        except OSError as exc:
            if sock.fileno() < 0:
                raise anyio.ClosedResourceError from None
            raise anyio.BrokenResourceError from exc
        break
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    received = fds.tolist()
    if flags & socket.MSG_CTRUNC or len(received) > limits.max_fds_per_frame:
        close_fds(received)
        raise too_many_fds(max(len(received), limits.max_fds_per_frame + 1), limits)
    if not data and not received:
        raise anyio.EndOfStream
    return data, received
