"""HTTP exporter for a private registry on `--metrics-addr` (HOST:PORT).

The exporter is reachable by every local user, so it is bounded like the socket front: at
most `MAX_SCRAPE_CONNECTIONS` connections are served at once (one more is closed at once,
without a thread), and a connection that sends or takes nothing for `SCRAPE_TIMEOUT_S` is
closed. Idle TCP clients can therefore never hold more than that many descriptors.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger("prefixd.metrics")

MAX_SCRAPE_CONNECTIONS = 16  # a scraper needs one; a few dashboards and curls fit beside it
SCRAPE_TIMEOUT_S = 10.0  # a scrape of the registry answers in milliseconds
_ACCEPT_BACKOFF_S = 0.1  # pause after a failed accept (EMFILE) before the server loop retries


class MetricsAddrError(ValueError):
    """`--metrics-addr` is not HOST:PORT."""


@dataclass(frozen=True, slots=True)
class MetricsAddr:
    host: str
    port: int


def parse_metrics_addr(text: str) -> MetricsAddr | None:
    """"HOST:PORT" -> MetricsAddr; "" -> None (exporter disabled). "[::1]:9464" for IPv6.

    The host is required: ":PORT" would listen on every interface without anyone asking."""
    if text == "":
        return None
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise MetricsAddrError(f"metrics address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9464")
    host = host.removeprefix("[").removesuffix("]")
    if not host:
        raise MetricsAddrError(
            f"metrics address {text!r} has no host: give 127.0.0.1:{port_text} for this machine only, "
            f"or 0.0.0.0:{port_text} to listen on every interface"
        )
    return MetricsAddr(host, int(port_text))


class _QuietHandler(WSGIRequestHandler):
    """Logs nothing per request; `timeout` applies to every read and write of a connection."""

    timeout = SCRAPE_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        return None


class _BoundedServer(ThreadingWSGIServer):
    """One thread per connection, at most `max_connections` at once."""

    max_connections = MAX_SCRAPE_CONNECTIONS
    request_queue_size = 64  # the listen backlog; refusing is cheap, so take them in

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self.num_active = 0
        self.peak_active = 0  # the most connections served at once
        self.num_refused = 0  # connections closed at once because every slot was taken

    def get_request(self) -> Any:
        try:
            return super().get_request()
        except OSError:  # out of descriptors: the caller drops it; pause instead of spinning
            time.sleep(_ACCEPT_BACKOFF_S)
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            admitted = self.num_active < self.max_connections
            if admitted:
                self.num_active += 1
                self.peak_active = max(self.peak_active, self.num_active)
            else:
                self.num_refused += 1
        if not admitted:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._leave()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._leave()

    def _leave(self) -> None:
        with self._lock:
            self.num_active -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics connection from %s ended with an error", client_address, exc_info=True)


class MetricsExporter:
    """Serves `registry` over HTTP from a daemon thread until `close()`."""

    def __init__(self, registry: CollectorRegistry, addr: MetricsAddr, *,
                 max_connections: int = MAX_SCRAPE_CONNECTIONS, timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        family = socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("MetricsServer", (_BoundedServer,),
                            {"address_family": family, "max_connections": max_connections})
        handler_class = type("MetricsHandler", (_QuietHandler,), {"timeout": timeout_s})
        self._server = make_server(addr.host, addr.port, make_wsgi_app(registry), server_class, handler_class)
        self._thread = threading.Thread(target=self._server.serve_forever, name="prefixd-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound port (differs from the requested one when it was 0)."""
        return int(self._server.server_address[1])

    @property
    def num_refused(self) -> int:
        """Connections closed at once because `max_connections` were being served."""
        return self._server.num_refused

    @property
    def peak_connections(self) -> int:
        """The most connections served at once so far."""
        return self._server.peak_active

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


__all__ = ["MetricsAddr", "MetricsAddrError", "MetricsExporter", "parse_metrics_addr"]
