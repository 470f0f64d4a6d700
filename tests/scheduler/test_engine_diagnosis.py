"""Cache diagnostics through the engine: the done event's usage says where a prompt left the
cache (the store or a resident lane) and why nothing matched (scheduler/diagnosis.py)."""

from __future__ import annotations

from prefixd.ipc.events import CACHE_REASONS
from prefixd.scheduler import diagnosis
from prefixd.scheduler.observer import NullObserver
from tests.scheduler.engines import make_engine, req, turn

A = list(range(10, 30))  # 20 ids; P = 4


class Misses(NullObserver):
    def __init__(self):
        self.reasons = []

    def on_miss(self, reason):
        self.reasons.append(reason)


def test_a_reply_changed_by_the_client_diverges_where_the_resident_lane_holds_the_model_reply():
    engine, _ = make_engine(num_lanes=2, grid=4, budget=16, cache=True, store=True)
    reply, _ = turn(engine, req(1, A, max_tokens=3))
    # the lane holds the prompt and the first two reply rows; the store only the prompt's
    changed = A + [reply[0], 999]
    _, done = turn(engine, req(2, changed, max_tokens=1))
    div = done.usage.divergence
    assert (done.usage.cache, done.usage.cached_tokens, done.usage.cache_reason) == ("hit", 20, "diverged")
    assert (div.at, div.new_id, div.cached_id, div.cached_ids) == (21, 999, reply[1], (reply[1],))
    assert div.before_ids == tuple(changed[13:21])


def test_a_family_that_is_not_row_invariant_names_rows_held_under_another_schedule():
    rec = Misses()
    engine, _ = make_engine(num_lanes=1, grid=4, budget=16, cache=True, store=True, observer=rec,
                            invariant_rows=False)
    turn(engine, req(1, A, max_tokens=1, chunk_starts=(6,)))  # cuts 6, 10, 14, 18, 20
    turn(engine, req(2, [500, 501, 502], max_tokens=1, namespace="x"))  # takes the lane
    # the same first 9 ids, started elsewhere: the snapshot at 6 was computed under other chunks
    _, done = turn(engine, req(3, A[:9] + [999] * 3, max_tokens=1, chunk_starts=(5,)))
    assert (done.usage.cache, done.usage.cache_reason, done.usage.divergence.at) == ("miss", "other_schedule", 9)
    assert rec.reasons == ["namespace_empty", "namespace_empty", "other_schedule"]


def test_the_engine_keeps_the_last_reports_for_status_oldest_first():
    engine, _ = make_engine(num_lanes=1, grid=4, budget=16, cache=True, store=True)
    for sid in range(1, diagnosis.RECENT_REPORTS + 3):
        turn(engine, req(sid, [sid + 40, 2, 3], max_tokens=1, cache=sid % 2 == 0))
    reports = engine.status()["cache_reports"]
    assert [r["stream_id"] for r in reports] == list(range(3, diagnosis.RECENT_REPORTS + 3))
    assert reports[-1] == {"stream_id": 34, "namespace": "", "cache": "miss", "prompt_tokens": 3,
                           "cached_tokens": 0, "cache_reason": "diverged",
                           "divergence": {"at": 0, "new_id": 74, "before_ids": [], "new_ids": [74, 2, 3],
                                          "cached_id": 72, "cached_ids": [72, 2, 3]}}  # ties: the latest
    assert reports[-2]["cache_reason"] == "cache_off"


def test_the_reasons_are_the_wire_enumeration():
    assert CACHE_REASONS == (diagnosis.CACHE_OFF, diagnosis.NAMESPACE_EMPTY, diagnosis.EVICTED,
                             diagnosis.OTHER_SCHEDULE, diagnosis.TOO_SHORT, diagnosis.DIVERGED)
