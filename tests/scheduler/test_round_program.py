"""The round is the only device call: what the engine puts in each round's plan, in what
order the fake runs it, and that any other device call fails."""

from __future__ import annotations

import pytest

from prefixd.scheduler.records import Capture, CapturedState, PageCopy, Restore, RoundResult, SamplingParams
from tests.scheduler.engines import make_engine, req, turn
from tests.scheduler.fake_device import FakeDevice, FakeState, SideCallError, _h, make_info

SYSTEM = list(range(10, 20))


def make(**info_kw):
    return make_engine(num_lanes=1, grid=4, budget=16, cache=True, store=True, **info_kw)


@pytest.mark.parametrize("call", [
    lambda d: d.start_stream(0, SamplingParams(), ()),
    lambda d: d.sample(0, None),
    lambda d: d.capture(0),
    lambda d: d.restore(0, FakeState(1, 8)),
    lambda d: d.reset_lane(0),
    lambda d: d.copy_pages([0], [1]),
])
def test_the_fake_device_refuses_every_call_but_the_round(call):
    with pytest.raises(SideCallError, match="outside run_round"):
        call(FakeDevice(make_info()))


def test_a_cold_seating_resets_and_sets_up_its_sampler_in_its_first_round():
    engine, device = make()
    turn(engine, req(1, SYSTEM, sampling=SamplingParams(temperature=0.5, seed=3)))
    first = device.plans[0]
    assert first.resets == (0,) and first.restores == () and first.page_copies == ()
    assert [(s.lane, s.sampling.seed, s.history) for s in first.samplers] == [(0, 3, tuple(SYSTEM))]
    assert [(w.start, w.tokens) for w in first.lanes] == [(0, tuple(SYSTEM[:4]))]
    assert all(p.resets == () and p.samplers == () for p in device.plans[1:])


def recorded(device: FakeDevice) -> list[RoundResult]:
    """Every result the device answers from now on."""
    results: list[RoundResult] = []
    run_round = device.run_round

    def record(plan):
        results.append(run_round(plan))
        return results[-1]

    device.run_round = record
    return results


def chunk_state(*chunks) -> int:
    """The fake non-invariant state after prefilling `chunks` from zero."""
    state = 0
    for chunk in chunks:
        state = _h(state, "chunk", tuple(chunk))
    return state


def test_captures_come_after_the_forward_of_the_chunk_ending_at_the_cut():
    engine, device = make(invariant_rows=False)
    results = recorded(device)
    turn(engine, req(1, SYSTEM))  # chunks [0,4) [4,8) [8,10), each ending at a cut
    assert [p.captures for p in device.plans[:3]] == [(Capture(0, 4),), (Capture(0, 8),), (Capture(0, 10),)]
    chunks = (SYSTEM[:4], SYSTEM[4:8], SYSTEM[8:])
    assert [r.captured for r in results[:3]] == [
        (CapturedState(0, cut, FakeState(chunk_state(*chunks[:i + 1]), 256)),)
        for i, cut in enumerate((4, 8, 10))
    ]
    assert all(p.captures == () for p in device.plans[3:])  # decode rows end at no cut


def test_a_hit_restores_copies_the_borrowed_tail_and_prefills_in_one_round():
    engine, device = make(invariant_rows=False, page_size=8)
    turn(engine, req(1, SYSTEM))  # keeps cuts 4, 8 and 10; cut 4 ends inside page 0
    turn(engine, req(2, list(range(500, 510))))  # takes the lane
    num_plans = len(device.plans)
    prompt = SYSTEM[:4] + [7, 7, 7, 7]
    tokens, done = turn(engine, req(3, prompt))
    assert (done.usage.cache, done.usage.cached_tokens) == ("hit", 4)
    seated = device.plans[num_plans]
    store_page = seated.page_copies[0].src
    assert seated.page_copies == (PageCopy(store_page, engine.lanes[0].pages[0]),)
    assert seated.restores == (Restore(0, FakeState(chunk_state(SYSTEM[:4]), 256)),) and seated.resets == ()
    assert [(s.lane, s.history) for s in seated.samplers] == [(0, tuple(prompt))]
    assert [(w.start, w.tokens, w.page_table) for w in seated.lanes] == [(4, (7, 7, 7, 7), (engine.lanes[0].pages[0],))]
    assert seated.captures == (Capture(0, 8),)
    cold_engine, _ = make_engine(num_lanes=1, grid=4, budget=16, cache=False, store=False, invariant_rows=False,
                                 page_size=8)
    assert tokens == turn(cold_engine, req(3, prompt))[0]


@pytest.mark.parametrize("invariant", [True, False])
def test_a_resident_continuation_restores_only_a_non_invariant_lanes_cut_state(invariant):
    engine, device = make(invariant_rows=invariant)
    first, _ = turn(engine, req(1, SYSTEM, max_tokens=2, chunk_starts=(8,)))
    num_plans = len(device.plans)
    prompt = SYSTEM + first + [7, 7]
    tokens, done = turn(engine, req(2, prompt, chunk_starts=(8, 12)))
    seated = device.plans[num_plans]
    assert done.usage.cache == "resident" and seated.resets == () and seated.page_copies == ()
    if invariant:
        assert done.usage.cached_tokens == 11 and seated.restores == ()  # the prompt and the fed reply token
    else:  # back to the state at the prompt's last cut before its end (the chunk start at 8)
        state8 = chunk_state(SYSTEM[:4], SYSTEM[4:8])
        assert done.usage.cached_tokens == 8 and seated.restores == (Restore(0, FakeState(state8, 256)),)
    cold_engine, _ = make_engine(num_lanes=1, grid=4, budget=16, cache=False, store=False, invariant_rows=invariant)
    assert tokens == turn(cold_engine, req(2, prompt, chunk_starts=(8, 12)))[0]
