"""Drafting in the engine over the fake device (microseconds): drafted equals undrafted in
token ids, greedy and sampled, over several lanes and with the store; verify rows are
planned, accepted prefixes kept, rejected rows' pages trimmed, counts reported."""

from __future__ import annotations

import pytest

from prefixd.scheduler.config import SchedulerConfig
from prefixd.scheduler.engine import Engine
from prefixd.scheduler.observer import NullObserver
from prefixd.scheduler.lanes import pages_for
from prefixd.scheduler.records import SamplingParams
from prefixd.scheduler.streams import DoneEvent, StreamRequest, TokenEvent
from tests.scheduler.fake_device import FakeDevice, make_info

VOCAB = 3  # a tiny vocabulary: drafts are often right by chance, so both outcomes occur


class DraftCounts(NullObserver):
    def __init__(self) -> None:
        self.drafts: list[tuple[int, int]] = []

    def on_draft(self, num_drafted: int, num_accepted: int) -> None:
        self.drafts.append((num_drafted, num_accepted))


def run(draft: str, sampling: SamplingParams, *, cache: bool = False, num_streams: int = 4):
    device = FakeDevice(make_info(vocab_size=VOCAB, num_pages=96, max_context=96))
    observer = DraftCounts()
    engine = Engine(device, SchedulerConfig(num_lanes=4, grid=8, cache=cache, draft=draft, draft_max=3),
                    observer=observer)
    for s in range(num_streams):
        prompt = tuple((s + i * i) % VOCAB for i in range(10 + s))
        engine.submit(StreamRequest(s, prompt, 30, sampling=sampling, draft=s != 3))
    ids: dict[int, list[int]] = {s: [] for s in range(num_streams)}
    usage = {}
    while not engine.idle:
        for ev in engine.step():
            if isinstance(ev, TokenEvent):
                ids[ev.stream_id] += ev.ids
            elif isinstance(ev, DoneEvent):
                usage[ev.stream_id] = ev.usage
        engine.check_integrity()
        for lane in engine.lanes:  # pages that held only rejected rows are gone
            if lane.busy and not lane.stream.prefilling:
                assert len(lane.pages) == pages_for(lane.num_rows, 4), lane
    return ids, usage, observer.drafts, device.plans, engine


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("cache", [False, True])
def test_drafted_equals_undrafted_token_ids(sampling, cache):
    off, off_usage, _, _, _ = run("off", sampling, cache=cache)
    on, on_usage, drafts, plans, _ = run("ngram", sampling, cache=cache)
    assert on == off
    assert all(len(v) == 30 for v in on.values())
    assert {n for n, _ in drafts} <= {1, 2, 3}
    assert any(a == n for n, a in drafts) and any(a < n for n, a in drafts)  # accepted and rejected
    assert sum(u.draft_tokens for u in on_usage.values()) == sum(n for n, _ in drafts)
    assert sum(u.accepted_tokens for u in on_usage.values()) == sum(a for _, a in drafts)
    assert on_usage[3].draft_tokens == 0  # the request said draft: off
    assert all(u.draft_tokens == 0 for u in off_usage.values())
    verifies = [w for p in plans for w in p.lanes if w.drafts]
    assert verifies and all(w.tokens[1:] == w.drafts and w.sample_rows == tuple(range(len(w.tokens)))
                            for w in verifies)


def test_status_reports_the_draft_mode_and_totals():
    _, usage, drafts, _, engine = run("ngram", SamplingParams())
    status = engine.status()["draft"]
    assert status == {"mode": "ngram", "max": 3, "drafted_tokens": sum(n for n, _ in drafts),
                      "accepted_tokens": sum(a for _, a in drafts)}


def test_drafts_never_run_past_max_tokens():
    ids, usage, _, plans, _ = run("ngram", SamplingParams())
    for p in plans:
        for w in p.lanes:
            assert w.start + len(w.tokens) <= 10 + 3 + 30  # the longest prompt plus max_tokens
    assert all(u.completion_tokens == 30 for u in usage.values())
