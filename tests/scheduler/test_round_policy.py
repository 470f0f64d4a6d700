"""The round policy on the fake device: least served client first, short rounds while short
work waits, big chunks for a lone prefill, and the schedule's chunks untouched. Counted in
rounds and rows, never in time."""

from __future__ import annotations

import pytest

from prefixd.scheduler.config import SchedulerConfig
from prefixd.scheduler.engine import Engine
from prefixd.scheduler.fairness import BUSY_LINGER_ROUNDS, ClientShares
from prefixd.scheduler.chunks import plan_schedule
from prefixd.scheduler.streams import DoneEvent, StreamRequest, TokenEvent
from tests.scheduler import engines
from tests.scheduler.fake_device import FakeDevice, make_info, reference_tokens, run_until_idle, tokens_by_stream

GRID = 64
BUDGET = 256
BUSY = 16
SHORT = 8


def make(*, invariant=True, cache=False, num_lanes=8, busy=BUSY, short=SHORT) -> tuple[Engine, FakeDevice]:
    device = FakeDevice(make_info(num_lanes=8, num_pages=2048, max_context=1024, invariant_rows=invariant))
    cfg = SchedulerConfig(num_lanes=num_lanes, grid=GRID, round_row_budget=BUDGET, busy_prefill_rows=busy,
                          short_prefill_rows=short, cache=cache)
    engine = Engine(device, cfg, **({} if cache else {"store_factory": lambda **_: None}))
    engines.ENGINES.append(engine)
    return engine, device


def req(sid, tokens, max_tokens, client, **kw) -> StreamRequest:
    return StreamRequest(stream_id=sid, tokens=tuple(tokens), max_tokens=max_tokens, client=client, **kw)


def long_prompt(sid: int) -> list[int]:
    return [(sid * 31 + i) % 997 for i in range(200)]


def work_of(plan, lanes):
    return [(len(w.tokens), w.prefill) for w in plan.lanes if w.lane in lanes]


def test_a_short_request_beside_six_clients_long_prefills_gets_its_token_in_its_first_round():
    engine, device = make()
    for c in range(6):
        engine.submit(req(c, long_prompt(c), 1, f"flood-{c}"))
    engine.step()  # the flood is seated and prefilling
    engine.submit(req(100, [5, 6, 7, 8], 4, "honest"))
    events = engine.step()
    assert [ev.stream_id for ev in events if isinstance(ev, TokenEvent)] == [100]
    honest = next(w for w in device.plans[-1].lanes if w.tokens == (5, 6, 7, 8))
    assert (honest.start, honest.sample_rows) == (0, (3,))
    assert device.plans[-1].lanes == (honest,)  # its first token's round holds the long prefills back
    events += engine.step()
    long_rows = sum(len(w.tokens) for w in device.plans[-1].lanes if w.prefill)
    assert long_rows == BUSY  # while it decodes, the others' prefills share the busy bound
    assert tokens_by_stream(events + run_until_idle(engine))[100] == reference_tokens([5, 6, 7, 8], 4)


def test_a_full_hit_gets_its_first_token_in_a_round_without_long_prefills():
    engine, device = make(cache=True)
    engine.submit(req(1, [5, 6, 7, 8], 2, "honest"))
    first = run_until_idle(engine)
    for c in range(3):
        engine.submit(req(10 + c, long_prompt(c), 1, f"flood-{c}"))
    engine.step()
    engine.submit(req(2, [5, 6, 7, 8], 2, "honest"))  # every row cached, with its logits row
    events = engine.step()
    assert [ev.stream_id for ev in events if isinstance(ev, TokenEvent)] == [2]
    assert len(device.plans[-1].stored) == 1 and device.plans[-1].lanes == ()
    events += engine.step()
    assert sum(len(w.tokens) for w in device.plans[-1].lanes if w.prefill) == BUSY
    assert tokens_by_stream(events + run_until_idle(engine))[2] == tokens_by_stream(first)[1]


def test_short_requests_every_round_hold_long_prefills_back_at_most_every_other_round():
    engine, device = make()
    engine.submit(req(1, long_prompt(1), 1, "flood"))
    engine.step()  # seated on lane 0
    held = []
    for i, sid in enumerate(range(100, 140)):
        engine.submit(req(sid, [sid, 2, 3], 1, f"short-{sid}"))  # a first token in every round
        events = engine.step()
        if not any(w.lane == 0 for w in device.plans[-1].lanes):
            held.append(i)
        if any(isinstance(ev, DoneEvent) and ev.stream_id == 1 for ev in events):
            break
    else:
        raise AssertionError("the long prefill never finished beside short requests")
    assert held and all(b - a > 1 for a, b in zip(held, held[1:])), held


def test_an_honest_client_beside_a_flood_waits_a_bounded_number_of_rounds_and_gets_its_share():
    """Six clients resubmit a 200-row prompt whenever theirs is done; one client sends a 4-row
    prompt (4 tokens) whenever its last one is done. Every honest request has its first token
    in the round after it is submitted; the rounds that carry honest work give long prefills at
    most the busy bound; the honest client gets at least 1/7 of the requests served."""
    engine, device = make()
    next_id = iter(range(1000, 100_000))
    for c in range(6):
        engine.submit(req(next(next_id), long_prompt(c), 1, f"flood-{c}"))
    engine.step()
    owner, submitted_at, first_after = {}, {}, []
    honest_id = next(next_id)
    engine.submit(req(honest_id, [1, 2, 3, 4], 4, "honest"))
    submitted_at[honest_id] = 1
    done = {"honest": 0, "flood": 0}
    for rnd in range(1, 400):
        events = engine.step()
        honest_lanes = {w.lane for w in device.plans[-1].lanes if w.tokens[:1] == (1,) or not w.prefill}
        long_rows = sum(len(w.tokens) for w in device.plans[-1].lanes if w.prefill and w.lane not in honest_lanes)
        if honest_lanes:
            assert long_rows <= BUSY, (rnd, device.plans[-1])
        assert device.plans[-1].num_rows <= BUDGET
        for ev in events:
            if isinstance(ev, TokenEvent) and ev.stream_id in submitted_at:
                first_after.append(rnd + 1 - submitted_at.pop(ev.stream_id))
            if isinstance(ev, DoneEvent):
                client = owner.get(ev.stream_id, "honest" if ev.stream_id == honest_id else "flood")
                done[client] += 1
                sid = next(next_id)
                if client == "honest":
                    honest_id = sid
                    engine.submit(req(sid, [1, 2, 3, 4], 4, "honest"))
                    submitted_at[sid] = rnd + 1
                else:
                    engine.submit(req(sid, long_prompt(sid), 1, f"flood-{sid % 6}"))
    assert first_after and max(first_after) == 1
    assert done["honest"] * 7 >= done["honest"] + done["flood"], done


def test_a_lone_long_prefill_runs_whole_chunks():
    engine, device = make()
    engine.submit(req(1, long_prompt(1), 1, "a"))
    run_until_idle(engine)
    assert [(w.start, len(w.tokens)) for p in device.plans for w in p.lanes] == [(0, 64), (64, 64), (128, 64), (192, 8)]


def test_after_short_work_rounds_stay_busy_a_few_rounds_then_chunks_are_whole_again():
    engine, device = make()
    engine.submit(req(1, [1, 2, 3], 1, "a"))
    engine.step()  # a short prefill: a busy round
    engine.submit(req(2, long_prompt(2), 1, "b"))
    run_until_idle(engine)
    assert [len(w.tokens) for p in device.plans[1:] for w in p.lanes] == \
        [BUSY] * BUSY_LINGER_ROUNDS + [64 - BUSY * BUSY_LINGER_ROUNDS, 64, 64, 8]


def test_long_prefills_alone_fill_the_row_budget_and_never_pass_it():
    engine, device = make()
    for sid in range(6):
        engine.submit(req(sid, long_prompt(sid), 1, f"c{sid}"))
    events = run_until_idle(engine)
    rows = [p.num_rows for p in device.plans]
    assert max(rows) == BUDGET and sum(rows) == 6 * 200
    assert rows[:4] == [BUDGET] * 4
    assert all(len(w.tokens) <= GRID for p in device.plans for w in p.lanes)
    assert tokens_by_stream(events) == {sid: reference_tokens(long_prompt(sid), 1) for sid in range(6)}


def test_the_least_served_client_is_seated_first_and_each_client_keeps_fifo():
    engine, device = make(num_lanes=1)
    for sid in (1, 2, 3):
        engine.submit(req(sid, [sid] * 6, 2, "a"))
    engine.submit(req(4, [4] * 6, 2, "b"))
    engine.submit(req(5, [5] * 6, 2, "b"))
    events = run_until_idle(engine)
    seated = [history[0] for _, history in device.starts]
    assert seated == [1, 4, 2, 5, 3]  # a, then b served least, then in turn; FIFO within each
    assert [ev.stream_id for ev in events if isinstance(ev, DoneEvent)] == seated


def test_unknown_clients_are_one_client_served_fifo():
    engine, device = make(num_lanes=1)
    for sid in (1, 2, 3):
        engine.submit(req(sid, [sid] * 6, 2, ""))
    run_until_idle(engine)
    assert [history[0] for _, history in device.starts] == [1, 2, 3]


def test_the_least_served_client_gets_the_rounds_prefill_rows_first():
    engine, device = make()
    engine.submit(req(1, long_prompt(1), 1, "a"))
    engine.submit(req(2, long_prompt(2), 1, "a"))
    engine.submit(req(3, [9] * 4, 3, "c"))  # keeps the rounds busy while it decodes
    engine.step()  # c's first token: the long prefills are held back
    engine.step()  # a's first gets the busy rows
    engine.submit(req(4, long_prompt(4), 1, "b"))
    engine.step()
    longs = [(w.lane, len(w.tokens)) for w in device.plans[-1].lanes if w.prefill]
    assert longs == [(3, BUSY)]  # b (never served) before a's two, whose first came first


def test_a_short_prompt_with_chunk_starts_prefills_whole_in_its_first_round_and_keeps_its_cuts():
    engine, device = make(cache=True)
    prompt = list(range(300, 306))
    engine.submit(req(1, prompt, 2, "a", chunk_starts=(2, 4)))
    events = run_until_idle(engine)
    assert [(w.start, len(w.tokens), w.prefill) for w in device.plans[0].lanes] == [(0, 6, True)]
    assert [e.cut for e in engine.store.describe()] == [2, 4, 6]
    assert tokens_by_stream(events)[1] == reference_tokens(prompt, 2)
    first_turn = len(device.plans)
    engine.submit(req(2, prompt[:4] + [7, 7], 2, "a", chunk_starts=(2, 4)))
    events = run_until_idle(engine)
    assert [(w.start, len(w.tokens)) for w in device.plans[first_turn].lanes] == [(4, 2)]  # resumed at cut 4
    assert tokens_by_stream(events)[2] == reference_tokens(prompt[:4] + [7, 7], 2)


@pytest.mark.parametrize("invariant", [True, False])
def test_runs_keep_the_schedules_chunks_and_concurrent_equals_solo(invariant):
    """Beside decoding lanes and other clients' prompts, a family that is not row-invariant runs
    exactly its schedule's chunks; an invariant one runs rows of its schedule, whatever split;
    every stream's tokens are its solo run's."""
    prompts = {1: long_prompt(1), 2: [3, 1, 4], 3: long_prompt(3)[:150], 4: [2] * 40, 5: long_prompt(5)[:90]}
    starts = {1: (17, 130), 3: (60,), 4: (), 5: (9,), 2: ()}
    engine, device = make(invariant=invariant, cache=True)
    events = []
    for sid, prompt in prompts.items():
        engine.submit(req(sid, prompt, 3 + sid, f"c{sid % 3}", chunk_starts=starts[sid]))
        events += engine.step()
    together = tokens_by_stream(events + run_until_idle(engine))
    runs = {}  # stream i ran on lane i - 1 (free lanes are taken lowest first)
    for p in device.plans:
        for w in p.lanes:
            if w.prefill:
                runs.setdefault(w.lane + 1, []).append((w.start, w.start + len(w.tokens)))
    for sid, prompt in prompts.items():
        chunks = plan_schedule(len(prompt), starts[sid], GRID).chunks(0)
        ran = runs[sid]
        if not invariant:
            assert ran == chunks
        assert [a for a, _ in ran[1:]] == [b for _, b in ran[:-1]] and ran[-1][1] == len(prompt)
        solo, _ = make(invariant=invariant, num_lanes=1)
        solo.submit(req(sid, prompt, 3 + sid, "", chunk_starts=starts[sid]))
        assert tokens_by_stream(run_until_idle(solo))[sid] == together[sid]
    if invariant:  # some run ended inside a chunk or spanned chunks
        assert any(runs[s] != plan_schedule(len(prompts[s]), starts[s], GRID).chunks(0) for s in prompts)


def test_client_shares_decay_and_forget():
    shares = ClientShares(decay=0.5)
    shares.end_round({"a": 8, "b": 2})
    shares.end_round({"b": 2})
    assert (shares.served("a"), shares.served("b"), shares.served("c")) == (4.0, 3.0, 0.0)
    for _ in range(20):
        shares.end_round({})
    assert shares._served == {}


def test_after_short_work_the_engine_offers_one_pause_before_a_round_of_long_prefills_alone():
    engine, device = make()
    assert not engine.pause_before_long()  # idle
    engine.submit(req(1, long_prompt(1), 1, "flood"))
    engine.step()
    assert not engine.pause_before_long()  # long prefills only, and no short work ran

    def run_short(sid: int) -> None:
        engine.submit(req(sid, [sid, 2, 3], 3, "honest"))
        while sid in engine._streams:
            assert not engine.pause_before_long()  # the short request waits, prefills or decodes
            engine.step()

    run_short(2)
    run_short(3)  # the client's next request came before any pause was asked for
    assert engine.pause_before_long()  # its client may send the next one in a moment
    assert not engine.pause_before_long()  # once
    run_until_idle(engine)
    assert not engine.pause_before_long()
