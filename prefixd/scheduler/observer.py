"""What the engine tells the outside world about itself (metrics implement this)."""

from __future__ import annotations

from typing import Protocol

from prefixd.scheduler.records import CacheResult, FinishReason


class EngineObserver(Protocol):
    """Receives engine events; every call must be cheap and must not raise."""

    def on_round(self, duration_s: float, forward_s: float, num_rows: int, lanes_busy: int, waiting: int) -> None: ...
    def on_admit(self, wait_s: float) -> None: ...
    def on_first_token(self, ttft_s: float, cache: CacheResult) -> None: ...
    def on_token_gap(self, itl_s: float) -> None: ...
    def on_done(self, finish_reason: FinishReason, prompt_tokens: int, completion_tokens: int) -> None: ...
    def on_lookup(self, result: CacheResult, query_tokens: int, hit_tokens: int) -> None: ...
    def on_miss(self, reason: str) -> None: ...  # a miss (or cache off) and why (scheduler.diagnosis)
    def on_eviction(self, reason: str, nbytes: int) -> None: ...
    def on_snapshot_copy(self, direction: str, nbytes: int) -> None: ...
    def on_store(self, bytes_held: int, budget_bytes: int) -> None: ...
    def on_draft(self, num_drafted: int, num_accepted: int) -> None: ...


class NullObserver:
    """An observer that ignores everything; subclass it and override what you need."""

    def on_round(self, duration_s: float, forward_s: float, num_rows: int, lanes_busy: int, waiting: int) -> None:
        return None

    def on_admit(self, wait_s: float) -> None:
        return None

    def on_first_token(self, ttft_s: float, cache: CacheResult) -> None:
        return None

    def on_token_gap(self, itl_s: float) -> None:
        return None

    def on_done(self, finish_reason: FinishReason, prompt_tokens: int, completion_tokens: int) -> None:
        return None

    def on_lookup(self, result: CacheResult, query_tokens: int, hit_tokens: int) -> None:
        return None

    def on_miss(self, reason: str) -> None:
        return None

    def on_eviction(self, reason: str, nbytes: int) -> None:
        return None

    def on_snapshot_copy(self, direction: str, nbytes: int) -> None:
        return None

    def on_store(self, bytes_held: int, budget_bytes: int) -> None:
        return None

    def on_draft(self, num_drafted: int, num_accepted: int) -> None:
        return None
