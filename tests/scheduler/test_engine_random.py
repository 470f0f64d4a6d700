"""Random interleavings of submits and cancels, with the store unbounded, tight or off:
every stream that finishes yields exactly its cold tokens, and nothing leaks."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from prefixd.scheduler.config import SchedulerConfig
from prefixd.scheduler.engine import OUT_OF_PAGES_NOTE, Engine
from prefixd.scheduler.streams import DoneEvent, StreamRequest
from tests.scheduler.fake_device import FakeDevice, make_info, reference_tokens, run_until_idle, tokens_by_stream

BASES = [list(range(10, 30)), list(range(10, 22)) + [5] * 8, [7] * 9]

action = st.one_of(
    st.tuples(st.just("continue"), st.integers(0, 30), st.lists(st.integers(0, 99), min_size=1, max_size=6),
              st.integers(1, 6)),
    st.tuples(st.just("submit"), st.integers(0, 2), st.integers(1, 20), st.lists(st.integers(0, 99), max_size=6),
              st.integers(1, 6), st.booleans(), st.sampled_from([(), (3,), (5, 9)])),
    st.tuples(st.just("continue"), st.integers(1, 30), st.lists(st.integers(0, 99), min_size=1, max_size=6),
              st.integers(1, 6)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 3)),
)


def cold_tokens(req: StreamRequest, invariant: bool) -> list[int]:
    """What `req` yields alone with the cache off."""
    if invariant:
        return reference_tokens(req.tokens, req.max_tokens)
    engine = Engine(FakeDevice(make_info(invariant_rows=False)), SchedulerConfig(num_lanes=1, grid=4, cache=False))
    engine.submit(req)
    return tokens_by_stream(run_until_idle(engine)).get(req.stream_id, [])


@settings(max_examples=150, deadline=None)
@given(actions=st.lists(action, min_size=4, max_size=30), lanes=st.integers(1, 3), num_pages=st.sampled_from([10, 12, 24, 64]),
       budget=st.sampled_from([None, 10_100, 0]), row_budget=st.integers(1, 9), cache=st.sampled_from([True, True, False]),
       invariant=st.booleans())
def test_random_traffic_yields_cold_tokens_and_leaks_nothing(actions, lanes, num_pages, budget, row_budget, cache,
                                                            invariant):
    device = FakeDevice(make_info(num_lanes=3, num_pages=num_pages, invariant_rows=invariant))
    cfg = SchedulerConfig(num_lanes=lanes, grid=4, round_row_budget=row_budget, cache=cache,
                          cache_budget_bytes=budget, decode_headroom_rows=2)
    engine = Engine(device, cfg)
    prompts: dict[int, list[int]] = {}
    limits: dict[int, int] = {}
    requests: dict[int, StreamRequest] = {}
    got: dict[int, list[int]] = {}
    done: dict[int, DoneEvent] = {}

    def run(n):
        for _ in range(n):
            for ev in engine.step():
                if isinstance(ev, DoneEvent):
                    done[ev.stream_id] = ev
                else:
                    got.setdefault(ev.stream_id, []).extend(ev.ids)
            engine.check_integrity()

    sid = 0
    for act in actions:
        if act[0] == "submit":
            _, base, cut, extra, max_tokens, per_request_cache, starts = act
            sid += 1
            prompts[sid] = BASES[base][:cut] + extra
            limits[sid] = max_tokens
            starts = tuple(x for x in starts if x < len(prompts[sid]))
            requests[sid] = StreamRequest(sid, tuple(prompts[sid]), max_tokens, cache=per_request_cache,
                                          chunk_starts=starts)
            engine.submit(requests[sid])
        elif act[0] == "continue" and requests:
            _, prev, extra, max_tokens = act  # the next turn of a conversation: prompt + full reply + more
            before = requests[list(requests)[prev % len(requests)]]
            sid += 1
            prompts[sid] = list(before.tokens) + cold_tokens(before, invariant) + extra
            limits[sid] = max_tokens
            if len(prompts[sid]) >= min(63, num_pages * 4):
                del prompts[sid], limits[sid]
                continue
            requests[sid] = StreamRequest(sid, tuple(prompts[sid]), max_tokens, chunk_starts=before.chunk_starts)
            engine.submit(requests[sid])
        elif act[0] == "cancel":
            engine.cancel(act[1])
        else:
            run(act[1])
    for _ in range(2000):
        if engine.idle:
            break
        run(1)
    assert engine.idle
    for ev in done.values():
        event(f"{ev.finish_reason} {ev.usage.cache}")
    for s, ev in done.items():
        tokens = got.get(s, [])
        assert tokens == cold_tokens(requests[s], invariant)[: len(tokens)]
        assert len(tokens) == ev.usage.completion_tokens
        if ev.finish_reason != "cancelled":
            ran_out = ev.note == OUT_OF_PAGES_NOTE  # a tiny pool may end the newest stream early
            assert ev.finish_reason == "length" and (len(tokens) == limits[s] or ran_out and len(tokens) < limits[s])
            assert ev.usage.cached_tokens + ev.usage.prefilled_tokens == len(prompts[s])
    assert set(done) == set(prompts)
