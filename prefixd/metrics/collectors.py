"""The collectors, named exactly as DESIGN.md lists them (counters, not rates)."""

from __future__ import annotations

from typing import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector

from prefixd.ipc.events import CACHE_REASONS as MISS_REASONS
from prefixd.scheduler.store.entries import REASONS as EVICTION_REASONS

# Latencies of a local daemon span sub-millisecond decode steps to minute-long prefills.
_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)
# Label values known up front, exported at 0 so dashboards see zeros, not gaps.
CACHE_RESULTS = ("miss", "hit", "shared", "resident", "off")
LOOKUP_RESULTS = ("hit", "shared", "miss", "resident")
FINISH_REASONS = ("stop", "length", "cancelled", "error")
SHARED_STATES = ("up", "busy", "down")  # the shared tier's (disk/shared.py); all 0 while it is off
# the shared tier's running totals (DiskStats.shared_*) and the counters they feed
SHARED_COUNTS = ("hit_tokens", "fetched", "published", "dropped", "errors", "skipped")
_ROUND_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """All prefixd collectors on one private registry.

    Counter names are given without `_total`: prometheus-client appends it on export, so the
    exported names are exactly the DESIGN.md names.
    """

    def __init__(self) -> None:
        prometheus_client.disable_created_metrics()  # _created series double every counter's cost for nothing
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)
        self.cache_queries_tokens = Counter(
            "prefixd_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.cache_hits_tokens = Counter(
            "prefixd_prefix_cache_hits_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.cache_lookups = Counter(
            "prefixd_prefix_cache_lookups", "Prefix cache lookups by result.", ["result"], registry=r
        )
        self.cache_misses = Counter(
            "prefixd_prefix_cache_misses", "Requests the prefix cache gave nothing, by why (cache off included).",
            ["reason"], registry=r,
        )
        self.cache_evictions = Counter(
            "prefixd_prefix_cache_evictions", "Prefix cache evictions by reason.", ["reason"], registry=r
        )
        self.cache_bytes = Gauge("prefixd_prefix_cache_bytes", "Bytes held by the prefix cache.", registry=r)
        self.cache_budget_bytes = Gauge(
            "prefixd_prefix_cache_budget_bytes", "Byte allowance of the prefix cache.", registry=r
        )
        self.snapshot_copy_bytes = Counter(
            "prefixd_snapshot_copy_bytes", "Bytes copied by snapshot save/restore.", ["direction"], registry=r
        )
        self.ttft_s = Histogram(
            "prefixd_time_to_first_token_seconds", "Time from submission to the first token, by cache result.",
            ["cache"], buckets=_LATENCY_BUCKETS_S, registry=r,
        )
        self.itl_s = Histogram(
            "prefixd_inter_token_latency_seconds", "Time between consecutive tokens of a stream.",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )
        self.lanes_busy = Gauge("prefixd_lanes_busy", "Lanes holding an active stream.", registry=r)
        self.requests_waiting = Gauge("prefixd_requests_waiting", "Streams waiting for a lane.", registry=r)
        self.requests = Counter(
            "prefixd_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("prefixd_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(
            "prefixd_generation_tokens", "Tokens generated for finished requests.", registry=r
        )
        self.round_duration_s = Histogram(
            "prefixd_round_duration_seconds", "Wall time of one lane round.",
            buckets=_ROUND_BUCKETS_S, registry=r,
        )
        self.connections = Gauge("prefixd_connections", "Open client connections.", registry=r)
        self.kv_pages = Gauge("prefixd_kv_pages", "KV pool pages by state (free, used).", ["state"], registry=r)
        self.build_info = Info("prefixd_build", "Version, model, dtype, device and numeric mode.", registry=r)
        self.disk_bytes = Gauge("prefixd_disk_cache_bytes", "Bytes of entry files the disk tier holds.", registry=r)
        self.disk_hits_tokens = Counter(
            "prefixd_disk_cache_hits_tokens", "Prompt tokens served from the disk tier.", registry=r
        )
        self.disk_written_bytes = Counter(
            "prefixd_disk_cache_written_bytes", "Bytes of entry files written to disk.", registry=r
        )
        self.disk_corrupt = Counter(
            "prefixd_disk_cache_corrupt",
            "Disk tier files never served (torn, truncated, corrupt or foreign), removed.", registry=r,
        )
        self.shared_state = Gauge(
            "prefixd_shared_cache_state", "1 for the shared tier's state (up, busy, down); all 0 when it is off.",
            ["state"], registry=r,
        )
        self.shared_counts = {
            "hit_tokens": Counter("prefixd_shared_cache_hits_tokens",
                                  "Prompt tokens served from entries fetched from the shared tier.", registry=r),
            "fetched": Counter("prefixd_shared_cache_fetched", "Chains fetched from the shared tier and verified.",
                               registry=r),
            "published": Counter("prefixd_shared_cache_published", "Entry files sent to the shared tier.", registry=r),
            "dropped": Counter("prefixd_shared_cache_dropped",
                               "Shared tier values that failed a check (corrupt, partial, foreign): never served, "
                               "deleted there.", registry=r),
            "errors": Counter("prefixd_shared_cache_errors",
                              "Times the shared tier's server failed or did not answer in time.", registry=r),
            "skipped": Counter("prefixd_shared_cache_skipped",
                               "Entry files not sent: the shared tier down, its queue full, or too big.", registry=r),
        }
        self.draft_tokens = Counter(
            "prefixd_draft_tokens", "Drafted tokens verified, by result.", ["result"], registry=r
        )
        self.draft_rollbacks = Counter(
            "prefixd_draft_rollbacks", "Verifies that rejected a draft and rolled their lane back.", registry=r
        )
        self.engine_restarts = Counter(
            "prefixd_engine_restarts", "Times the engine process died and was started again.", registry=r
        )
        self.engine_up = Gauge("prefixd_engine_up", "1 while the engine process is loaded and serving.", registry=r)
        self._prime_labels()

    def _prime_labels(self) -> None:
        for result in LOOKUP_RESULTS:
            self.cache_lookups.labels(result=result)
        for cache in CACHE_RESULTS:
            self.ttft_s.labels(cache=cache)
        for reason in MISS_REASONS:
            self.cache_misses.labels(reason=reason)
        for reason in EVICTION_REASONS:
            self.cache_evictions.labels(reason=reason)
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)
        for state in SHARED_STATES:
            self.shared_state.labels(state=state)
        for direction in ("save", "restore"):
            self.snapshot_copy_bytes.labels(direction=direction)
        for result in ("accepted", "rejected"):
            self.draft_tokens.labels(result=result)

    def set_build_info(self, *, version: str, model: str, dtype: str, device: str, mode: str) -> None:
        """prefixd_build_info{version, model, dtype, device, mode} 1, once the model is loaded."""
        self.build_info.info({"version": version, "model": model, "dtype": dtype, "device": device, "mode": mode})

    def num_requests(self) -> int:
        """Finished requests of every finish reason."""
        return int(sum(self.registry.get_sample_value("prefixd_requests_total", {"finish_reason": r}) or 0
                       for r in FINISH_REASONS))

    def track(self, num_connections: Callable[[], int], num_pages: Callable[[], tuple[int, int]],
              engine_up: Callable[[], int] = lambda: 1) -> None:
        """Read the connections, KV pages and engine-up gauges from these callables at each scrape.

        `num_pages` returns (free, used) as the engine last reported them; all are plain reads,
        safe from the scrape thread.
        """
        self.connections.set_function(lambda: float(num_connections()))
        self.engine_up.set_function(lambda: float(engine_up()))
        self.kv_pages.labels(state="free").set_function(lambda: float(num_pages()[0]))
        self.kv_pages.labels(state="used").set_function(lambda: float(num_pages()[1]))
