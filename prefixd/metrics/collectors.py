"""The collectors, named exactly as DESIGN.md lists them (counters, not rates)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Latencies of a local daemon span sub-millisecond decode steps to minute-long prefills.
_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)
_ROUND_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """All prefixd collectors on one private registry.

    Counter names are given without `_total`: prometheus-client appends it on export, so the
    exported names are exactly the DESIGN.md names.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.cache_queries_tokens = Counter(
            "prefixd_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.cache_hits_tokens = Counter(
            "prefixd_prefix_cache_hits_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.cache_lookups = Counter(
            "prefixd_prefix_cache_lookups", "Prefix cache lookups by result.", ["result"], registry=r
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
            "prefixd_time_to_first_token_seconds", "Time from submission to the first token.",
            buckets=_LATENCY_BUCKETS_S, registry=r,
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
        self._prime_labels()

    def _prime_labels(self) -> None:
        # Known label values exist from the start so dashboards see zeros, not gaps.
        for result in ("hit", "miss", "resident"):
            self.cache_lookups.labels(result=result)
        for reason in ("stop", "length", "cancelled", "error"):
            self.requests.labels(finish_reason=reason)
        for direction in ("save", "restore"):
            self.snapshot_copy_bytes.labels(direction=direction)
