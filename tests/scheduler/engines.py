"""Engines over the fake device for the scheduler tests, checked for integrity after each test."""

from __future__ import annotations

from prefixd.scheduler.config import SchedulerConfig
from prefixd.scheduler.engine import Engine
from prefixd.scheduler.streams import DoneEvent, StreamRequest
from tests.scheduler.fake_device import FakeDevice, done_by_stream, make_info, run_until_idle, tokens_by_stream

ENGINES: list[Engine] = []  # every engine a test made; conftest checks them after the test


def make_engine(*, num_lanes: int, grid: int, budget: int, cache: bool, store: bool,
                cache_budget_bytes: int | None = None, observer=None, **info_kw) -> tuple[Engine, FakeDevice]:
    """An engine over a fresh FakeDevice; store=False keeps resident lanes but no prefix store."""
    device = FakeDevice(make_info(**info_kw))
    cfg = SchedulerConfig(num_lanes=num_lanes, grid=grid, round_row_budget=budget, cache=cache,
                          cache_budget_bytes=cache_budget_bytes)
    kw = {} if store else {"store_factory": lambda **_: None}
    engine = Engine(device, cfg, observer=observer, **kw)
    ENGINES.append(engine)
    return engine, device


def req(sid, tokens, max_tokens=3, **kw) -> StreamRequest:
    return StreamRequest(stream_id=sid, tokens=tuple(tokens), max_tokens=max_tokens, **kw)


def turn(engine: Engine, r: StreamRequest) -> tuple[list[int], DoneEvent]:
    """Submit one request and run the engine until idle: its tokens and its done event."""
    engine.submit(r)
    events = run_until_idle(engine)
    return tokens_by_stream(events)[r.stream_id], done_by_stream(events)[r.stream_id]
