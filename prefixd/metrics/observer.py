"""`MetricsObserver`: the scheduler's `EngineObserver` callbacks written into `Metrics`.

Called from the engine thread; prometheus-client collectors are thread-safe.
"""

from __future__ import annotations

from typing import Any

from prefixd.metrics.collectors import SHARED_COUNTS, SHARED_STATES, Metrics


class MetricsObserver:
    """Implements `prefixd.scheduler.observer.EngineObserver` (structurally); owns no logic."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._disk_seen = (0, 0, 0)  # hit tokens, written bytes, corrupt files already counted
        self._shared_seen = dict.fromkeys(SHARED_COUNTS, 0)  # the shared tier's totals already counted

    def on_round(self, duration_s: float, forward_s: float, num_rows: int, lanes_busy: int, waiting: int) -> None:
        m = self.metrics
        m.round_duration_s.observe(duration_s)
        m.lanes_busy.set(lanes_busy)
        m.requests_waiting.set(waiting)

    def on_admit(self, wait_s: float) -> None:
        """Queue wait is visible through requests_waiting; nothing else to record."""

    def on_first_token(self, ttft_s: float, cache: str) -> None:
        self.metrics.ttft_s.labels(cache=cache).observe(ttft_s)

    def on_token_gap(self, itl_s: float) -> None:
        self.metrics.itl_s.observe(itl_s)

    def on_done(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        m = self.metrics
        m.requests.labels(finish_reason=finish_reason).inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(completion_tokens)

    def on_lookup(self, result: str, query_tokens: int, hit_tokens: int) -> None:
        m = self.metrics
        m.cache_lookups.labels(result=result).inc()
        m.cache_queries_tokens.inc(query_tokens)
        m.cache_hits_tokens.inc(hit_tokens)

    def on_miss(self, reason: str) -> None:
        self.metrics.cache_misses.labels(reason=reason).inc()

    def on_eviction(self, reason: str, nbytes: int) -> None:
        self.metrics.cache_evictions.labels(reason=reason).inc()

    def on_snapshot_copy(self, direction: str, nbytes: int) -> None:
        self.metrics.snapshot_copy_bytes.labels(direction=direction).inc(nbytes)

    def on_store(self, bytes_held: int, budget_bytes: int) -> None:
        m = self.metrics
        m.cache_bytes.set(bytes_held)
        m.cache_budget_bytes.set(budget_bytes)

    def on_disk(self, stats: Any) -> None:
        """The disk tier's running totals (`prefixd.disk.tier.DiskStats`): counters take the change."""
        m = self.metrics
        m.disk_bytes.set(stats.bytes)
        now = (stats.hit_tokens, stats.written_bytes, stats.corrupt)
        for counter, new, old in zip((m.disk_hits_tokens, m.disk_written_bytes, m.disk_corrupt), now, self._disk_seen):
            if new > old:
                counter.inc(new - old)
        self._disk_seen = now
        self._on_shared(stats)

    def _on_shared(self, stats: Any) -> None:
        """The shared tier's state ("up", "busy: why", "down: why" or None: off) and totals."""
        m = self.metrics
        state = stats.shared.split(":", 1)[0] if stats.shared is not None else None
        for s in SHARED_STATES:
            m.shared_state.labels(state=s).set(1 if s == state else 0)
        for name in SHARED_COUNTS:
            new = getattr(stats, f"shared_{name}")
            if new > self._shared_seen[name]:
                m.shared_counts[name].inc(new - self._shared_seen[name])
            self._shared_seen[name] = new

    def on_draft(self, num_drafted: int, num_accepted: int) -> None:
        m = self.metrics
        m.draft_tokens.labels(result="accepted").inc(num_accepted)
        m.draft_tokens.labels(result="rejected").inc(num_drafted - num_accepted)
        if num_accepted < num_drafted:
            m.draft_rollbacks.inc()
