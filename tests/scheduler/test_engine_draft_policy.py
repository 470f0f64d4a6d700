"""The engine's draft policy over the fake device, whose round time (on the engine's clock) is set by its row count:
the engine learns that curve, and a lane whose drafts miss keeps drafting while extra rows
are free and stops (but for probes) when each row costs a round. Output never changes."""

from __future__ import annotations

from prefixd.scheduler.config import SchedulerConfig
from prefixd.scheduler.engine import Engine
from prefixd.scheduler.records import RoundPlan, RoundResult, SamplingParams
from prefixd.scheduler.streams import StreamRequest, TokenEvent
from tests.scheduler.fake_device import FakeDevice, make_info

VOCAB = 3  # drafts proposed all along, and accepted now and then by chance


class TimedDevice(FakeDevice):
    """A fake device whose round takes `round_s(rows)` seconds on its clock."""

    def __init__(self, round_s, **info) -> None:
        super().__init__(make_info(**info))
        self.round_s = round_s
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def run_round(self, plan: RoundPlan) -> RoundResult:
        self.now += self.round_s(plan.num_rows)
        return super().run_round(plan)


def run(draft: str, round_s) -> tuple[list[int], list[int], Engine]:
    device = TimedDevice(round_s, vocab_size=VOCAB, num_pages=64, max_context=160, num_lanes=1)
    engine = Engine(device, SchedulerConfig(num_lanes=1, grid=16, cache=False, draft=draft, draft_max=4),
                    clock=device.clock)
    prompt = tuple(i * i * 7 % 11 % VOCAB for i in range(40))
    engine.submit(StreamRequest(0, prompt, 80, sampling=SamplingParams()))
    ids: list[int] = []
    while not engine.idle:
        for ev in engine.step():
            if isinstance(ev, TokenEvent):
                ids += ev.ids
    draft_lengths = [len(w.drafts) for p in device.plans for w in p.lanes if not w.prefill]
    return ids, draft_lengths, engine


def flat(rows: int) -> float:  # a padded kernel: up to 4 rows in the time of one
    return 1.0 if rows <= 4 else 1.0 + 0.25 * (rows - 4)


def steep(rows: int) -> float:  # each row costs a round of one
    return float(rows)


def test_missing_drafts_stop_when_rows_cost_and_go_on_while_rows_are_free():
    plain, _, _ = run("off", steep)
    steep_ids, steep_lengths, engine = run("ngram", steep)
    flat_ids, flat_lengths, _ = run("ngram", flat)
    assert steep_ids == flat_ids == plain
    # steep: nothing drafts before a round is measured; one round drafts while the cost of a
    # row is still a guess, and teaches it; after that a draft never pays, so only the
    # one-token probes run, one per 16 rounds sat out
    assert steep_lengths[0] == 0 and steep_lengths[1] > 1
    assert set(steep_lengths[2:]) == {0, 1}
    assert [i for i, k in enumerate(steep_lengths) if k][1:] == [17, 33, 49, 65]
    # flat: rows up to the padding cost nothing, so the lane drafts nearly every round
    assert sum(1 for k in flat_lengths if k >= 2) > 0.8 * len(flat_lengths)
    assert engine.draft_costs.round_s(1) == 1.0 and engine.draft_costs.round_s(2) == 2.0
