"""Engine rounds, admission, cancel and limits on the fake device (no store: resident lanes only)."""

from __future__ import annotations

import pytest

from prefixd.scheduler.config import SchedulerConfig
from prefixd.scheduler.engine import Engine
from prefixd.scheduler.observer import NullObserver
from prefixd.scheduler.records import ImageIdentity, ImageRows, SamplingParams
from prefixd.scheduler.streams import DoneEvent, RequestError, StreamRequest, TokenEvent
from tests.scheduler import engines
from tests.scheduler.engines import make_engine
from tests.scheduler.fake_device import (FakeDevice, done_by_stream, make_info, reference_tokens,
                                         run_until_idle, tokens_by_stream)

def make(num_lanes=2, grid=4, budget=5, cache=False, **info_kw) -> tuple[Engine, FakeDevice]:
    return make_engine(num_lanes=num_lanes, grid=grid, budget=budget, cache=cache, store=False, **info_kw)


def req(sid, tokens, max_tokens=4, **kw) -> StreamRequest:
    return engines.req(sid, tokens, max_tokens, **kw)


def shape(plan):
    """(lane, start, rows, prefill, page_table) per work item."""
    return [(w.lane, w.start, len(w.tokens), w.prefill, w.page_table) for w in plan.lanes]


def test_rounds_mix_prefill_and_decode_within_the_row_budget():
    engine, device = make(budget=5)
    engine.submit(req(1, range(100, 103), max_tokens=5))
    engine.step()
    engine.submit(req(2, range(200, 212), max_tokens=2))
    run_until_idle(engine)
    assert [shape(p) for p in device.plans] == [
        [(0, 0, 3, True, (0,))],
        [(0, 3, 1, False, (0,)), (1, 0, 4, True, (1,))],
        [(0, 4, 1, False, (0, 4)), (1, 4, 4, True, (1, 2))],
        [(0, 5, 1, False, (0, 4)), (1, 8, 4, True, (1, 2, 3))],
        [(0, 6, 1, False, (0, 4)), (1, 12, 1, False, (1, 2, 3, 5))],
    ]
    assert all(p.num_rows <= 5 for p in device.plans)
    assert device.plans[3].lanes[1].sample_rows == (3,)


def test_a_long_prompt_prefills_while_another_lane_decodes_every_round():
    engine, device = make(budget=5)
    engine.submit(req(1, range(4), max_tokens=20))
    events = engine.step()
    engine.submit(req(2, range(300, 340), max_tokens=1))
    events += run_until_idle(engine)
    prefill_rounds = [p for p in device.plans[1:] if any(w.lane == 1 and w.prefill for w in p.lanes)]
    assert len(prefill_rounds) == 10
    for plan in prefill_rounds:
        assert [(w.lane, len(w.tokens), w.prefill) for w in plan.lanes] == [(0, 1, False), (1, 4, True)]
    assert tokens_by_stream(events)[1] == reference_tokens(range(4), 20)
    assert tokens_by_stream(events)[2] == reference_tokens(range(300, 340), 1)


def test_one_chunk_runs_even_when_decode_rows_fill_the_budget():
    engine, device = make(num_lanes=3, budget=2)
    engine.submit(req(1, [1], max_tokens=10))
    engine.submit(req(2, [2], max_tokens=10))
    engine.step()
    engine.submit(req(3, range(10, 18), max_tokens=1))
    engine.step()
    engine.step()
    assert shape(device.plans[1])[2][:4] == (2, 0, 4, True)
    assert shape(device.plans[2])[2][:4] == (2, 4, 4, True)
    assert device.plans[1].num_rows == 6


def test_chunks_never_split_and_admission_order_decides_who_prefills():
    engine, device = make(num_lanes=3, budget=6)
    engine.submit(req(1, range(8), max_tokens=1))
    engine.submit(req(2, range(20, 23), max_tokens=1))
    engine.submit(req(3, range(30, 32), max_tokens=1))
    engine.step()
    # lane 0's chunk (4) + lane 1's (3) exceed 6: lane 1 waits though lane 2's 2 rows would fit.
    assert shape(device.plans[0]) == [(0, 0, 4, True, (0,))]
    run_until_idle(engine)


def test_fifo_admission_waits_for_a_free_lane():
    engine, device = make(num_lanes=1)
    for sid in (1, 2, 3):
        engine.submit(req(sid, range(sid * 10, sid * 10 + 3), max_tokens=2))
    events = run_until_idle(engine)
    done_order = [ev.stream_id for ev in events if isinstance(ev, DoneEvent)]
    assert done_order == [1, 2, 3]
    assert [h for _, h in device.starts] == [(10, 11, 12), (20, 21, 22), (30, 31, 32)]
    assert [[w.start for w in p.lanes] for p in device.plans] == [[0], [3], [0], [3], [0], [3]]


def test_lanes_full_reports_waiting():
    engine, _ = make(num_lanes=1)
    engine.submit(req(1, range(3), max_tokens=3))
    engine.submit(req(2, range(3), max_tokens=3))
    engine.step()
    status = engine.status()
    assert (status["lanes_busy"], status["waiting"]) == (1, 1)
    run_until_idle(engine)
    assert engine.status()["waiting"] == 0


def test_short_of_pages_a_stream_waits_then_proceeds():
    # 6 pages of 4 rows; each stream needs 12 prompt rows + 4 headroom rows = 4 pages.
    engine, device = make(num_pages=6)
    engine.submit(req(1, range(12), max_tokens=4))
    engine.submit(req(2, range(50, 62), max_tokens=4))
    events = engine.step()
    assert engine.status()["waiting"] == 1 and engine.status()["pages_free"] == 3
    events += run_until_idle(engine)
    first_b = next(i for i, p in enumerate(device.plans) if any(w.lane == 0 and w.start == 0 for w in p.lanes[1:]) or
                   (p.lanes[0].tokens[:1] == (50,)))
    done_a = [i for i, ev in enumerate(events) if isinstance(ev, DoneEvent)]
    assert len(done_a) == 2 and first_b == 6  # 3 prefill + 3 decode rounds of stream 1 first
    assert tokens_by_stream(events) == {1: reference_tokens(range(12), 4), 2: reference_tokens(range(50, 62), 4)}


def test_cancel_of_a_decoding_stream_leaves_within_one_round():
    engine, device = make()
    engine.submit(req(1, range(3), max_tokens=50))
    engine.submit(req(2, range(10, 13), max_tokens=50))
    engine.step()
    engine.step()
    assert engine.cancel(1) is True
    events = engine.step()
    assert [w.lane for w in device.plans[-1].lanes] == [1]
    assert isinstance(events[0], DoneEvent) and events[0].finish_reason == "cancelled"
    assert events[0].usage.completion_tokens == 2
    assert engine.status()["lanes"][0] == {"lane": 0, "state": "free", "rows": 0, "pages": 0}
    engine.cancel(2)
    engine.step()
    assert engine.idle and engine.status()["pages_used"] == 0


def test_cancel_mid_prefill_and_while_waiting():
    engine, device = make(num_lanes=1)
    engine.submit(req(1, range(12), max_tokens=5))
    engine.submit(req(2, range(3), max_tokens=5))
    engine.step()
    assert engine.cancel(1) and engine.cancel(2)
    events = engine.step()
    assert [(ev.stream_id, ev.finish_reason) for ev in events] == [(1, "cancelled"), (2, "cancelled")]
    assert len(device.plans) == 1 and engine.idle
    assert engine.status()["pages_used"] == 0
    assert engine.cancel(1) is False


def test_max_tokens_and_stop_ids_finish_the_stream():
    engine, _ = make()
    ref = reference_tokens(range(7), 6)
    engine.submit(req(1, range(7), max_tokens=6, stop_ids=frozenset({ref[3]})))
    engine.submit(req(2, range(7), max_tokens=3))
    events = run_until_idle(engine)
    done = done_by_stream(events)
    assert tokens_by_stream(events) == {1: ref[:4], 2: ref[:3]}
    assert (done[1].finish_reason, done[1].usage.completion_tokens) == ("stop", 4)
    assert (done[2].finish_reason, done[2].usage.completion_tokens) == ("length", 3)
    assert done[2].usage.prompt_tokens == 7 and done[2].usage.prefilled_tokens == 7


def test_generation_stops_with_length_at_max_context():
    engine, device = make(max_context=16)
    engine.submit(req(1, range(12), max_tokens=100))
    events = run_until_idle(engine)
    assert tokens_by_stream(events)[1] == reference_tokens(range(12), 4)
    assert done_by_stream(events)[1].finish_reason == "length"
    assert done_by_stream(events)[1].note == (
        "stopped at the context: 12 prompt + 4 generated tokens fill max_context 16 before max_tokens 100")
    assert max(w.start + len(w.tokens) for p in device.plans for w in p.lanes) == 15


@pytest.mark.parametrize(
    "request_kw, code",
    [
        (dict(tokens=(1, -1)), "invalid_token"),
        (dict(tokens=(1, 1000)), "invalid_token"),
        (dict(tokens=tuple(range(64))), "context_overflow"),
        (dict(tokens=()), "bad_request"),
        (dict(max_tokens=0), "bad_request"),
        (dict(chunk_starts=(3, 2)), "bad_request"),
        (dict(chunk_starts=(0, 0)), "bad_request"),
        (dict(chunk_starts=(5,)), "bad_request"),
        (dict(images=(ImageRows(ImageIdentity(at=3, tokens=3, gh=1, gw=3, hash=b"x"), None),)), "bad_request"),
        # Sampling a lane could not serve is refused here, whatever front built the request.
        (dict(sampling=SamplingParams(temperature=0.7, top_p=0.0)), "bad_request"),
        (dict(sampling=SamplingParams(temperature=float("nan"))), "bad_request"),
        (dict(sampling=SamplingParams(temperature=float("inf"))), "bad_request"),
        (dict(sampling=SamplingParams(repetition_penalty=0.0)), "bad_request"),
        (dict(sampling=SamplingParams(min_p=1.5)), "bad_request"),
        (dict(sampling=SamplingParams(seed=2**64)), "bad_request"),
    ],
)
def test_bad_requests_raise_request_error_with_their_code(request_kw, code):
    engine, _ = make()
    kw = dict(stream_id=1, tokens=(1, 2, 3, 4, 5), max_tokens=3) | request_kw
    with pytest.raises(RequestError) as err:
        engine.submit(StreamRequest(**kw))
    assert err.value.code == code
    assert engine.idle


def test_a_prompt_of_max_context_minus_one_is_accepted():
    engine, _ = make()
    engine.submit(req(1, [7] * 63, max_tokens=5))
    events = run_until_idle(engine)
    assert len(tokens_by_stream(events)[1]) == 1


def test_a_stream_id_in_use_is_refused():
    engine, _ = make()
    engine.submit(req(1, [1, 2]))
    with pytest.raises(ValueError):
        engine.submit(req(1, [1, 2]))
    run_until_idle(engine)


PROMPTS = {
    1: list(range(3, 20)),
    2: [5, 6, 7],
    3: list(range(40, 49)),
    4: [9] * 13,
    5: list(range(600, 602)),
    6: list(range(70, 96)),
}


def _requests():
    for sid, prompt in PROMPTS.items():
        sampling = SamplingParams() if sid % 2 else SamplingParams(temperature=0.8, seed=sid)
        yield req(sid, prompt, max_tokens=3 + sid, sampling=sampling, want_logits=sid == 3)


def test_concurrent_equals_solo_token_ids():
    engine, device = make(num_lanes=4, budget=7)
    for r in _requests():
        engine.submit(r)
    together = tokens_by_stream(run_until_idle(engine))
    assert max(len(p.lanes) for p in device.plans) == 4
    for r in _requests():
        solo, _ = make(num_lanes=1, budget=64)
        solo.submit(r)
        assert tokens_by_stream(run_until_idle(solo))[r.stream_id] == together[r.stream_id]
    assert together[1] == reference_tokens(PROMPTS[1], 4)


def test_want_logits_returns_the_rows_tokens_were_sampled_from():
    engine, device = make()
    engine.submit(req(1, range(6), max_tokens=3, want_logits=True))
    engine.submit(req(2, range(6), max_tokens=3))
    events = run_until_idle(engine)
    digests = [ev.logits_sha256 for ev in events if isinstance(ev, TokenEvent) and ev.stream_id == 1]
    assert [int(d[0], 16) % 1000 for d in digests] == reference_tokens(range(6), 3)
    assert all(ev.logits_sha256 is None for ev in events if isinstance(ev, TokenEvent) and ev.stream_id == 2)
    assert all(len(p.lanes[0].digest_rows) == 1 for p in device.plans if p.lanes[0].lane == 0 and p.lanes[0].sample_rows)


def test_images_ride_with_the_chunks_they_overlap():
    engine, device = make(budget=16)
    image = ImageRows(ImageIdentity(at=3, tokens=3, gh=1, gw=3, hash=b"img"), rows="rows")
    engine.submit(req(1, range(10), max_tokens=1, images=(image,)))
    run_until_idle(engine)
    assert [w.images for w in device.plans[0].lanes] == [(image,)]
    assert [(w.start, w.images) for p in device.plans[1:] for w in p.lanes] == [(4, (image,)), (8, ())]


class Recorder(NullObserver):
    def __init__(self):
        self.calls = []

    def on_admit(self, wait_s):
        self.calls.append("admit")

    def on_first_token(self, ttft_s, cache):
        self.calls.append(("first", cache))

    def on_token_gap(self, itl_s):
        self.calls.append("gap")

    def on_done(self, finish_reason, prompt_tokens, completion_tokens):
        self.calls.append(("done", finish_reason, prompt_tokens, completion_tokens))

    def on_lookup(self, result, query_tokens, hit_tokens):
        self.calls.append(("lookup", result, query_tokens, hit_tokens))


def test_observer_sees_admission_tokens_and_done():
    rec = Recorder()
    device = FakeDevice(make_info())
    engine = Engine(device, SchedulerConfig(num_lanes=1, grid=4), observer=rec, store_factory=lambda **kw: None)
    engines.ENGINES.append(engine)
    engine.submit(req(1, range(5), max_tokens=3))
    run_until_idle(engine)
    assert rec.calls == ["admit", ("lookup", "miss", 5, 0), ("first", "miss"), "gap", "gap", ("done", "length", 5, 3)]


def test_usage_says_off_when_the_cache_is_off():
    engine, _ = make(cache=False)
    engine.submit(req(1, range(5), max_tokens=2))
    done = done_by_stream(run_until_idle(engine))[1]
    assert (done.usage.cache, done.usage.cached_tokens, done.usage.prefilled_tokens) == ("off", 0, 5)
    assert done.usage.ttft_s >= 0 and done.usage.total_s >= done.usage.ttft_s


def test_when_no_lane_finds_a_page_the_newest_stream_ends_and_the_rest_go_on():
    device = FakeDevice(make_info(num_pages=4))
    engine = Engine(device, SchedulerConfig(num_lanes=2, grid=4, cache=False, decode_headroom_rows=0))
    engines.ENGINES.append(engine)
    engine.submit(req(1, range(4), max_tokens=10))
    engine.submit(req(2, range(50, 54), max_tokens=10))
    events = run_until_idle(engine)
    done = done_by_stream(events)
    assert (done[2].finish_reason, done[2].usage.completion_tokens, done[2].note) == (
        "length", 5, "stopped early: no KV pages left for another row")
    assert (done[1].finish_reason, tokens_by_stream(events)[1]) == ("length", reference_tokens(range(4), 10))
    assert [w.page_table for w in device.plans[5].lanes] == [(0, 2, 3)]


def test_a_prompt_larger_than_the_kv_pool_is_refused():
    engine, _ = make(num_pages=2)
    with pytest.raises(RequestError) as err:
        engine.submit(req(1, range(9)))
    assert err.value.code == "context_overflow"
    engine.submit(req(2, range(8), max_tokens=1))
    assert tokens_by_stream(run_until_idle(engine))[2] == reference_tokens(range(8), 1)


def test_abort_ends_every_stream_with_error_and_frees_lanes():
    engine, _ = make(num_lanes=1, cache=True)
    engine.submit(req(1, range(6), max_tokens=9))
    engine.submit(req(2, range(3), max_tokens=9))
    engine.step()
    events = engine.abort("device failed")
    assert [(ev.stream_id, ev.finish_reason, ev.note) for ev in events] == [
        (1, "error", "device failed"), (2, "error", "device failed")]
    assert engine.idle and engine.status()["pages_used"] == 0
    assert engine.status()["lanes"][0]["state"] == "free"


def test_a_chunk_start_at_zero_is_implied_and_dropped():
    engine, device = make(budget=16)
    engine.submit(req(1, range(10), max_tokens=1, chunk_starts=(0, 6)))
    run_until_idle(engine)
    assert [(w.start, len(w.tokens)) for p in device.plans for w in p.lanes] == [(0, 4), (4, 2), (6, 4)]
