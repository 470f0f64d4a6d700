"""HTTP exporter for a private registry on `--metrics-addr` (HOST:PORT)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server


class MetricsAddrError(ValueError):
    """`--metrics-addr` is not HOST:PORT."""


@dataclass(frozen=True, slots=True)
class MetricsAddr:
    host: str
    port: int


def parse_metrics_addr(text: str) -> MetricsAddr | None:
    """"HOST:PORT" -> MetricsAddr; "" -> None (exporter disabled). "[::1]:9464" for IPv6."""
    if text == "":
        return None
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise MetricsAddrError(f"--metrics-addr {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9464 (\"\" disables)")
    host = host.removeprefix("[").removesuffix("]")
    if not host:  # an empty host would bind every interface, which nobody should get by accident
        raise MetricsAddrError(f"--metrics-addr {text!r}: give a host: 127.0.0.1{text} for this machine only, "
                               f"0.0.0.0{text} for every interface")
    return MetricsAddr(host, int(port_text))


class MetricsExporter:
    """Serves `registry` over HTTP from a daemon thread until `close()`."""

    def __init__(self, registry: CollectorRegistry, addr: MetricsAddr) -> None:
        self._server, self._thread = start_http_server(addr.port, addr.host, registry=registry)

    @property
    def port(self) -> int:
        """The bound port (differs from the requested one when it was 0)."""
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


__all__ = ["MetricsAddr", "MetricsAddrError", "MetricsExporter", "parse_metrics_addr"]
