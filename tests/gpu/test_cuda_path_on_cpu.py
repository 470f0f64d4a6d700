"""The runner on the CUDA path's Triton kernels (flash.py's attention, fused.py's norm, rope
and SiLU product), on any machine.

On a machine without CUDA, Triton's interpreter runs the kernels on the CPU
(tests/conftest.py) and `kernels.TRITON_ON_CPU` sends a CPU runner's forward through them, so
the CUDA path's plans, indices, tiles, fused forward and program inputs run end to end here:
chunked prefill equals one shot, a lane alone equals it beside seven, a verify pass equals
stepwise decode, and decode programs (buckets with padding lanes and rows) equal the eager
round, bit for bit; on tiny llama, qwen2 (qkv bias) and qwen3 (q/k norms), and the hybrid's
attention layers. On CUDA the same checks run in test_invariance.py, test_programs.py and
test_hybrid_exact.py, whose runners take this path there.
"""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu import flash, fused
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
        mp.setattr(flash.kernels, "TRITON_ON_CPU", True)
        yield


RUNNERS = [("tiny_llama_dir", torch.bfloat16), ("tiny_llama_dir", torch.float32),
           ("tiny_qwen2_dir", torch.bfloat16), ("tiny_qwen3_dir", torch.bfloat16)]


@pytest.fixture(scope="module", params=RUNNERS, ids=lambda p: f"{p[0][5:-4]}-{str(p[1])[6:]}")
def runner(request):
    family, dtype = request.param
    return make_runner(request.getfixturevalue(family), dtype, device=CPU, programs="off")


def test_the_runner_takes_the_kernels(runner, monkeypatch):
    inputs = runner._inputs(RoundPlan((work(0, 0, prompt(40), lane_pages(0)),
                                       work(1, 5, prompt(1), lane_pages(1), prefill=False))))
    assert inputs.tiles and all(t.masked is None and t.qpos is not None for t in inputs.tiles)
    calls = {}
    for name in ("attend_tile",):
        monkeypatch.setattr(flash, name, _counted(calls, name, getattr(flash, name)))
    for name in ("rms_norm", "silu_mul", "rope_write"):
        monkeypatch.setattr(fused, name, _counted(calls, name, getattr(fused, name)))
    runner.run_round(RoundPlan((work(2, 0, prompt(40), lane_pages(2)),)))
    layers = runner.config.num_layers
    want = {"attend_tile": layers, "rms_norm": 2 * layers + 1, "silu_mul": layers}
    if not runner.config.qk_norm:  # q/k norms per head keep torch's ops, then rope
        want["rope_write"] = layers
    assert calls == want


def _counted(calls: dict, name: str, fn):
    def run(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)
    return run


def test_flash_chunked_prefill_equals_one_shot(runner):
    """test_invariance.py's chunk plans, the last 24 rows one a round (all 300 rows one a
    round there: too slow interpreted)."""
    if runner.config.family != "llama" or runner.dtype != torch.bfloat16:
        pytest.skip("chunking is checked on llama in bf16 (the interpreter is slow)")
    check_chunking(runner, 300, fives=False, single_rows=24)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flash_hybrid_lanes_equal_solo_and_resumed_equals_cold(dtype, monkeypatch):
    """The hybrid family's attention layers through the kernel: its concurrent-lanes and
    resume-at-a-cut exactness tests (test_hybrid_exact.py), the kernel counted as it runs."""
    from prefixd.gpu.families.qwen3_5_config import hybrid_config_from_hf
    from prefixd.gpu.families.qwen3_5_tiny import tiny_hf_config
    from tests.gpu import test_hybrid_exact as hybrid

    calls = []
    real = flash.attend_tile
    monkeypatch.setattr(flash, "attend_tile", lambda *a: calls.append(1) or real(*a))
    config = hybrid_config_from_hf(tiny_hf_config())
    hybrid.test_concurrent_lanes_equal_solo(config, dtype)
    if dtype == torch.float32:
        hybrid.test_resumed_at_a_cut_equals_cold(config)
    assert calls, "the hybrid's attention did not run the kernel"


def test_flash_hybrid_decode_programs_equal_the_op_by_op_round(tmp_path, monkeypatch):
    """The hybrid's decode programs (a padding lane stepping the scratch state) on the kernels:
    test_programs_hybrid.py's checks, at 3 lanes of a bucket of 4."""
    from tests.gpu import test_programs_hybrid as hybrid
    from tests.helpers.tiny_models import make_tiny_hybrid_hf_dir

    path = make_tiny_hybrid_hf_dir(tmp_path, seed=5, vocab_size=49152, initializer_range=0.1)
    runners = tuple(make_runner(path, torch.float32, num_lanes=hybrid.LANES, num_pages=hybrid.LANES * 12,
                                device=CPU, programs=programs) for programs in ("off", "eager"))
    hybrid.test_decode_rounds_equal_the_op_by_op_round_with_the_same_lane_states(runners, 3)
    hybrid.test_a_hybrid_program_reads_no_device_value_on_the_host(runners, monkeypatch)


class _Given:
    """What test_fault_isolation.py's tests ask `request` for: the runner under test."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def getfixturevalue(self, name: str):
        return self.runner


@pytest.mark.parametrize("programs", ["off", "eager"])
def test_flash_garbage_pages_and_a_nan_lane_leave_honest_bits(tiny_llama_dir, programs):
    """test_fault_isolation.py's checks on the kernels, op by op and through decode programs:
    NaN/inf garbage in reused pages changes no bit, and a NaN-image lane beside seven honest
    ones fails alone while theirs equal each alone."""
    from tests.gpu import test_fault_isolation as fault

    runner = make_runner(tiny_llama_dir, torch.float32, device=CPU, programs=programs)
    fault.test_garbage_in_reused_pages_changes_no_bits("llama_runner", _Given(runner))
    fault.test_a_nan_image_fails_its_lane_alone_in_an_eight_lane_round("llama_runner", _Given(runner))
