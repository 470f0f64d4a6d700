"""The scheduler's one frozen config, and the store budget derived from it speed-first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from prefixd.scheduler.device import DeviceInfo
from prefixd.scheduler.records import DraftMode

DRAFT_MODES = frozenset(get_args(DraftMode))


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How the engine schedules lanes and rounds.

    `max_context` None means the device's; a larger value than the device's is clamped.
    `cache_budget_bytes` None means the store may use the whole KV pool.
    `busy_prefill_rows` and `short_prefill_rows` are the round policy's (docs/store.md, *Round policy*).
    The fields a daemon option sets (num_lanes, grid, cache, cache_budget_bytes, draft_max)
    default to the daemon's defaults on the CPU (prefixd/daemon/options.py; a test holds them
    equal); `DaemonConfig.scheduler_config` builds the daemon's.
    """

    num_lanes: int = 8
    grid: int = 256  # prefill chunk length G
    round_row_budget: int = 512  # most rows a round runs (decode, verify and prefill)
    busy_prefill_rows: int = 32  # rows long prefills share in a round that carries short work
    short_prefill_rows: int = 64  # a stream prefilling at most this many rows is a short prefill
    max_context: int | None = None
    cache: bool = True
    cache_budget_bytes: int | None = None
    decode_headroom_rows: int = 16  # decode rows a stream must find room for when admitted
    draft: DraftMode = "off"
    draft_max: int = 7  # most drafted tokens a lane verifies in one round

    def __post_init__(self) -> None:
        if self.num_lanes <= 0:
            raise ValueError(f"num_lanes must be positive, got {self.num_lanes}")
        if self.grid <= 0:
            raise ValueError(f"grid must be positive, got {self.grid}")
        if self.round_row_budget <= 0:
            raise ValueError(f"round_row_budget must be positive, got {self.round_row_budget}")
        if self.busy_prefill_rows <= 0:
            raise ValueError(f"busy_prefill_rows must be positive, got {self.busy_prefill_rows}")
        if self.short_prefill_rows < 0:
            raise ValueError(f"short_prefill_rows must be >= 0, got {self.short_prefill_rows}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {self.max_context}")
        if self.cache_budget_bytes is not None and self.cache_budget_bytes < 0:
            raise ValueError(f"cache_budget_bytes must be >= 0, got {self.cache_budget_bytes}")
        if self.draft not in DRAFT_MODES:
            raise ValueError(f"draft must be one of {sorted(DRAFT_MODES)}, got {self.draft!r}")
        if self.draft_max < 0:
            raise ValueError(f"draft_max must be >= 0, got {self.draft_max}")
        if self.decode_headroom_rows < 0:
            raise ValueError(f"decode_headroom_rows must be >= 0, got {self.decode_headroom_rows}")

    def context_for(self, info: DeviceInfo) -> int:
        """The max context the engine enforces on `info`'s device."""
        if self.max_context is None:
            return info.max_context
        return min(self.max_context, info.max_context)

    def check_device(self, info: DeviceInfo) -> None:
        """Raise ValueError if this config cannot run on `info`'s device."""
        if self.num_lanes > info.num_lanes:
            raise ValueError(f"{self.num_lanes} lanes asked, the device has {info.num_lanes}")
        if self.draft == "mtp" and not info.draft_head:
            raise ValueError("draft mode mtp needs a device that runs a draft head (a model with MTP layers)")


def store_budget_bytes(info: DeviceInfo, config: SchedulerConfig) -> int:
    """Bytes the prefix store may hold, split speed-first.

    Weights, every lane's live state and the prefill workspace (G rows per lane) come off
    `cache_budget_bytes` first; the store gets the rest. Without a budget the store may use
    the whole KV pool (pages are also bounded by the pool itself).
    """
    if config.cache_budget_bytes is None:
        return info.num_pages * info.kv_bytes_per_page
    reserved = (
        info.weights_bytes
        + config.num_lanes * info.lane_state_bytes
        + config.num_lanes * config.grid * info.workspace_bytes_per_row
    )
    return max(0, config.cache_budget_bytes - reserved)
