"""Taking connections in: failed accepts, the connection cap, and memory handed back.

The accept loop must outlive every error accept(2) can return. Descriptor exhaustion
(EMFILE, ENFILE) and memory pressure (ENOBUFS, ENOMEM) pass when clients leave, so the
loop logs them (rate-limited: one line per `_LOG_EVERY_S`, with a count of the others),
pauses briefly and tries again.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import time

import anyio
import anyio.abc

from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.framing import encode_frame

_LOG_EVERY_S = 10.0
_REFUSE_SEND_S = 1.0  # a refused client gets this long to take its one error frame
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class AcceptErrors:
    """Rate-limited logging of failed accepts; `recovered` logs once accepting works again."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.num_failed = 0  # since the last successful accept
        self._num_unlogged = 0
        self._logged_s = -float("inf")

    def record(self, error: BaseException) -> None:
        self.num_failed += 1
        now = time.monotonic()
        if now - self._logged_s < _LOG_EVERY_S:
            self._num_unlogged += 1
            return
        resources = getattr(error, "errno", None) in _RESOURCE_ERRNOS
        why = "out of descriptors or memory" if resources else "unexpected error"
        more = f" ({self._num_unlogged} more since the last report)" if self._num_unlogged else ""
        self.log.error("accept failed, %s: %s; retrying%s", why, error, more)
        self._logged_s, self._num_unlogged = now, 0

    def recovered(self) -> None:
        if self.num_failed:
            self.log.warning("accepting again after %d failed accepts", self.num_failed)
            self.num_failed, self._num_unlogged, self._logged_s = 0, 0, -float("inf")


async def refuse_connection(stream: anyio.abc.SocketStream, max_connections: int) -> None:
    """Tell a client over the connection cap why, then close its connection."""
    error = ProtocolError(ErrorCode.TOO_MANY_CONNECTIONS,
                          f"the daemon already serves {max_connections} connections; try again later")
    with anyio.move_on_after(_REFUSE_SEND_S):
        try:
            await stream.send(encode_frame(error.to_wire()))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the client left first: nothing to tell it
    await stream.aclose()


_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only


def return_freed_memory() -> None:
    """Hand freed heap back to the system: glibc keeps large freed buffers (a closed
    connection's frame buffer) in the process otherwise. A no-op without glibc."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
