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
    "prefixd_prefix_cache_misses_total",
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
    "prefixd_shared_cache_state",
    "prefixd_shared_cache_hits_tokens_total",
    "prefixd_shared_cache_fetched_total",
    "prefixd_shared_cache_published_total",
    "prefixd_shared_cache_dropped_total",
    "prefixd_shared_cache_errors_total",
    "prefixd_shared_cache_skipped_total",
    "prefixd_draft_tokens_total",
    "prefixd_draft_rollbacks_total",
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
    obs.on_first_token(0.5, "hit")
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
    assert s[("prefixd_time_to_first_token_seconds_sum", (("cache", "hit"),))] == 0.5
    assert s[("prefixd_time_to_first_token_seconds_count", (("cache", "miss"),))] == 0
    assert s[("prefixd_inter_token_latency_seconds_count", ())] == 1
    assert s[("prefixd_requests_total", (("finish_reason", "stop"),))] == 1
    assert s[("prefixd_prompt_tokens_total", ())] == 120
    assert s[("prefixd_generation_tokens_total", ())] == 7


def test_label_values_are_exported_at_zero_before_any_event():
    text = generate_latest(Metrics().registry).decode()
    for reason in ("moved_past", "never_hit", "lru", "shared", "replaced", "cleared"):
        assert f'prefixd_prefix_cache_evictions_total{{reason="{reason}"}} 0.0\n' in text, reason
    for cache in ("miss", "hit", "resident", "off"):
        assert f'prefixd_time_to_first_token_seconds_count{{cache="{cache}"}} 0.0\n' in text, cache
    assert "_created" not in text


def test_build_info_process_metrics_and_the_tracked_gauges():
    metrics = Metrics()
    metrics.set_build_info(version="9.9.9", model="m.gguf", dtype="bf16", device="cpu", mode="invariant")
    connections, pages = [3], [(10, 6)]
    metrics.track(lambda: connections[0], lambda: pages[0])
    s = _samples(metrics)
    labels = (("device", "cpu"), ("dtype", "bf16"), ("mode", "invariant"), ("model", "m.gguf"), ("version", "9.9.9"))
    assert s[("prefixd_build_info", labels)] == 1
    assert s[("prefixd_connections", ())] == 3
    assert s[("prefixd_kv_pages", (("state", "free"),))] == 10
    assert s[("prefixd_kv_pages", (("state", "used"),))] == 6
    connections[0], pages[0] = 0, (16, 0)  # read again at each collection
    s = _samples(metrics)
    assert (s[("prefixd_connections", ())], s[("prefixd_kv_pages", (("state", "used"),))]) == (0, 0)
    assert s[("process_open_fds", ())] >= 3 and s[("process_resident_memory_bytes", ())] > 0  # this process's


def test_num_requests_sums_every_finish_reason():
    metrics = Metrics()
    obs = MetricsObserver(metrics)
    for reason in ("stop", "length", "length", "error"):
        obs.on_done(reason, 1, 1)
    assert metrics.num_requests() == 4


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
    # no shared tier: every state 0, every count 0
    assert [samples[("prefixd_shared_cache_state", (("state", s),))] for s in ("up", "busy", "down")] == [0, 0, 0]
    assert samples[("prefixd_shared_cache_hits_tokens_total", ())] == 0


def test_shared_tier_state_is_one_gauge_per_state_and_its_totals_become_counter_increments():
    from prefixd.disk.tier import DiskStats

    metrics = Metrics()
    observer = MetricsObserver(metrics)
    names = ("hits_tokens", "fetched", "published", "dropped", "errors", "skipped")

    def seen(*totals: int, state: str | None) -> tuple[list[float], list[float]]:
        observer.on_disk(DiskStats(0, 10**9, 0, 0, 0, 0, 0, None, state, *totals))
        samples = _samples(metrics)
        return ([samples[("prefixd_shared_cache_state", (("state", s),))] for s in ("up", "busy", "down")],
                [samples[(f"prefixd_shared_cache_{n}_total", ())] for n in names])

    assert seen(0, 0, 0, 0, 0, 0, state="up") == ([1, 0, 0], [0, 0, 0, 0, 0, 0])
    assert seen(70, 1, 4, 0, 0, 0, state="up") == ([1, 0, 0], [70, 1, 4, 0, 0, 0])
    assert seen(70, 1, 4, 0, 1, 0, state="busy: no answer in 1 s") == ([0, 1, 0], [70, 1, 4, 0, 1, 0])
    assert seen(70, 1, 4, 2, 2, 3, state="down: ConnectionError: refused") == ([0, 0, 1], [70, 1, 4, 2, 2, 3])
    # an engine restart starts its totals again: counters never go back, and count on from there
    assert seen(5, 0, 0, 0, 0, 0, state="up") == ([1, 0, 0], [70, 1, 4, 2, 2, 3])
    assert seen(9, 0, 1, 0, 0, 0, state="up") == ([1, 0, 0], [74, 1, 5, 2, 2, 3])
    assert seen(state=None) == ([0, 0, 0], [74, 1, 5, 2, 2, 3])  # the tier off


def test_draft_counters_split_accepted_and_rejected_and_count_rollbacks():
    metrics = Metrics()
    observer = MetricsObserver(metrics)
    observer.on_draft(4, 4)  # all accepted: no rollback
    observer.on_draft(3, 1)
    observer.on_draft(2, 0)
    got = _samples(metrics)
    assert got[("prefixd_draft_tokens_total", (("result", "accepted"),))] == 5
    assert got[("prefixd_draft_tokens_total", (("result", "rejected"),))] == 4
    assert got[("prefixd_draft_rollbacks_total", ())] == 2


def test_two_metrics_objects_do_not_share_a_registry():
    a, b = Metrics(), Metrics()
    MetricsObserver(a).on_done("length", 1, 1)
    assert _samples(b)[("prefixd_requests_total", (("finish_reason", "length"),))] == 0


def test_parse_metrics_addr():
    assert parse_metrics_addr("") is None
    assert parse_metrics_addr("127.0.0.1:9464") == MetricsAddr("127.0.0.1", 9464)
    assert parse_metrics_addr("[::1]:80") == MetricsAddr("::1", 80)
    assert parse_metrics_addr("0.0.0.0:9464") == MetricsAddr("0.0.0.0", 9464)
    for bad in ("9464", "host:", "host:port", "h:70000"):
        with pytest.raises(MetricsAddrError):
            parse_metrics_addr(bad)
    with pytest.raises(MetricsAddrError, match="has no host: give 127.0.0.1:9464 for this machine only, or 0.0.0.0:9464"):
        parse_metrics_addr(":9464")


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


async def test_a_live_daemon_exports_its_connections_pages_and_build():
    import tempfile
    from pathlib import Path

    import anyio

    from prefixd.ipc.client import AsyncClient
    from tests.daemon.harness import running_server, wait_idle

    def scrape(port: int) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            lines = resp.read().decode().splitlines()
        return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines)
                if not name.startswith("#") and name}

    with tempfile.TemporaryDirectory() as tmp:
        async with running_server(Path(tmp)) as server:
            async with await AsyncClient.connect(server.socket_path) as client:
                await client.generate(prompt="abc", max_tokens=4).collect()
                status = await wait_idle(server)
                during = await anyio.to_thread.run_sync(scrape, server.metrics_port)
            while (after := await anyio.to_thread.run_sync(scrape, server.metrics_port))["prefixd_connections"]:
                await anyio.sleep(0.01)  # the server notices the close on its own time
    assert during["prefixd_connections"] == 1 and after["prefixd_connections"] == 0
    assert during['prefixd_kv_pages{state="free"}'] == status["pages_free"]
    assert during['prefixd_kv_pages{state="used"}'] == status["pages_used"]
    assert during['prefixd_build_info{device="cpu",dtype="bf16",mode="invariant",model="letters",version="0.1.0"}'] == 1


def test_misses_are_counted_by_reason_and_every_reason_is_exported_from_zero():
    from prefixd.ipc.events import CACHE_REASONS

    metrics = Metrics()
    obs = MetricsObserver(metrics)
    obs.on_miss("evicted")
    obs.on_miss("evicted")
    obs.on_miss("too_short")
    s = _samples(metrics)
    assert {r: s[("prefixd_prefix_cache_misses_total", (("reason", r),))] for r in CACHE_REASONS} == {
        "cache_off": 0, "namespace_empty": 0, "evicted": 2, "other_schedule": 0, "too_short": 1, "diverged": 0}
