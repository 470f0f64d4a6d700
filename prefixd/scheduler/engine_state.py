"""Read-only views of an `Engine`: the status the daemon reports and the integrity check
tests and idle rounds run."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping

from prefixd.scheduler.lanes import check_page_refs
from prefixd.scheduler.streams import Stream

if TYPE_CHECKING:
    from prefixd.scheduler.engine import Engine


def engine_status(engine: Engine) -> dict:
    """Lanes (busy/resident/free), waiting count, pages free/used, store stats."""
    lanes = []
    for lane in engine.lanes:
        state = "busy" if lane.busy else "resident" if lane.resident else "free"
        entry: dict = {"lane": lane.index, "state": state, "rows": lane.num_rows, "pages": len(lane.pages)}
        if lane.stream is not None:
            entry["stream_id"] = lane.stream.stream_id
        lanes.append(entry)
    out = {
        "lanes": lanes,
        "lanes_busy": sum(1 for lane in engine.lanes if lane.busy),
        "lanes_resident": sum(1 for lane in engine.lanes if lane.resident),
        "waiting": len(engine.admitter.waiting),
        "pages_free": engine.allocator.num_free,
        "pages_used": engine.allocator.num_used,
        "page_size": engine.info.page_size,
        "max_context": engine.max_context,
        "draft": {"mode": engine.config.draft, "max": engine.config.draft_max,
                  "drafted_tokens": engine.verifies.drafted,
                  "accepted_tokens": engine.verifies.accepted},
    }
    out["cache_reports"] = list(engine.reports)  # oldest first
    if engine.store is not None:
        out["store"] = dataclasses.asdict(engine.store.stats())
    if engine.disk is not None:
        engine.disk.poll()
        out["disk"] = dataclasses.asdict(engine.disk.stats())
    return out


def check_engine(engine: Engine, streams: Mapping[int, Stream]) -> None:
    """Raise RuntimeError if lanes, `streams` (every open one), the store and page refcounts disagree."""
    for lane in engine.lanes:
        stream = lane.stream
        if stream is not None and (stream.lane != lane.index or streams.get(stream.stream_id) is not stream):
            raise RuntimeError(f"lane {lane.index} and its stream disagree")
    running = sum(1 for lane in engine.lanes if lane.busy)
    waiting = engine.admitter.waiting
    if running + len(waiting) != len(streams):
        raise RuntimeError(f"{len(streams)} streams, {running} running, {len(waiting)} waiting")
    store_pages = 0
    if engine.store is not None:
        engine.store.check_integrity()
        store_pages = engine.store.stats().pages
    waiting_pages = [p for s in waiting if s.hit is not None for p in s.hit.pages]
    if engine.disk is not None:
        waiting_pages += engine.disk.held_pages()  # for loads and exports not yet landed
    check_page_refs(engine.allocator, engine.lanes, engine.info.page_size, waiting_pages, store_pages)
