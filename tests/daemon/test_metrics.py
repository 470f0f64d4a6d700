"""Metrics: exact exported names, observer wiring, and the HTTP exporter."""

from __future__ import annotations

import urllib.request

import pytest

from prefixd.metrics import Metrics, MetricsExporter, MetricsObserver, parse_metrics_addr
from prefixd.metrics.exporter import MetricsAddr, MetricsAddrError
from prometheus_client import generate_latest

NAMES = [
    "prefixd_prefix_cache_queries_tokens_total",
    "prefixd_prefix_cache_hits_tokens_total",
    "prefixd_prefix_cache_lookups_total",
    "prefixd_prefix_cache_evictions_total",
    "prefixd_prefix_cache_bytes",
    "prefixd_prefix_cache_budget_bytes",
    "prefixd_snapshot_copy_bytes_total",
    "prefixd_time_to_first_token_seconds",
    "prefixd_inter_token_latency_seconds",
    "prefixd_lanes_busy",
    "prefixd_requests_waiting",
    "prefixd_requests_total",
    "prefixd_prompt_tokens_total",
    "prefixd_generation_tokens_total",
    "prefixd_round_duration_seconds",
    "prefixd_disk_cache_bytes",
    "prefixd_disk_cache_hits_tokens_total",
    "prefixd_disk_cache_written_bytes_total",
    "prefixd_disk_cache_corrupt_total",
]


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_exported_family_names_are_exactly_the_design_names():
    metrics = Metrics()
    observer = MetricsObserver(metrics)
    observer.on_eviction("lru", 4096)
    text = generate_latest(metrics.registry).decode()
    for name in NAMES:
        assert f"# TYPE {name.removesuffix('_total')}" in text or f"# TYPE {name} " in text, name
        assert f"\n{name}" in text or f"\n{name}_bucket" in text, name


def test_observer_feeds_counters_gauges_and_histograms_with_exact_values():
    metrics = Metrics()
    obs = MetricsObserver(metrics)
    obs.on_lookup("hit", 100, 64)
    obs.on_lookup("miss", 20, 0)
    obs.on_eviction("moved_past", 1000)
    obs.on_snapshot_copy("save", 512)
    obs.on_snapshot_copy("restore", 256)
    obs.on_store(4096, 8192)
    obs.on_round(0.02, 0.019, 9, 3, 2)
    obs.on_first_token(0.5)
    obs.on_token_gap(0.01)
    obs.on_done("stop", 120, 7)
    s = _samples(metrics)
    assert s[("prefixd_prefix_cache_queries_tokens_total", ())] == 120
    assert s[("prefixd_prefix_cache_hits_tokens_total", ())] == 64
    assert s[("prefixd_prefix_cache_lookups_total", (("result", "hit"),))] == 1
    assert s[("prefixd_prefix_cache_lookups_total", (("result", "miss"),))] == 1
    assert s[("prefixd_prefix_cache_lookups_total", (("result", "resident"),))] == 0
    assert s[("prefixd_prefix_cache_evictions_total", (("reason", "moved_past"),))] == 1
    assert s[("prefixd_snapshot_copy_bytes_total", (("direction", "save"),))] == 512
    assert s[("prefixd_snapshot_copy_bytes_total", (("direction", "restore"),))] == 256
    assert s[("prefixd_prefix_cache_bytes", ())] == 4096
    assert s[("prefixd_prefix_cache_budget_bytes", ())] == 8192
    assert s[("prefixd_lanes_busy", ())] == 3
    assert s[("prefixd_requests_waiting", ())] == 2
    assert s[("prefixd_round_duration_seconds_count", ())] == 1
    assert s[("prefixd_round_duration_seconds_sum", ())] == 0.02
    assert s[("prefixd_time_to_first_token_seconds_sum", ())] == 0.5
    assert s[("prefixd_inter_token_latency_seconds_count", ())] == 1
    assert s[("prefixd_requests_total", (("finish_reason", "stop"),))] == 1
    assert s[("prefixd_prompt_tokens_total", ())] == 120
    assert s[("prefixd_generation_tokens_total", ())] == 7


def test_disk_tier_totals_become_counter_increments_and_a_gauge():
    from prefixd.disk.tier import DiskStats

    metrics = Metrics()
    observer = MetricsObserver(metrics)
    observer.on_disk(DiskStats(5000, 10**9, 2, 4000, 1, 0, 30, None))
    observer.on_disk(DiskStats(7000, 10**9, 3, 6500, 1, 0, 45, None))
    samples = _samples(metrics)
    assert samples[("prefixd_disk_cache_bytes", ())] == 7000
    assert samples[("prefixd_disk_cache_written_bytes_total", ())] == 6500
    assert samples[("prefixd_disk_cache_hits_tokens_total", ())] == 45
    assert samples[("prefixd_disk_cache_corrupt_total", ())] == 1


def test_two_metrics_objects_do_not_share_a_registry():
    a, b = Metrics(), Metrics()
    MetricsObserver(a).on_done("length", 1, 1)
    assert _samples(b)[("prefixd_requests_total", (("finish_reason", "length"),))] == 0


def test_parse_metrics_addr():
    assert parse_metrics_addr("") is None
    assert parse_metrics_addr("127.0.0.1:9464") == MetricsAddr("127.0.0.1", 9464)
    assert parse_metrics_addr("[::1]:80") == MetricsAddr("::1", 80)
    for bad in ("9464", "host:", "host:port", "h:70000"):
        with pytest.raises(MetricsAddrError):
            parse_metrics_addr(bad)


def test_exporter_serves_the_private_registry_over_http():
    metrics = Metrics()
    MetricsObserver(metrics).on_lookup("resident", 10, 10)
    exporter = MetricsExporter(metrics.registry, MetricsAddr("127.0.0.1", 0))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10) as resp:
            body = resp.read().decode()
    finally:
        exporter.close()
    assert 'prefixd_prefix_cache_lookups_total{result="resident"} 1.0' in body
    assert "prefixd_prefix_cache_hits_tokens_total 10.0" in body
