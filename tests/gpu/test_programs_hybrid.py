"""Decode programs for the hybrid family (qwen3_5): rounds of one decode row per lane run as
fixed programs (the batched recurrent step, padding rows stepping a scratch lane state) and
give the op-by-op round's bits: logits rows, K/V of the full-attention layers and every
lane's recurrent and conv state. Verify rows and prefill chunks stay op by op.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixd.scheduler.records import LaneWork, RoundPlan, SamplerSetup, SamplingParams
from tests.gpu.runner_helpers import (DEVICE, capture, kv_equal, make_runner, prompt,
                                      run_program_refusing_host_reads, work)
from tests.helpers.tiny_models import make_tiny_hybrid_hf_dir

LANES = 8


def lane_pages(lane: int) -> tuple[int, ...]:
    return tuple(range(lane * 12, lane * 12 + 12))  # 192 rows a lane


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_hybrid_hf_dir(tmp_path_factory.mktemp("programs_qwen3_5"), seed=5, vocab_size=49152,
                                initializer_range=0.1)
    return path


@pytest.fixture(scope="module")
def runners(hybrid_dir):
    return (make_runner(hybrid_dir, torch.float32, num_lanes=LANES, num_pages=LANES * 12, programs="off"),
            make_runner(hybrid_dir, torch.float32, num_lanes=LANES, num_pages=LANES * 12,
                        programs="eager" if DEVICE.type == "cpu" else "auto"))


def _both(runners, plan: RoundPlan):
    eager, programs = runners
    return eager.run_round(plan), programs.run_round(plan)


def _same_round(a, b, what: str) -> None:
    for x, y in zip(a.lanes, b.lanes):
        assert x.lane == y.lane and x.error is None and y.error is None, what
        assert x.sampled == y.sampled, what
        assert torch.equal(x.logits, y.logits), f"{what}: lane {x.lane}'s logits differ"


def _same_state(runners, lanes, what: str) -> None:
    eager, programs = runners
    for lane in lanes:
        assert torch.equal(capture(eager, lane).data, capture(programs, lane).data), f"{what}: lane {lane}'s state"


def test_the_hybrid_runs_only_single_decode_rows_as_programs(runners):
    _, programs = runners
    assert programs.programs is not None and programs.programs.rows == (1,)
    pick = programs.programs.pick
    assert pick((LaneWork(0, 5, (1,), lane_pages(0), False),)) is not None
    assert pick((LaneWork(0, 5, (1,), lane_pages(0), True),)) is None  # a one-row prefill chunk: chunked form
    assert pick((LaneWork(0, 5, (1, 2), lane_pages(0), False),)) is None  # verify rows: rollback records


@pytest.mark.parametrize("lanes", [1, 3, 8])
def test_decode_rounds_equal_the_op_by_op_round_with_the_same_lane_states(runners, lanes):
    """3 lanes run in the 4-lane bucket (a padding lane steps the scratch state): logits, K/V
    and every lane's state equal the op-by-op runner's after each round."""
    eager, programs = runners
    ctx = {lane: prompt(20 + 5 * lane, seed=300 + lane) for lane in range(lanes)}
    setup = tuple(SamplerSetup(lane, SamplingParams(), toks) for lane, toks in ctx.items())
    _both(runners, RoundPlan(tuple(work(lane, 0, toks, lane_pages(lane)) for lane, toks in ctx.items()),
                             resets=tuple(ctx), samplers=setup))
    at = {lane: len(toks) for lane, toks in ctx.items()}
    for step in range(4):
        plan = RoundPlan(tuple(LaneWork(lane, at[lane], prompt(1, seed=400 + 10 * step + lane), lane_pages(lane),
                                        False, sample_rows=(0,), logits_rows=(0,)) for lane in ctx))
        assert programs.programs.pick(plan.lanes) is not None
        a, b = _both(runners, plan)
        _same_round(a, b, f"step {step}")
        for lane in ctx:
            at[lane] += 1
    _same_state(runners, ctx, "after the decode rounds")
    for lane in ctx:
        assert kv_equal(eager, lane_pages(lane), programs, lane_pages(lane), at[lane]), f"lane {lane}'s K/V"


def test_a_verify_then_program_rounds_keep_the_rollback_exact(runners):
    """A verify (op by op, rolled back to its accepted rows) beside a program-sized lane, then
    program rounds on both: the same tokens and states as the op-by-op runner throughout."""
    ctx = {6: prompt(33, seed=501), 7: prompt(29, seed=502)}
    setup = tuple(SamplerSetup(lane, SamplingParams(), toks) for lane, toks in ctx.items())
    _both(runners, RoundPlan(tuple(work(lane, 0, toks, lane_pages(lane)) for lane, toks in ctx.items()),
                             resets=tuple(ctx), samplers=setup))
    drafts = prompt(3, seed=503)
    plan = RoundPlan((LaneWork(6, 33, (ctx[6][-1], *drafts), lane_pages(6), False, sample_rows=(0, 1, 2, 3),
                               drafts=drafts, digest_rows=(0, 1, 2, 3)),
                      LaneWork(7, 29, (ctx[7][-1],), lane_pages(7), False, sample_rows=(0,), digest_rows=(0,))))
    a, b = _both(runners, plan)
    for x, y in zip(a.lanes, b.lanes):
        assert x.sampled == y.sampled and x.digests == y.digests
    kept = len(a.lanes[0].sampled)  # rows the verify kept
    at = {6: 33 + kept, 7: 30}
    _same_state(runners, ctx, "after the verify")
    for step in range(3):
        plan = RoundPlan(tuple(LaneWork(lane, at[lane], prompt(1, seed=600 + 10 * step + lane), lane_pages(lane),
                                        False, sample_rows=(0,), logits_rows=(0,)) for lane in ctx))
        a, b = _both(runners, plan)
        _same_round(a, b, f"after the verify, step {step}")
        at = {lane: n + 1 for lane, n in at.items()}
    _same_state(runners, ctx, "after the program rounds")


def test_a_program_round_drops_its_lanes_stale_rollback_records(runners):
    """A verify whose drafts were all kept leaves its rollback record; a newer single row makes
    it stale, in a program round as in an op-by-op one."""
    _, programs = runners
    states = programs.model.states
    states.begin_trail(3, 2)  # as a fully accepted 2-row verify leaves it
    states.begin_trail(4, 2)
    programs.run_round(RoundPlan((LaneWork(3, 50, prompt(1, seed=800), lane_pages(3), False),)))
    assert states.trail_rows(3) == 0 and states.trail_rows(4) == 2  # only the round's lane
    states.drop_trail(4)


def test_a_hybrid_program_reads_no_device_value_on_the_host(runners, monkeypatch):
    """What a CUDA graph cannot capture: no tensor value read into Python in the program."""
    _, programs = runners
    lanes = tuple(LaneWork(lane, 40, prompt(1, seed=700 + lane), lane_pages(lane), False) for lane in (0, 1, 2))
    run_program_refusing_host_reads(programs, lanes, monkeypatch)
