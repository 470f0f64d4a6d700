"""A disk tier over the fake device: engines that "restart" on the same directory."""

from __future__ import annotations

from pathlib import Path

from prefixd.disk.tier import DiskTier
from prefixd.disk.writer import DiskWriter
from prefixd.scheduler.config import SchedulerConfig
from prefixd.scheduler.engine import Engine
from prefixd.disk.index import TierIdentity
from tests.scheduler.engines import ENGINES
from tests.scheduler.fake_device import FakeDevice, make_info


def identity(info, model_hash: str = "m1", mode: str = "invariant") -> TierIdentity:
    return TierIdentity(model_hash=model_hash, dtype="bf16", device_kind="cpu", mode=mode,
                        page_size=info.page_size, kv_bytes_per_page=info.kv_bytes_per_page,
                        lane_state_bytes=info.lane_state_bytes, logits_row_bytes=info.logits_row_bytes,
                        lookahead=info.lookahead, invariant_rows=info.invariant_rows)


def make_tier(directory: Path, info, *, budget: int = 1 << 30, writer: DiskWriter | None = None,
              **ident_kw) -> DiskTier:
    return DiskTier(directory, identity(info, **ident_kw), budget_bytes=budget, writer=writer)


def disk_engine(directory: Path, *, num_lanes: int = 1, grid: int = 4, cache: bool = True,
                disk_budget: int = 1 << 30, writer: DiskWriter | None = None, ident_kw: dict | None = None,
                **info_kw) -> tuple[Engine, FakeDevice, DiskTier]:
    """An engine over a fresh FakeDevice with a disk tier in `directory` (a fresh process's view)."""
    device = FakeDevice(make_info(**info_kw))
    tier = make_tier(directory, device.info, budget=disk_budget, writer=writer, **(ident_kw or {}))
    cfg = SchedulerConfig(num_lanes=num_lanes, grid=grid, round_row_budget=16, cache=cache)
    engine = Engine(device, cfg, disk=tier)
    ENGINES.append(engine)
    return engine, device, tier
