"""Decode rounds as fixed programs (prefixd/gpu/programs.py) give the eager round's bits.

Two runners over the same tiny model: one runs every round eagerly ("off"), the other runs
decode rounds through the bucket programs ("eager": the programs CUDA captures as graphs,
run here without capture). Every round's logits rows and every lane's K/V must be equal bit
for bit, at every bucket: lane counts that leave padding lanes, row counts that leave padding
rows (verify rows of 2 to 8), and positions that move every round.
"""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu.programs import BUCKET_ROWS, bucket_contexts, bucket_of
from prefixd.scheduler.records import LaneWork, RoundPlan
from tests.gpu.runner_helpers import (DEVICE, kv_equal, lane_pages, make_runner, prompt,
                                      run_program_refusing_host_reads, work)

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module", params=DTYPES, ids=lambda d: str(d)[6:])
def runners(request, tiny_llama_dir):
    dtype = request.param
    # 32 lanes of 20 pages (lane_pages), then 140 pages for a long lane
    return (make_runner(tiny_llama_dir, dtype, num_lanes=32, num_pages=800, programs="off"),
            make_runner(tiny_llama_dir, dtype, num_lanes=32, num_pages=800,
                        programs="eager" if DEVICE.type == "cpu" else "auto"))


def _both(runners, plan: RoundPlan):
    eager, programs = runners
    return eager.run_round(plan), programs.run_round(plan)


def _prefill(runners, lanes: dict[int, tuple[int, ...]]) -> None:
    plan = RoundPlan(tuple(work(lane, 0, toks, lane_pages(lane)) for lane, toks in lanes.items()))
    _both(runners, plan)


def _same(a, b, what: str) -> None:
    for x, y in zip(a.lanes, b.lanes):
        assert x.lane == y.lane and x.error is None and y.error is None, what
        assert torch.equal(x.logits, y.logits), f"{what}: lane {x.lane}'s logits differ"


def test_buckets_are_the_smallest_that_hold_the_round():
    assert bucket_of([1], [10]) == (1, 1, 2048)
    assert bucket_of([1, 1, 1], [10, 3000, 20]) == (4, 1, 8192)
    assert bucket_of([1, 3, 1], [5, 5, 5]) == (4, 4, 2048)
    assert bucket_of([8] * 9, [100] * 9) == (16, 8, 2048)
    assert bucket_of([9], [9]) is None  # a prefill chunk: the eager round
    assert bucket_of([1] * 33, [1] * 33) is None
    assert bucket_of([1], [40000]) is None
    assert bucket_of([], []) is None
    assert bucket_contexts(4096) == (2048, 4096)
    assert bucket_contexts(2048) == (2048,)


def test_programs_run_decode_rounds_and_leave_prefill_to_the_eager_round(runners):
    _, programs = runners
    assert programs.programs is not None
    assert programs.programs.pick((LaneWork(0, 0, (1,) * 9, lane_pages(0), True),)) is None
    assert programs.programs.pick((LaneWork(0, 0, (1,), lane_pages(0), False),)) is not None


@pytest.mark.parametrize("lanes", [1, 2, 3, 8, 13, 32])
def test_decode_rounds_equal_the_eager_round_at_every_bucket(runners, lanes):
    """Each round's lanes bring 1..8 rows (every rows bucket, padding rows in most), at
    positions that move each round; every lanes bucket, 3 and 13 with padding lanes."""
    ctx = {lane: prompt(40 + 7 * lane, seed=50 + lane) for lane in range(lanes)}
    _prefill(runners, ctx)
    at = {lane: len(toks) for lane, toks in ctx.items()}
    for step, rows in enumerate([1, 2, 3, 5, 8, 1]):
        plan = []
        for lane in range(lanes):
            n = max(1, rows - lane % 2)  # lanes of a round differ in rows: padding rows
            toks = prompt(n, seed=1000 * step + lane)
            plan.append(work(lane, at[lane], toks, lane_pages(lane), prefill=False))
            at[lane] += n
        a, b = _both(runners, RoundPlan(tuple(plan)))
        _same(a, b, f"step {step} ({rows} rows a lane)")
    eager, programs = runners
    for lane in range(lanes):
        assert kv_equal(eager, lane_pages(lane), programs, lane_pages(lane), at[lane]), f"lane {lane}'s K/V differ"


def test_a_program_reads_each_rounds_positions(runners):
    """The same bucket twice in a row at other positions and pages: stale inputs (a position,
    slot or page table kept from the round before) would change the second round's bits."""
    ctx = {lane: prompt(20 + lane, seed=70 + lane) for lane in (2, 3)}
    _prefill(runners, ctx)
    for lane, n in ((2, 20 + 2), (3, 20 + 3)):
        toks = prompt(1, seed=90 + lane)
        a, b = _both(runners, RoundPlan((work(lane, n, toks, lane_pages(lane), prefill=False),)))
        _same(a, b, f"lane {lane}")
    assert max(BUCKET_ROWS) == 8


def test_verify_rows_through_a_program_equal_the_eager_verify(runners):
    """A drafting lane's verify rows (sampled up to the first rejected draft) beside a plain
    decode lane: the same tokens and the same K/V."""
    eager, programs = runners
    from prefixd.scheduler.records import SamplerSetup, SamplingParams

    ctx = {4: prompt(30, seed=81), 5: prompt(31, seed=82)}
    _prefill(runners, ctx)
    setup = tuple(SamplerSetup(lane, SamplingParams(), toks) for lane, toks in ctx.items())
    drafts = prompt(3, seed=83)
    plan = RoundPlan((LaneWork(4, 30, (ctx[4][-1], *drafts), lane_pages(4), False, sample_rows=(0, 1, 2, 3),
                               drafts=drafts, digest_rows=(0, 1, 2, 3)),
                      LaneWork(5, 31, (ctx[5][-1],), lane_pages(5), False, sample_rows=(0,), digest_rows=(0,))),
                     samplers=setup)
    a, b = _both(runners, plan)
    for x, y in zip(a.lanes, b.lanes):
        assert x.sampled == y.sampled and x.digests == y.digests


def test_a_long_lane_takes_the_longer_context_bucket(runners):
    """A lane past the first context bucket (2048 keys) decodes beside a short one: the round
    runs in the next bucket, every lane's keys read up to it, the same bits."""
    eager, programs = runners
    long, short = prompt(2100, seed=61), prompt(12, seed=62)
    table = tuple(range(640, 780))  # 2240 rows
    _both(runners, RoundPlan((work(6, 0, long, table), work(7, 0, short, lane_pages(7)))))
    plan = RoundPlan((work(6, 2100, prompt(2, seed=63), table, prefill=False),
                      work(7, 12, prompt(1, seed=64), lane_pages(7), prefill=False)))
    assert programs.programs.pick(plan.lanes).context > 2048
    a, b = _both(runners, plan)
    _same(a, b, "long beside short")


def test_a_row_past_max_context_is_refused(runners):
    _, programs = runners
    end = programs.info.max_context
    plan = RoundPlan((work(0, end, prompt(1, seed=65), tuple(range(end // 16 + 1)), prefill=False),))
    with pytest.raises(ValueError, match="past the model's max_context"):
        programs.run_round(plan)


def test_a_program_reads_no_device_value_on_the_host(runners, monkeypatch):
    """What a CUDA graph cannot capture: the program must not read a tensor's value into
    Python (a device sync) anywhere in its mask, forward and logits."""
    _, programs = runners
    ctx = {8: prompt(25, seed=66), 9: prompt(300, seed=67)}
    _prefill(runners, ctx)
    plan = RoundPlan((work(8, 25, prompt(3, seed=68), lane_pages(8), prefill=False),
                      work(9, 300, prompt(1, seed=69), lane_pages(9), prefill=False)))
    run_program_refusing_host_reads(programs, plan.lanes, monkeypatch)
