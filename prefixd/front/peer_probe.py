"""Has a client gone? A cheap, thread-safe check for work that runs off the event loop.

A render in a worker thread holds the connection's reader, so the reader cannot see the
client leave. The worker asks instead: poll(2) on the socket for a hang-up (POLLRDHUP: the
peer shut down its side, even with unread bytes still queued), at most every CHECK_EVERY_S.
"""

from __future__ import annotations

import select
import socket
import time
from typing import Any, Callable

from anyio.abc import SocketAttribute

CHECK_EVERY_S = 0.01  # polls closer together than this answer from the last one
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)


class PeerProbe:
    """Callable: True once the peer of `sock` has hung up (and from then on)."""

    def __init__(self, sock: socket.socket) -> None:
        self._poll = select.poll()
        self._poll.register(sock.fileno(), _GONE)
        self._next_s = 0.0
        self._gone = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if self._gone or now < self._next_s:
            return self._gone
        self._next_s = now + CHECK_EVERY_S
        self._gone = any(events & _GONE for _, events in self._poll.poll(0))
        return self._gone


def peer_probe(framed: Any) -> Callable[[], bool]:
    """A PeerProbe for a FramedStream's socket, or a probe that never fires without one."""
    stream = getattr(framed, "stream", None)
    sock = stream.extra(SocketAttribute.raw_socket, None) if stream is not None else None
    if sock is None:
        return lambda: False
    return PeerProbe(sock)
