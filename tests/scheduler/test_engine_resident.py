"""Resident lanes: a finished turn keeps its lane; the next turn of its conversation continues in place."""

from __future__ import annotations


from prefixd.scheduler.engine import Engine
from prefixd.scheduler.streams import DoneEvent
from tests.scheduler.engines import make_engine, req, turn
from tests.scheduler.fake_device import (FakeDevice, done_by_stream, run_until_idle,
                                         tokens_by_stream)

def make(num_lanes=2, grid=4, budget=16, cache=True, **info_kw) -> tuple[Engine, FakeDevice]:
    return make_engine(num_lanes=num_lanes, grid=grid, budget=budget, cache=cache, store=False, **info_kw)


def cold(r, **info_kw) -> list[int]:
    engine, _ = make(cache=False, **info_kw)
    return turn(engine, r)[0]


SYSTEM = list(range(10, 20))


def test_resident_continuation_copies_nothing_and_prefills_only_new_rows():
    engine, device = make()
    out1, _ = turn(engine, req(1, SYSTEM))
    prompt2 = SYSTEM + out1 + [7, 8, 9, 10, 11]
    num_plans = len(device.plans)
    out2, done2 = turn(engine, req(2, prompt2))
    assert (done2.usage.cache, done2.usage.cached_tokens, done2.usage.prefilled_tokens) == ("resident", 12, 6)
    assert device.copied_bytes == 0
    assert [(w.lane, w.start, len(w.tokens), w.prefill) for w in device.plans[num_plans].lanes] == [(0, 12, 4, True)]
    assert device.resets == [0]  # only the first turn zeroed the lane
    assert out2 == cold(req(2, prompt2))


def test_a_prompt_equal_to_the_held_rows_recomputes_only_its_last_row():
    engine, device = make()
    out1, _ = turn(engine, req(1, SYSTEM, max_tokens=2))
    prompt2 = SYSTEM + out1[:1]  # == the 11 rows the lane holds
    out2, done2 = turn(engine, req(2, prompt2))
    assert (done2.usage.cached_tokens, done2.usage.prefilled_tokens) == (10, 1)
    assert out2 == cold(req(2, prompt2))
    assert device.copied_bytes == 0


def test_a_diverging_prompt_leaves_the_resident_lane_alone():
    engine, _ = make()
    turn(engine, req(1, SYSTEM))
    prompt2 = SYSTEM[:6] + [1, 2, 3]
    out2, done2 = turn(engine, req(2, prompt2))
    assert (done2.usage.cache, done2.usage.cached_tokens) == ("miss", 0)
    assert out2 == cold(req(2, prompt2))
    assert engine.status()["lanes"][0] == {"lane": 0, "state": "resident", "rows": 12, "pages": 3}


def test_another_namespace_does_not_continue_the_lane():
    engine, _ = make()
    out1, _ = turn(engine, req(1, SYSTEM))
    _, done2 = turn(engine, req(2, SYSTEM + out1, namespace="b"))
    assert (done2.usage.cache, done2.usage.cached_tokens) == ("miss", 0)
    assert [lane["state"] for lane in engine.status()["lanes"]] == ["resident", "resident"]


def test_least_recently_used_resident_lane_is_evicted_when_seats_run_out():
    engine, device = make()
    a1, _ = turn(engine, req(1, SYSTEM))
    b1, _ = turn(engine, req(2, range(40, 46)))
    turn(engine, req(3, range(60, 66)))  # seats: a (older) goes, b stays
    lanes = engine.status()["lanes"]
    assert [(lane["state"], lane["rows"]) for lane in lanes] == [("resident", 8), ("resident", 8)]
    _, done_b = turn(engine, req(4, list(range(40, 46)) + b1))
    assert (done_b.usage.cache, done_b.usage.cached_tokens) == ("resident", 8)
    _, done_a = turn(engine, req(5, SYSTEM + a1))
    assert done_a.usage.cache == "miss"
    assert [lane for lane, _ in device.starts] == [0, 1, 0, 1, 0]


def test_a_waiting_stream_takes_its_own_resident_lane():
    engine, _ = make(num_lanes=2)
    a1, _ = turn(engine, req(1, SYSTEM))
    engine.submit(req(2, range(80, 84), max_tokens=8))
    engine.submit(req(3, range(90, 94), max_tokens=8))
    engine.submit(req(4, SYSTEM + a1, max_tokens=3))
    events = engine.step()
    # stream 4 continues lane 0; stream 2 took lane 1; stream 3 waits
    assert engine.status()["lanes"][0]["stream_id"] == 4
    assert engine.status()["lanes"][1]["stream_id"] == 2
    events += run_until_idle(engine)
    assert done_by_stream(events)[4].usage.cache == "resident"


def test_cache_off_frees_the_lane_after_the_turn():
    engine, _ = make()
    out1, _ = turn(engine, req(1, SYSTEM, cache=False))
    assert engine.status()["lanes"][0] == {"lane": 0, "state": "free", "rows": 0, "pages": 0}
    _, done2 = turn(engine, req(2, SYSTEM + out1))
    assert (done2.usage.cache, done2.usage.cached_tokens) == ("miss", 0)


def test_a_cache_key_of_another_length_reuses_and_keeps_nothing():
    engine, _ = make()
    out1, _ = turn(engine, req(1, SYSTEM))
    _, done2 = turn(engine, req(2, SYSTEM + out1, cache_key=(1, 2, 3)))
    assert (done2.usage.cache, done2.usage.cached_tokens) == ("off", 0)
    assert "nothing reused or kept" in done2.note
    assert engine.status()["lanes"][1]["state"] == "free"


def test_cancel_while_decoding_keeps_the_lane_and_mid_prefill_frees_it():
    engine, _ = make(budget=4)
    engine.submit(req(1, SYSTEM, max_tokens=50))
    engine.submit(req(2, range(30, 42), max_tokens=50))
    for _ in range(4):
        engine.step()
    engine.cancel(1)
    engine.cancel(2)
    events = engine.step()
    assert [(ev.stream_id, ev.finish_reason) for ev in events if isinstance(ev, DoneEvent)] == [
        (1, "cancelled"), (2, "cancelled")]
    assert [lane["state"] for lane in engine.status()["lanes"]] == ["resident", "free"]


def test_pages_short_evicts_resident_lanes_before_waiting():
    engine, _ = make(num_lanes=3, num_pages=8)
    turn(engine, req(1, range(12)))  # resident: 4 pages
    _, done = turn(engine, req(2, range(40, 52)))  # needs 4 + headroom: 4 free
    assert done.usage.cache == "miss"
    turn(engine, req(3, range(60, 72)))  # needs lane 0's pages
    assert [lane["state"] for lane in engine.status()["lanes"]] == ["free", "resident", "resident"]


NON_INVARIANT = dict(invariant_rows=False)


def test_non_invariant_family_resumes_in_place_only_at_its_last_cut():
    engine, device = make(**NON_INVARIANT)
    out1, _ = turn(engine, req(1, SYSTEM, chunk_starts=(4,)))
    prompt2 = SYSTEM + out1 + [5, 6, 7]
    out2, done2 = turn(engine, req(2, prompt2, chunk_starts=(4, 10)))
    # rows after the cut at 10 were decoded, not prefilled: they are computed again
    assert (done2.usage.cache, done2.usage.cached_tokens, done2.usage.prefilled_tokens) == ("resident", 10, 6)
    assert device.copied_bytes == 256  # the lane state captured at the cut, no pages
    assert out2 == cold(req(2, prompt2, chunk_starts=(4, 10)), **NON_INVARIANT)


def test_non_invariant_family_resumes_in_place_at_the_reply_header_cut():
    engine, device = make(**NON_INVARIANT)
    out1, _ = turn(engine, req(1, SYSTEM, chunk_starts=(8,)))  # rows 8, 9: the reply header
    prompt2 = SYSTEM + out1 + [5, 6, 7] + [1, 2]
    starts2 = (8, 13, 16)
    out2, done2 = turn(engine, req(2, prompt2, chunk_starts=starts2))
    assert (done2.usage.cache, done2.usage.cached_tokens, done2.usage.prefilled_tokens) == ("resident", 8, 10)
    assert device.copied_bytes == 256
    assert out2 == cold(req(2, prompt2, chunk_starts=starts2), **NON_INVARIANT)


def test_non_invariant_family_needs_the_same_starts_below_the_cut():
    engine, _ = make(**NON_INVARIANT)
    out1, _ = turn(engine, req(1, SYSTEM, chunk_starts=(4,)))
    prompt2 = SYSTEM + out1 + [5, 6, 7]
    out2, done2 = turn(engine, req(2, prompt2, chunk_starts=(3, 10)))
    assert (done2.usage.cache, done2.usage.cached_tokens) == ("miss", 0)
    assert out2 == cold(req(2, prompt2, chunk_starts=(3, 10)), **NON_INVARIANT)


def test_concurrent_conversations_continue_their_own_lanes_and_equal_cold_runs():
    engine, device = make(num_lanes=3, budget=9)
    firsts = {sid: list(range(sid * 50, sid * 50 + 5 + sid)) for sid in (1, 2, 3)}
    for sid, prompt in firsts.items():
        engine.submit(req(sid, prompt, max_tokens=4))
    outs = tokens_by_stream(run_until_idle(engine))
    seconds = {sid + 10: firsts[sid] + outs[sid] + [sid] * 6 for sid in firsts}
    for sid, prompt in seconds.items():
        engine.submit(req(sid, prompt, max_tokens=5))
    events = run_until_idle(engine)
    for sid, prompt in seconds.items():
        assert done_by_stream(events)[sid].usage.cache == "resident"
        assert tokens_by_stream(events)[sid] == cold(req(sid, prompt, max_tokens=5))
    assert device.copied_bytes == 0
