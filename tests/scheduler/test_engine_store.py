"""The engine wired to the prefix store: lookups, restores, keeps at cuts, full hits, eviction."""

from __future__ import annotations

import pytest

from prefixd.scheduler.observer import NullObserver
from tests.scheduler.engines import make_engine, req, turn
from tests.scheduler.fake_device import (done_by_stream, reference_tokens, run_until_idle,
                                         tokens_by_stream)

class Recorder(NullObserver):
    def __init__(self):
        self.lookups, self.evictions, self.copies = [], [], []

    def on_lookup(self, result, query_tokens, hit_tokens):
        self.lookups.append((result, query_tokens, hit_tokens))

    def on_eviction(self, reason, nbytes):
        self.evictions.append((reason, nbytes))

    def on_snapshot_copy(self, direction, nbytes):
        self.copies.append((direction, nbytes))


def make(num_lanes=1, grid=4, budget=16, cache=True, cache_budget_bytes=None, observer=None, **info_kw):
    return make_engine(num_lanes=num_lanes, grid=grid, budget=budget, cache=cache, store=True,
                       cache_budget_bytes=cache_budget_bytes, observer=observer, **info_kw)


def cold(r, **info_kw) -> list[int]:
    engine, _ = make(cache=False, **info_kw)
    return turn(engine, r)[0]


SYSTEM = list(range(10, 20))
OTHER = list(range(500, 506))


def test_an_evicted_resident_lane_is_published_and_restored_from_the_store():
    rec = Recorder()
    engine, device = make(observer=rec)
    out1, _ = turn(engine, req(1, SYSTEM, max_tokens=2))  # lane holds 11 rows
    turn(engine, req(2, OTHER))  # takes the only seat: lane published first
    prompt = SYSTEM + out1 + [1, 2, 3]
    out3, done3 = turn(engine, req(3, prompt))
    assert (done3.usage.cache, done3.usage.cached_tokens, done3.usage.prefilled_tokens) == ("hit", 11, 4)
    assert rec.lookups[-1] == ("hit", 15, 11)
    assert rec.copies == [("restore", 1024)]  # the tail page of row 11 is copied before writing
    assert out3 == cold(req(3, prompt))


def test_a_whole_prompt_hit_samples_its_first_token_without_a_forward():
    engine, device = make()
    out1, _ = turn(engine, req(1, SYSTEM))
    turn(engine, req(2, OTHER))
    num_plans = len(device.plans)
    out3, done3 = turn(engine, req(3, SYSTEM, want_logits=True))
    assert (done3.usage.cache, done3.usage.cached_tokens, done3.usage.prefilled_tokens) == ("hit", 10, 0)
    assert out3 == out1
    first_plan, second_plan = device.plans[num_plans : num_plans + 2]
    assert first_plan.lanes == () and [(s.lane, s.row, s.digest) for s in first_plan.stored] == [(0, 0, True)]
    assert [(w.start, w.prefill, w.tokens) for w in second_plan.lanes] == [(10, False, (out1[0],))]


def test_only_the_prompts_end_keeps_a_logits_row():
    engine, device = make()
    turn(engine, req(1, SYSTEM))  # chunks end at cuts 4, 8 and 10
    prefill = [w for p in device.plans for w in p.lanes if w.prefill]
    assert [(w.start, w.logits_rows) for w in prefill] == [(0, ()), (4, ()), (8, (1,))]
    assert [(e.cut, e.nbytes) for e in engine.store.describe()] == [(4, 0), (8, 0), (10, 1024 + 4000)]
    turn(engine, req(2, OTHER))  # the lane is published and let go
    num_plans = len(device.plans)
    _, done = turn(engine, req(3, SYSTEM[:8]))  # a prompt ending at cut 8 recomputes its last row
    assert (done.usage.cache, done.usage.cached_tokens, done.usage.prefilled_tokens) == ("hit", 7, 1)
    assert [(w.start, w.tokens) for w in device.plans[num_plans].lanes] == [(7, (SYSTEM[7],))]


def test_keeps_happen_at_the_cuts_the_pass_prefilled():
    engine, _ = make(budget=4)
    engine.submit(req(1, range(100, 112), max_tokens=5))
    engine.step()
    engine.step()
    assert engine.status()["store"]["entries"] == 2  # cuts 4 and 8
    engine.cancel(1)
    engine.step()
    assert engine.status()["store"]["entries"] == 2
    _, done = turn(engine, req(2, list(range(100, 110)) + [7, 7]))
    assert (done.usage.cache, done.usage.cached_tokens) == ("hit", 8)


def test_a_cancel_before_the_first_chunk_finishes_keeps_nothing():
    engine, _ = make(num_lanes=1)
    engine.submit(req(1, OTHER, max_tokens=2))
    engine.submit(req(2, range(100, 112)))
    engine.cancel(2)
    run_until_idle(engine)
    stats = engine.status()["store"]
    assert stats["entries"] == 2  # OTHER's cuts 4 and 6 only
    assert engine.status()["lanes"][0]["rows"] == 7


def test_request_with_cache_off_neither_looks_up_nor_keeps():
    engine, _ = make()
    turn(engine, req(1, SYSTEM, cache=False))
    stats = engine.status()["store"]
    assert (stats["entries"], stats["hits"], stats["misses"]) == (0, 0, 0)


def test_the_store_makes_room_when_pages_are_short():
    rec = Recorder()
    engine, _ = make(num_pages=8, observer=rec)
    turn(engine, req(1, range(100, 112)))  # 4 pages held by the lane and the store
    turn(engine, req(2, range(200, 212)))  # lane published, pages needed: store evicts
    assert engine.status()["pages_used"] <= 8
    assert rec.evictions and all(nbytes > 0 for _, nbytes in rec.evictions)
    assert engine.status()["store"]["evictions"] != {}


TIGHT = 10_000 + 2 * 4 * 8 + 3 * 1024  # weights + 2 lanes x G rows of workspace first; 3 pages left


def test_turns_equal_cold_runs_with_the_store_unbounded_evicting_and_off():
    outs, stats = {}, {}
    for cache, budget in ((True, None), (True, TIGHT), (False, None)):
        engine, _ = make(num_lanes=2, cache=cache, cache_budget_bytes=budget)
        convs = {1: SYSTEM, 2: list(range(30, 45)), 3: list(range(60, 69))}
        for t in range(3):
            for c, prompt in convs.items():
                out, _ = turn(engine, req(100 * t + c, prompt))
                convs[c] = prompt + out + [c, t]
        outs[cache, budget] = convs
        stats[cache, budget] = engine.status().get("store")
    assert outs[True, None] == outs[True, TIGHT] == outs[False, None]
    assert stats[True, None]["hits"] == 6 and stats[True, None]["hit_tokens"] == 95
    assert stats[True, TIGHT]["budget_bytes"] == 3 * 1024
    # 3 pages: cuts inside a prompt (pages only) fit and are evicted as turns move past them
    evicted = {k: v for k, v in stats[True, TIGHT]["evictions"].items() if v}
    assert stats[True, TIGHT]["skipped_saves"] > 0 and evicted == {"moved_past": 4, "never_hit": 7}


NON_INVARIANT = dict(invariant_rows=False)


def test_non_invariant_family_resumes_from_a_snapshot_at_its_own_cut():
    rec = Recorder()
    engine, device = make(observer=rec, **NON_INVARIANT)
    out1, _ = turn(engine, req(1, SYSTEM, chunk_starts=(6,)))
    turn(engine, req(2, OTHER))
    prompt = SYSTEM + out1 + [4, 4]
    out3, done3 = turn(engine, req(3, prompt, chunk_starts=(6, 10)))
    assert (done3.usage.cache, done3.usage.cached_tokens) == ("hit", 10)
    assert out3 == cold(req(3, prompt, chunk_starts=(6, 10)), **NON_INVARIANT)
    _, done4 = turn(engine, req(4, prompt, chunk_starts=(5, 10)))  # other starts below the cut
    assert done4.usage.cache in ("miss", "resident") and done4.usage.cached_tokens != 10


def test_concurrent_turns_with_the_store_equal_cold_runs():
    for info_kw in ({}, NON_INVARIANT):
        engine, _ = make(num_lanes=2, budget=6, **info_kw)
        prompts = {c: [c] * 3 + list(range(c * 40, c * 40 + 9)) for c in (1, 2, 3)}
        for t in range(3):
            for c, prompt in prompts.items():
                engine.submit(req(100 * t + c, prompt, max_tokens=3, chunk_starts=(3,)))
            events = run_until_idle(engine)
            outs = tokens_by_stream(events)
            for c, prompt in prompts.items():
                assert outs[100 * t + c] == cold(req(0, prompt, chunk_starts=(3,)), **info_kw)
                prompts[c] = prompt + outs[100 * t + c] + [t + 1] * 2
        assert engine.status()["store"]["hits"] > 0


def test_status_reports_lanes_pages_and_exact_store_bytes():
    engine, _ = make()
    turn(engine, req(1, SYSTEM))
    status = engine.status()
    assert status["lanes"] == [{"lane": 0, "state": "resident", "rows": 12, "pages": 3}]
    assert (status["pages_used"], status["pages_free"], status["waiting"]) == (3, 61, 0)
    store = status["store"]
    # cuts 4, 8, 10: two full pages + the tail page of rows 8..9, and the logits row at 10
    assert (store["entries"], store["pages"], store["bytes"]) == (3, 3, 3 * 1024 + 4000)
    assert (store["misses"], store["hits"], store["query_tokens"]) == (1, 0, 10)


def test_check_integrity_catches_a_leaked_page():
    engine, _ = make()
    turn(engine, req(1, SYSTEM))
    engine.allocator.incref([0])
    with pytest.raises(RuntimeError, match="refcounts"):
        engine.check_integrity()
    engine.allocator.decref([0])


def test_store_bytes_are_reported_after_rounds_that_change_the_store_only():
    class Bytes(NullObserver):
        def __init__(self):
            self.reports, self.rounds = [], 0

        def on_store(self, bytes_held, budget_bytes):
            self.reports.append((bytes_held, budget_bytes))

        def on_round(self, duration_s, forward_s, num_rows, lanes_busy, waiting):
            self.rounds += 1

    obs = Bytes()
    engine, _ = make(observer=obs)
    turn(engine, req(1, SYSTEM))  # 3 prefill rounds keep cuts 4, 8, 10; 2 decode rounds keep nothing
    assert obs.rounds == 5 and len(obs.reports) == 3
    assert obs.reports[-1] == (engine.status()["store"]["bytes"], 65536) == (7072, 65536)


def test_a_cache_key_of_another_length_neither_looks_up_nor_keeps():
    engine, _ = make()
    out, done = turn(engine, req(1, SYSTEM, cache_key=(1, 2, 3)))
    stats = engine.status()["store"]
    assert (stats["entries"], stats["hits"], stats["misses"]) == (0, 0, 0)
    assert (done.usage.cache, done.note) == ("off", "cache key has 3 tokens but the prompt has 10: nothing reused or kept")
    assert engine.status()["lanes"][0]["state"] == "free"
    assert out == cold(req(1, SYSTEM))


def test_a_cache_key_of_the_prompts_length_is_the_identity():
    engine, _ = make()
    key = tuple(t + 1 for t in SYSTEM)
    turn(engine, req(1, SYSTEM, cache_key=key))
    turn(engine, req(2, OTHER))
    _, by_tokens = turn(engine, req(3, SYSTEM))
    _, by_key = turn(engine, req(4, SYSTEM, cache_key=key))
    assert (by_tokens.usage.cache, by_key.usage.cache, by_key.usage.cached_tokens) == ("miss", "hit", 10)


def test_a_waiting_stream_holding_a_store_hit_that_then_continues_a_resident_lane_lets_the_hit_go():
    engine, _ = make(num_lanes=2, num_pages=10)
    out1, _ = turn(engine, req(1, SYSTEM))
    r_prompt = SYSTEM + out1
    engine.submit(req(2, r_prompt))  # continues lane 0
    engine.step()
    s_prompt = r_prompt + reference_tokens(r_prompt, 3) + list(range(300, 320))
    engine.submit(req(3, s_prompt))  # seat free, pages short: waits holding a hit at row 13
    engine.step()
    assert engine.admitter.waiting and next(iter(engine.admitter.waiting)).hit.rows == 13
    done = done_by_stream(run_until_idle(engine))[3]  # then stream 2's lane turns resident: it continues there
    assert (done.usage.cache, done.usage.cached_tokens) == ("resident", 15)


def _serve_all(engine, requests):
    for r in requests:
        engine.submit(r)
    return done_by_stream(run_until_idle(engine, max_steps=500))


def test_with_nothing_running_a_pinned_hit_is_dropped_rather_than_waiting_forever():
    # 10 pages; the only entry (pinned by stream 4's hit) holds 9 of them.
    engine, _ = make(num_pages=10, budget=1)
    p1 = list(range(10, 27))
    p2 = p1 + reference_tokens(p1, 6) + [0]
    p3 = p2 + reference_tokens(p2, 1) + [0, 0, 0]
    done = _serve_all(engine, [req(1, p1, 6, cache=False), req(2, p2, 1), req(3, p3, 6), req(4, p2, 1)])
    assert [done[s].usage.cache for s in (1, 2, 3, 4)] == ["off", "miss", "resident", "miss"]


def test_with_nothing_running_entries_that_free_pages_only_together_are_evicted():
    engine, _ = make(num_pages=10, budget=1)
    b = [10]
    reqs = [req(1, b + [0, 0, 0], 1, cache=False)]
    p2 = b + [0, 0, 0] + reference_tokens(b + [0, 0, 0], 1) + [0]
    reqs += [req(2, p2, 1), req(3, p2, 1)]
    p4 = p2 + reference_tokens(p2, 1) + [0]
    reqs += [req(4, p4, 4), req(5, p4 + reference_tokens(p4, 4) + [0], 2)]
    p6 = list(range(10, 14)) + [0] * 6
    reqs += [req(6, p6, 6, cache=False)]
    p7 = p6 + reference_tokens(p6, 6) + [0] * 5
    reqs += [req(7, p7, 2), req(8, [10], 1, cache=False), req(9, p4 + reference_tokens(p4, 4) + [0] * 6, 1)]
    done = _serve_all(engine, reqs)
    assert sorted(done) == list(range(1, 10)) and all(d.finish_reason == "length" for d in done.values())
    evictions = engine.status()["store"]["evictions"]
    # make_room frees pages held only jointly by evicting the group in order: no clear() needed
    assert evictions["cleared"] == 0 and evictions["moved_past"] + evictions["never_hit"] > 0


def test_a_failing_stored_row_sample_ends_its_stream_alone_and_the_entry_still_serves():
    engine, device = make()
    out1, _ = turn(engine, req(1, SYSTEM))
    turn(engine, req(2, OTHER))
    device.stored_fault = lambda item: "injected fault"
    tokens, done = engine_turn_failing(engine, req(3, SYSTEM))
    assert tokens == [] and done.finish_reason == "error"
    assert done.note == "this request failed in its lane round: injected fault"
    assert engine.status()["lanes"][0]["state"] == "free"  # freed, not kept resident
    device.stored_fault = None
    out4, done4 = turn(engine, req(4, SYSTEM))
    assert (done4.usage.cache, done4.usage.cached_tokens, out4) == ("hit", 10, out1)


def engine_turn_failing(engine, r):
    """`turn` for a stream that emits no token."""
    engine.submit(r)
    events = run_until_idle(engine)
    return tokens_by_stream(events).get(r.stream_id, []), done_by_stream(events)[r.stream_id]
