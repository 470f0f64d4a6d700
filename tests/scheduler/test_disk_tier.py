"""The disk tier wired to the engine: write-through, a restart that hits from disk exactly,
chained files, identity, the budget and its eviction order."""

from __future__ import annotations

import os

import pytest

from tests.scheduler.disk_rig import disk_engine
from tests.scheduler.engines import make_engine, req, turn

P = 4
SYSTEM = list(range(10, 20))  # 10 rows: two full pages and a partial one


def cold(r, **info_kw):
    engine, _ = make_engine(num_lanes=1, grid=4, budget=16, cache=False, store=True, **info_kw)
    return turn(engine, r)[0]


def files(d):
    return sorted(p for p in os.listdir(d) if p.endswith(".pxc"))


def test_a_restarted_engine_hits_from_disk_and_answers_as_a_cold_run(tmp_path):
    first = req(1, SYSTEM + [1, 2, 3], max_tokens=4)
    engine, _, tier = disk_engine(tmp_path)
    turn(engine, first)
    tier.close()
    assert tier.stats().entries == len(files(tmp_path)) > 0
    later = req(2, SYSTEM + [1, 2, 3, 7, 8, 9], max_tokens=5)
    engine2, device2, tier2 = disk_engine(tmp_path)  # a new process: empty RAM, same directory
    tokens, done = turn(engine2, later)
    assert tokens == cold(later)
    assert done.usage.cached_tokens == 13  # the first request's whole prompt, from disk
    assert tier2.stats().hit_tokens == 13
    assert device2.loaded == [(0, 1, 2, 3)] or sum(len(x) for x in device2.loaded) == 4


def test_a_full_prompt_hit_after_a_restart_samples_from_the_stored_logits_row(tmp_path):
    r = req(1, SYSTEM + [5, 6], max_tokens=3)
    engine, _, tier = disk_engine(tmp_path)
    expected, _ = turn(engine, r)
    tier.close()
    engine2, device2, _ = disk_engine(tmp_path)
    tokens, done = turn(engine2, req(2, SYSTEM + [5, 6], max_tokens=3))
    assert tokens == expected == cold(r)
    assert done.usage.cached_tokens == 12
    assert done.usage.prefilled_tokens == 0


def test_a_later_turn_writes_only_the_pages_its_parent_file_lacks(tmp_path):
    engine, device, tier = disk_engine(tmp_path)
    turn(engine, req(1, SYSTEM, max_tokens=1))  # cuts 4, 8, 10: each file adds its own page
    tier.flush()
    assert device.exported == [(0,), (1,), (2,)]
    turn(engine, req(2, SYSTEM + [1, 2, 3, 4, 5, 6], max_tokens=1))  # cuts 12, 16 over cut 10
    tier.flush()
    later = device.exported[3:]
    assert [len(p) for p in later] == [1, 1]  # page 2 again (rows 10, 11 are new), then page 3
    assert tier.stats().entries == 5
    tier.close()
    engine2, _, tier2 = disk_engine(tmp_path)
    r = req(3, SYSTEM + [1, 2, 3, 4, 5, 6, 9], max_tokens=3)
    tokens, done = turn(engine2, r)
    assert done.usage.cached_tokens == 16 and tokens == cold(r)
    tier2.index.check_integrity()


@pytest.mark.parametrize("change", [{"model_hash": "m2"}, {"mode": "fast"}])
def test_another_model_or_mode_never_reuses_an_entry_and_counts_it(tmp_path, change):
    engine, _, tier = disk_engine(tmp_path)
    turn(engine, req(1, SYSTEM, max_tokens=1))
    tier.close()
    n = len(files(tmp_path))
    engine2, _, tier2 = disk_engine(tmp_path, ident_kw=change)
    assert tier2.stats().corrupt == n == 3 and tier2.stats().entries == 0  # foreign: removed, counted
    _, done = turn(engine2, req(2, SYSTEM + [1], max_tokens=1))
    assert done.usage.cached_tokens == 0


def test_a_hybrid_state_is_restored_from_disk_at_a_cut_of_the_requests_schedule(tmp_path):
    kw = dict(invariant_rows=False)
    r1 = req(1, SYSTEM + [1, 2], max_tokens=2, chunk_starts=(10,))
    engine, _, tier = disk_engine(tmp_path, **kw)
    turn(engine, r1)
    tier.close()
    r2 = req(2, SYSTEM + [1, 2, 3, 4, 5], max_tokens=3, chunk_starts=(10, 12))
    engine2, _, _ = disk_engine(tmp_path, **kw)
    tokens, done = turn(engine2, r2)
    assert done.usage.cached_tokens == 12
    assert tokens == cold(r2, **kw)


def test_a_kept_entry_is_exported_by_the_next_round_and_an_idle_engine_runs_one_for_it(tmp_path):
    """The last keep of a turn is exported in a round of its own after the stream ended: the
    engine is not idle until then, that round carries only the export, and it is not counted as
    a lane round (the round-time histogram describes lane rounds)."""
    from prefixd.scheduler.observer import NullObserver

    class Rounds(NullObserver):
        def __init__(self):
            self.rows = []

        def on_round(self, duration_s, forward_s, num_rows, lanes_busy, waiting):
            self.rows.append(num_rows)

    engine, device, tier = disk_engine(tmp_path)
    engine.observer = observer = Rounds()
    engine.submit(req(1, SYSTEM, max_tokens=1))
    events = []
    while not any(getattr(e, "finish_reason", None) for e in events):
        events += engine.step()
    assert not engine.idle and tier.has_work  # the turn's last keep waits for a round
    lane_rounds = len(observer.rows)
    assert engine.step() == [] and engine.idle
    assert device.plans[-1].exports and not device.plans[-1].lanes and len(observer.rows) == lane_rounds
    tier.flush()
    assert tier.stats().written_bytes == tier.stats().bytes > 0
