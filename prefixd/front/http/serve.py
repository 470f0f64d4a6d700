"""uvicorn serving the HTTP front inside the daemon's own event loop.

The daemon owns signals (its handlers only set flags), so uvicorn's signal capture is off
and the daemon stops the front by setting `should_exit`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any, Iterator

import anyio
import uvicorn

from prefixd.front.http.addr import read_token, split_http_addr
from prefixd.front.http.app import HttpFront

log = logging.getLogger("prefixd.http")
SHUTDOWN_S = 5.0  # open HTTP connections get this long to finish once the daemon stops


class _InLoopServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Binds `addr` (port 0 picks one; `port` says which) and serves `front` until stop()."""

    def __init__(self, front: HttpFront, addr: str) -> None:
        self.front = front
        self.host, self.port = split_http_addr(addr)
        self._server: _InLoopServer | None = None

    @classmethod
    def build(cls, services: Any, addr: str, token_file: Any, normalisers: tuple[str, ...],
              kv_events: Any = None) -> HttpServer:
        token = read_token(token_file) if token_file is not None else None
        return cls(HttpFront(services, token=token, normalisers=normalisers, kv_events=kv_events), addr)

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.front.app(), lifespan="off", access_log=False, log_level="warning",
                                timeout_graceful_shutdown=SHUTDOWN_S, server_header=False)
        self._server = _InLoopServer(config)
        task_status.started()
        try:
            await self._server.serve(sockets=[sock])
        finally:
            sock.close()

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
