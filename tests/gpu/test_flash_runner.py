"""The runner with attention through flash.py's kernel, as on CUDA, on any machine.

On a machine without CUDA, Triton's interpreter runs the kernel on the CPU (tests/conftest.py)
and `flash.ON_CPU` plans the CPU runner's attention for it, so the CUDA path's plans, indices,
tiles and program inputs run end to end here: chunked prefill equals one shot, a lane alone
equals it beside seven, a verify pass equals stepwise decode, and decode programs (buckets
with padding lanes and rows) equal the eager round, bit for bit. On CUDA the same checks run
in test_invariance.py and test_programs.py, whose runners use the kernel there.
"""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu import flash
from prefixd.scheduler.records import RoundPlan
from tests.gpu.runner_helpers import kv_equal, lane_pages, make_runner, prompt, work
from tests.gpu.test_invariance import check_chunking, check_lane_beside_others, check_verify_equals_decode

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA test_invariance and test_programs run the kernel"),
    pytest.mark.skipif(not flash.kernels.triton_available() or not flash.INTERPRETING,
                       reason="needs Triton, interpreting (TRITON_INTERPRET=1)"),
]
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _flash_on_cpu():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash, "ON_CPU", True)
        yield


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
def runner(request, tiny_llama_dir):
    return make_runner(tiny_llama_dir, request.param, device=CPU, programs="off")


def test_flash_runner_plans_tiles_for_the_kernel(runner):
    inputs = runner._inputs(RoundPlan((work(0, 0, prompt(40), lane_pages(0)),
                                       work(1, 5, prompt(1), lane_pages(1), prefill=False))))
    assert inputs.tiles and all(t.masked is None and t.qpos is not None for t in inputs.tiles)


def test_flash_chunked_prefill_equals_one_shot(runner):
    check_chunking(runner, 300, fives=False)


def test_flash_lane_alone_equals_beside_seven_lanes(runner):
    check_lane_beside_others(runner, 290)


def test_flash_verify_pass_equals_stepwise_decode(runner):
    check_verify_equals_decode(runner, 254)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
def test_flash_decode_programs_equal_the_eager_round(tiny_llama_dir, dtype):
    """Buckets of 4 lanes (3 real: a padding lane) with 1..5 rows a lane (padding rows)."""
    eager = make_runner(tiny_llama_dir, dtype, device=CPU, programs="off")
    programs = make_runner(tiny_llama_dir, dtype, device=CPU, programs="eager")
    lanes = {lane: prompt(40 + 70 * lane, seed=50 + lane) for lane in range(3)}
    plan = RoundPlan(tuple(work(lane, 0, toks, lane_pages(lane)) for lane, toks in lanes.items()))
    eager.run_round(plan), programs.run_round(plan)
    at = {lane: len(toks) for lane, toks in lanes.items()}
    for step, rows in enumerate([1, 2, 5, 1]):
        plan = []
        for lane in lanes:
            n = max(1, rows - lane % 2)
            plan.append(work(lane, at[lane], prompt(n, seed=1000 * step + lane), lane_pages(lane), prefill=False))
            at[lane] += n
        a, b = eager.run_round(RoundPlan(tuple(plan))), programs.run_round(RoundPlan(tuple(plan)))
        assert programs.programs.pick(RoundPlan(tuple(plan)).lanes) is not None, "no program ran the round"
        for x, y in zip(a.lanes, b.lanes):
            assert torch.equal(x.logits, y.logits), f"step {step}: lane {x.lane}'s logits differ"
    for lane in lanes:
        assert kv_equal(eager, lane_pages(lane), programs, lane_pages(lane), at[lane]), f"lane {lane}'s K/V differ"
