"""Issue 8, defect 2 (metrics side) and 9: the exporter bounds its connections and closes
idle ones, so idle TCP clients cannot exhaust the daemon's descriptors; `:PORT` is refused."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from prefixd.metrics.exporter import MetricsAddr, MetricsAddrError, MetricsExporter, parse_metrics_addr
from tests.daemon.harness import open_fds


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(10)  # a liveness bound, not a timing assertion
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_idle_tcp_clients_cannot_hold_more_than_the_bound():
    registry = CollectorRegistry()
    Counter("prefixd_probe", "probe", registry=registry).inc(3)
    exporter = MetricsExporter(registry, MetricsAddr("127.0.0.1", 0), max_connections=4, timeout_s=0.5)
    try:
        before = open_fds()
        idle = [socket.create_connection(("127.0.0.1", exporter.port)) for _ in range(40)]
        assert all(_closed_by_server(s) for s in idle)  # refused at once, or closed when idle too long
        assert exporter.peak_connections == 4
        assert exporter.num_refused >= 1
        for s in idle:
            s.close()
        assert "prefixd_probe_total 3.0" in _scrape(exporter.port)
        deadline = time.monotonic() + 10
        while open_fds() != before and time.monotonic() < deadline:
            time.sleep(0.01)  # the last scrape's server-side socket closes on its thread
        assert open_fds() == before
    finally:
        exporter.close()


@pytest.mark.parametrize("text", [":9464", "[]:9464"])
def test_metrics_addr_without_a_host_is_refused(text):
    with pytest.raises(MetricsAddrError, match="has no host: give 127.0.0.1:9464"):
        parse_metrics_addr(text)


def test_metrics_addr_with_a_host_is_kept():
    assert parse_metrics_addr("0.0.0.0:9464") == MetricsAddr("0.0.0.0", 9464)
    assert parse_metrics_addr("[::1]:0") == MetricsAddr("::1", 0)
