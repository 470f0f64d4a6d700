"""Overlap: `Engine.admit_ahead` seats the next round's streams while a round is in flight.

The driver here runs the device only after `admit_ahead` (the slowest device there is), with
submits and cancels arriving between launch and landing, and checks that nothing seated ahead
touches the round in flight, that every stream still yields its cold tokens, and that nothing
leaks.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixd.scheduler.config import SchedulerConfig
from prefixd.scheduler.engine import Engine, Launched
from prefixd.scheduler.streams import DoneEvent, StreamRequest
from tests.scheduler.disk_rig import disk_engine, make_tier
from tests.scheduler.engines import req, turn
from tests.scheduler.fake_device import FakeDevice, make_info, reference_tokens, run_until_idle, tokens_by_stream
from tests.scheduler.test_engine_random import BASES, cold_tokens


def _lanes_of(plan) -> set[int]:
    return {*(w.lane for w in plan.lanes), *plan.resets, *(r.lane for r in plan.restores),
            *(s.lane for s in plan.samplers), *(s.lane for s in plan.stored), *(c.lane for c in plan.captures)}


def check_in_flight_untouched(engine: Engine, launched: Launched, seated_before: set[int]) -> None:
    """What `admit_ahead` may not do to the round in flight: seat one of its lanes, free or move
    a page its rows write or read, or copy onto such a page."""
    plan = launched.plan
    in_flight = _lanes_of(plan)
    ahead = engine._ahead.build(()) if engine._ahead is not None else None
    if ahead is not None:
        seated = _lanes_of(ahead) - seated_before
        assert not seated & in_flight, f"lanes {seated & in_flight} seated ahead while in flight"
    used = set()
    for w in plan.lanes:
        lane = engine.lanes[w.lane]
        assert lane.busy, f"lane {w.lane} left its stream while its round was in flight"
        assert tuple(lane.pages[:len(w.page_table)]) == w.page_table, f"lane {w.lane}'s pages moved in flight"
        for page in w.page_table:
            assert engine.allocator.refcount(page) > 0, f"page {page} freed while a round in flight uses it"
        used.update(w.page_table)
    if ahead is not None:
        hit = used & {c.dst for c in ahead.page_copies}
        assert not hit, f"pages {hit} of the round in flight are copied onto by a seating made ahead"


def overlapped_round(engine: Engine, device: FakeDevice, during=()) -> list:
    """One round as the daemon overlaps it: launch, then `during` (calls made while the device
    runs), admission ahead, the device's answer, landing."""
    launched = engine.launch()
    for call in during:
        call()
    seated_before = _lanes_of(engine._ahead.build(())) if engine._ahead is not None else set()
    disk_calls = (len(device.exported), len(device.loaded))
    engine.admit_ahead(launched)
    assert (len(device.exported), len(device.loaded)) == disk_calls, "a disk call beside the round in flight"
    check_in_flight_untouched(engine, launched, seated_before)
    result = None if launched.plan.empty else device.run_round(launched.plan)
    events = engine.land(launched, result)
    engine.check_integrity()
    return events


action = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 2), st.integers(1, 20), st.lists(st.integers(0, 99), max_size=6),
              st.integers(1, 6), st.booleans(), st.booleans()),
    st.tuples(st.just("continue"), st.integers(0, 30), st.lists(st.integers(0, 99), min_size=1, max_size=6),
              st.integers(1, 6), st.booleans()),
    st.tuples(st.just("cancel"), st.integers(0, 30), st.booleans()),
    st.tuples(st.just("step"), st.integers(1, 3)),
)


@settings(max_examples=120, deadline=None)
@given(actions=st.lists(action, min_size=4, max_size=30), lanes=st.integers(1, 3),
       num_pages=st.sampled_from([10, 12, 24, 64]), budget=st.sampled_from([None, 10_100, 0]),
       row_budget=st.integers(1, 9), cache=st.sampled_from([True, True, False]), invariant=st.booleans(),
       disk=st.booleans())
def test_overlapped_rounds_yield_cold_tokens_and_leave_the_round_in_flight_alone(
        actions, lanes, num_pages, budget, row_budget, cache, invariant, disk):
    with tempfile.TemporaryDirectory() as directory:
        _overlapped_traffic(actions, lanes, num_pages, budget, row_budget, cache, invariant,
                            Path(directory) if disk else None)


def _overlapped_traffic(actions, lanes, num_pages, budget, row_budget, cache, invariant, disk_dir):
    device = FakeDevice(make_info(num_lanes=3, num_pages=num_pages, invariant_rows=invariant))
    cfg = SchedulerConfig(num_lanes=lanes, grid=4, round_row_budget=row_budget, cache=cache,
                          cache_budget_bytes=budget, decode_headroom_rows=2)
    tier = make_tier(disk_dir, device.info) if disk_dir is not None else None
    engine = Engine(device, cfg, disk=tier)
    requests: dict[int, StreamRequest] = {}
    got: dict[int, list[int]] = {}
    done: dict[int, DoneEvent] = {}
    during: list = []  # calls that arrive while the next round is in flight

    def take(events):
        for ev in events:
            if isinstance(ev, DoneEvent):
                done[ev.stream_id] = ev
            else:
                got.setdefault(ev.stream_id, []).extend(ev.ids)

    def submit(r: StreamRequest, now: bool):
        requests[r.stream_id] = r
        (engine.submit(r) if now else during.append(lambda: engine.submit(r)))

    for act in actions:
        if act[0] == "submit":
            _, base, cut, extra, max_tokens, per_request_cache, now = act
            sid = len(requests) + 1
            submit(StreamRequest(sid, tuple(BASES[base][:cut] + extra), max_tokens, cache=per_request_cache), now)
        elif act[0] == "continue" and requests:
            _, prev, extra, max_tokens, now = act
            before = requests[list(requests)[prev % len(requests)]]
            prompt = list(before.tokens) + cold_tokens(before, invariant) + extra
            if len(prompt) < min(63, num_pages * 4):
                submit(StreamRequest(len(requests) + 1, tuple(prompt), max_tokens), now)
        elif act[0] == "cancel":
            _, target, now = act
            (engine.cancel(target) if now else during.append(lambda t=target: engine.cancel(t)))
        elif act[0] == "step":
            for _ in range(act[1]):
                take(overlapped_round(engine, device, during))
                during = []
    for call in during:
        call()
    for _ in range(2000):
        if engine.idle:
            break
        take(overlapped_round(engine, device))
    assert engine.idle
    if tier is not None:
        tier.close()
    assert set(done) == set(requests)
    for sid, ev in done.items():
        tokens = got.get(sid, [])
        assert tokens == cold_tokens(requests[sid], invariant)[: len(tokens)], f"stream {sid}"
        assert len(tokens) == ev.usage.completion_tokens
        if ev.finish_reason != "cancelled":
            assert ev.finish_reason == "length"


def test_admission_ahead_leaves_a_cancelled_stream_in_flight_on_its_lane():
    """A stream cancelled while its round runs keeps its lane until the round lands: a stream
    arriving meanwhile is seated only after that (one lane)."""
    device = FakeDevice(make_info(num_lanes=1, num_pages=16))
    engine = Engine(device, SchedulerConfig(num_lanes=1, grid=4))
    engine.submit(StreamRequest(1, tuple(range(10, 19)), 50))
    while not any(not w.prefill for plan in device.plans for w in plan.lanes):
        engine.step()  # until stream 1 decodes
    launched = engine.launch()
    engine.cancel(1)
    engine.submit(StreamRequest(2, tuple(range(40, 47)), 4))
    assert engine.admit_ahead(launched) == 0
    check_in_flight_untouched(engine, launched, set())
    events = engine.land(launched, device.run_round(launched.plan))
    assert not any(isinstance(e, DoneEvent) for e in events)  # the cancel lands with the next launch
    events += run_until_idle(engine)
    assert {e.stream_id: e.finish_reason for e in events if isinstance(e, DoneEvent)} == {1: "cancelled", 2: "length"}
    assert tokens_by_stream(events)[2] == reference_tokens(range(40, 47), 4)


def test_a_stream_seated_ahead_then_cancelled_gives_its_lane_back_unrun():
    """Seated ahead and cancelled before its first round: the next round carries none of its
    seating (no reset, no sampler), its lane is free, and a stream after it runs cold."""
    device = FakeDevice(make_info(num_lanes=2, num_pages=32))
    engine = Engine(device, SchedulerConfig(num_lanes=2, grid=4))
    engine.submit(StreamRequest(1, tuple(range(10, 19)), 6))
    engine.step()
    launched = engine.launch()
    engine.submit(StreamRequest(2, tuple(range(60, 70)), 3))
    assert engine.admit_ahead(launched) == 1
    engine.land(launched, device.run_round(launched.plan))
    engine.cancel(2)
    engine.submit(StreamRequest(3, tuple(range(30, 41)), 3))
    events = engine.step()
    histories = [s.history for s in device.plans[-1].samplers]
    assert tuple(range(30, 41)) in histories and tuple(range(60, 70)) not in histories  # 2's seating is gone
    assert {e.stream_id: e.finish_reason for e in events if isinstance(e, DoneEvent)}.get(2) == "cancelled"
    events += run_until_idle(engine)
    assert tokens_by_stream(events)[3] == reference_tokens(range(30, 41), 3)
    assert tokens_by_stream(events)[1] == reference_tokens(range(10, 19), 6)
    assert 2 not in tokens_by_stream(events)


SYSTEM = list(range(10, 20))


def test_with_a_disk_tier_admission_ahead_seats_disk_hits_whose_loads_ride_the_next_round(tmp_path):
    """A restarted engine: a request the disk holds is seated beside the round in flight; its
    load is an item of the next round (none of the round in flight), before anything reads its
    pages, and it hits from disk as a cold run. A lane evicted ahead is exported by the next
    round too."""
    first = req(1, SYSTEM + [1, 2, 3], max_tokens=4)
    engine, _, tier = disk_engine(tmp_path)
    turn(engine, first)
    tier.close()
    engine, device, tier = disk_engine(tmp_path, num_lanes=2)  # a new process on the same directory
    engine.submit(req(2, [50, 51, 52, 53, 54, 55], max_tokens=2))
    run_until_idle(engine)  # stream 2's lane stays resident
    engine.submit(req(3, [70, 71, 72], max_tokens=30))
    engine.step()
    launched = engine.launch()
    engine.submit(req(4, SYSTEM + [1, 2, 3, 9], max_tokens=3))  # the disk holds 13 of its rows
    assert engine.admit_ahead(launched) == 1
    assert not launched.plan.loads and device.loaded == []
    engine.land(launched, device.run_round(launched.plan))
    events = engine.step()
    assert device.plans[-1].loads and device.loaded  # the next round loads, then restores/samples
    events += run_until_idle(engine)
    done = {e.stream_id: e for e in events if isinstance(e, DoneEvent)}
    assert tokens_by_stream(events)[4] == reference_tokens(SYSTEM + [1, 2, 3, 9], 3)
    assert done[4].usage.cached_tokens == 13

    engine.submit(req(6, [30, 31, 32, 33, 34, 35, 36], max_tokens=40))
    engine.step()
    launched = engine.launch()
    exported = len(device.exported)
    engine.submit(req(7, [110, 111, 112], max_tokens=2))  # no free lane: a resident one is evicted ahead
    assert engine.admit_ahead(launched) == 1
    assert len(device.exported) == exported and tier.has_work  # its write-through waits for a round
    engine.land(launched, device.run_round(launched.plan))
    events = engine.step()
    assert len(device.exported) > exported and device.plans[-1].exports
    events += run_until_idle(engine)
    assert tokens_by_stream(events)[7] == reference_tokens([110, 111, 112], 2)
    tier.close()
