"""Frames over the engine link's socket, with memfd payloads: what both ends share.

`pack` turns a map into bytes and the memfds its large fields moved to; `LinkReader` turns
received bytes and descriptors back into maps (payloads read, descriptors closed).
`BlockingLink` is the engine process's end; the front's end (prefixd.front.engine_link)
reads the same frames from its event loop.
"""

from __future__ import annotations

import array
import os
import select
import socket
from typing import Any

from prefixd.engine.contract import LINK_LIMITS
from prefixd.ipc.framing import FrameDecoder, close_fds, encode_frame
from prefixd.ipc.memfd import extract_payloads, resolve_payloads

_RECV_BYTES = 1 << 20
_FDS_SPACE = socket.CMSG_SPACE(LINK_LIMITS.max_fds_per_frame * array.array("i").itemsize)


class LinkClosed(ConnectionError):
    """The other end of the engine link is gone."""


def pack(msg: dict[str, Any]) -> tuple[bytes, list[int]]:
    """The frame of `msg` and the memfds its large binary fields moved to (the caller
    closes them once sent)."""
    out, fds = extract_payloads(msg, LINK_LIMITS)
    try:
        return encode_frame(out, LINK_LIMITS), fds
    except BaseException:
        close_fds(fds)
        raise


def send_frame(sock: socket.socket, data: bytes, fds: list[int]) -> int:
    """One sendmsg of `data` (the descriptors ride on its first byte); bytes sent."""
    if fds:
        return sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    return sock.send(data)


def receive_some(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One recvmsg: bytes and the descriptors that came with them. b"" at end of stream."""
    data, ancdata, _, _ = sock.recvmsg(_RECV_BYTES, _FDS_SPACE)
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    return data, fds


class LinkReader:
    """Bytes and descriptors in, complete maps out (their memfd fields read)."""

    def __init__(self) -> None:
        self._decoder = FrameDecoder(LINK_LIMITS)

    def feed(self, data: bytes, fds: list[int]) -> list[dict[str, Any]]:
        out = []
        for frame in self._decoder.feed_fds(data, fds):
            if frame.num_refs or frame.fds:
                out.append(resolve_payloads(frame, LINK_LIMITS))  # it closes the frame's descriptors
            else:
                out.append(frame.msg)
        return out

    def close(self) -> None:
        self._decoder.close()


class BlockingLink:
    """The engine process's end: blocking sends, receives with a timeout."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self._reader = LinkReader()
        self._pending: list[dict[str, Any]] = []

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: dict[str, Any], *, inline: bool = False) -> None:
        """Send one map. `inline`: the sender knows every field is small (a round's events), so
        the map is framed as it is, without the walk that looks for fields to move to memfds."""
        data, fds = (encode_frame(msg, LINK_LIMITS), []) if inline else pack(msg)
        try:
            view = memoryview(data)
            sent = send_frame(self.sock, data, fds)
            while sent < len(view):
                sent += self.sock.send(view[sent:])
        except OSError as e:
            raise LinkClosed(f"engine link: {e}") from None
        finally:
            close_fds(fds)

    def receive(self, timeout_s: float | None) -> list[dict[str, Any]] | None:
        """The maps that arrived, waiting up to `timeout_s` (None: until something does; 0:
        only what is there). None when the wait timed out with nothing. Raises LinkClosed."""
        if self._pending:
            out, self._pending = self._pending, []
            return out
        out: list[dict[str, Any]] = []
        wait = timeout_s
        while True:
            ready, _, _ = select.select([self.sock], [], [], wait)
            if not ready:
                return out or (None if timeout_s != 0 else [])
            try:
                data, fds = receive_some(self.sock)
            except OSError as e:
                raise LinkClosed(f"engine link: {e}") from None
            if not data:
                close_fds(fds)
                raise LinkClosed("the front closed the engine link")
            out.extend(self._reader.feed(data, fds))
            if out:
                wait = 0  # take what else is there, without waiting for more

    def close(self) -> None:
        self._reader.close()
        try:
            self.sock.close()
        except OSError:
            pass


def inherit(fd: int) -> socket.socket:
    """The socket a child got as descriptor `fd`."""
    sock = socket.socket(fileno=fd)
    os.set_inheritable(sock.fileno(), False)
    return sock
