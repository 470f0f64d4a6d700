"""A failure that belongs to one lane ends that stream alone; the round's other lanes go on."""

from __future__ import annotations

from prefixd.scheduler.records import LaneWork
from tests.scheduler.engines import make_engine, req
from tests.scheduler.fake_device import done_by_stream, reference_tokens, run_until_idle, tokens_by_stream

PROMPTS = {sid: tuple(range(100 * sid, 100 * sid + 6)) for sid in range(1, 9)}
FAULTY = 5
MAX_TOKENS = 5


def make(**kw):
    return make_engine(num_lanes=8, grid=8, budget=64, cache=True, store=True, num_pages=96, **kw)


def faulty_prefill(work: LaneWork) -> str | None:
    return "injected fault" if work.prefill and PROMPTS[FAULTY][0] in work.tokens else None


def faulty_second_decode(work: LaneWork) -> str | None:
    """Fails the decode of the faulty stream's second token (it has emitted two by then)."""
    second = reference_tokens(PROMPTS[FAULTY], 2)[1]
    mine = not work.prefill and work.start == len(PROMPTS[FAULTY]) + 1 and work.tokens == (second,)
    return "injected fault" if mine else None


def run_eight(engine) -> list:
    for sid, prompt in PROMPTS.items():
        engine.submit(req(sid, prompt, max_tokens=MAX_TOKENS))
    return run_until_idle(engine)  # checks integrity after every round


def assert_others_solo(events) -> None:
    tokens, done = tokens_by_stream(events), done_by_stream(events)
    for sid, prompt in PROMPTS.items():
        if sid != FAULTY:
            assert tokens[sid] == reference_tokens(prompt, MAX_TOKENS)
            assert (done[sid].finish_reason, done[sid].note) == ("length", None)


def test_a_lane_failing_in_prefill_ends_its_stream_alone():
    engine, device = make()
    device.fault = faulty_prefill
    events = run_eight(engine)
    assert [len(p.lanes) for p in device.plans][:1] == [8]  # the fault is in an 8-lane round
    done = done_by_stream(events)
    assert done[FAULTY].finish_reason == "error"
    assert done[FAULTY].note == "this request failed in its lane round: injected fault"
    assert FAULTY not in tokens_by_stream(events)
    assert_others_solo(events)
    # the failed lane was freed, not kept resident; every page is the store's or a resident lane's
    states = {lane["lane"]: (lane["state"], lane["pages"]) for lane in engine.status()["lanes"]}
    assert list(states.values()).count(("free", 0)) == 1
    resident_pages = sum(pages for state, pages in states.values() if state == "resident")
    assert resident_pages == 7 * 3  # 6 prompt rows + 5 generated -> 11 rows -> 3 pages of 4
    assert engine.status()["pages_used"] == resident_pages  # the store shares lanes' pages


def test_failed_rows_reach_neither_the_store_nor_a_resident_lane():
    engine, device = make()
    device.fault = faulty_prefill
    run_eight(engine)
    device.fault = None
    engine.submit(req(99, PROMPTS[FAULTY], max_tokens=MAX_TOKENS))
    events = run_until_idle(engine)
    done = done_by_stream(events)[99]
    assert (done.finish_reason, done.usage.cached_tokens, done.usage.cache) == ("length", 0, "miss")
    assert tokens_by_stream(events)[99] == reference_tokens(PROMPTS[FAULTY], MAX_TOKENS)


def test_a_lane_failing_while_decoding_ends_after_its_good_tokens():
    engine, device = make()
    device.fault = faulty_second_decode
    events = run_eight(engine)
    done = done_by_stream(events)
    assert done[FAULTY].finish_reason == "error"
    assert tokens_by_stream(events)[FAULTY] == reference_tokens(PROMPTS[FAULTY], 2)
    assert_others_solo(events)
    engine.check_integrity()


def test_every_lane_failing_leaves_a_clean_engine():
    engine, device = make()
    device.fault = lambda work: "injected fault"
    events = run_eight(engine)
    assert {d.finish_reason for d in done_by_stream(events).values()} == {"error"}
    assert engine.status()["pages_used"] == 0
    device.fault = None
    engine.submit(req(50, PROMPTS[1], max_tokens=MAX_TOKENS))
    assert tokens_by_stream(run_until_idle(engine))[50] == reference_tokens(PROMPTS[1], MAX_TOKENS)
