"""Fault isolation on the real runner: garbage in reused pages and a failing lane change no bits
of any other lane's rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from prefixd.gpu.runner import ModelRunner
from prefixd.scheduler.records import ImageIdentity, ImageRows, LaneWork, RoundPlan, SamplerSetup, SamplingParams
from tests.gpu.runner_helpers import lane_pages, make_runner, prompt
from tests.helpers.tiny_models import make_tiny_hybrid_hf_dir

NUM_LANES = 8
LENGTHS = (40, 260, 17, 33, 5, 20, 9, 16)  # partial last pages; the decode tile spans 2 blocks
NUM_DECODES = 2
BAD_LANE = 3


@pytest.fixture(scope="module")
def llama_runner(tiny_llama_dir: Path) -> ModelRunner:
    return make_runner(tiny_llama_dir, torch.float32)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hybrid_hf_dir(tmp_path_factory.mktemp("tiny_qwen3_5"), seed=9, vocab_size=49152,
                                   initializer_range=0.1)


@pytest.fixture(scope="module")
def hybrid_runner(hybrid_dir: Path) -> ModelRunner:
    return make_runner(hybrid_dir, torch.float32)


@pytest.fixture(scope="module")
def hybrid_programs_runner(hybrid_dir: Path) -> ModelRunner:
    """Its decode rounds run as the fixed programs CUDA captures (gpu/programs.py), uncaptured:
    a bucket's padding lanes step a scratch state and its attention reads every block up to the
    bucket's context, the reused garbage pages included."""
    runner = make_runner(hybrid_dir, torch.float32, programs="eager")
    assert runner.programs is not None
    return runner


def fill_garbage(runner: ModelRunner) -> None:
    """Every row of every page: NaN, +inf, -inf and huge values in turn."""
    flat = runner.kv.storage.view(-1)
    pattern = torch.tensor([float("nan"), float("inf"), float("-inf"), 3e38], dtype=flat.dtype)
    flat.copy_(pattern.repeat(flat.numel() // 4 + 1)[: flat.numel()].to(flat.device))


def nan_image(lane: int, runner: ModelRunner) -> ImageRows:
    rows = np.full((4, runner.config.hidden_size), np.nan, dtype=np.float32)
    return ImageRows(ImageIdentity(at=2, tokens=4, gh=2, gw=2, hash=bytes([lane])), rows)


def prefill(lane: int, images: tuple[ImageRows, ...] = ()) -> LaneWork:
    n = LENGTHS[lane]
    return LaneWork(lane, 0, prompt(n, seed=lane), lane_pages(lane), True, sample_rows=(n - 1,),
                    logits_rows=(n - 1,), images=images)


def run_lanes(runner: ModelRunner, lanes: list[int], images: dict[int, tuple[ImageRows, ...]]):
    """Prefill `lanes` in one round, then decode them together: {lane: [(token, logits row)]},
    a lane's list ending at its error string when it fails."""
    out: dict[int, list] = {lane: [] for lane in lanes}
    start_lanes(runner, lanes)
    plan = [prefill(lane, images.get(lane, ())) for lane in lanes]
    for step in range(NUM_DECODES + 1):
        live = []
        for w, res in zip(plan, runner.run_round(RoundPlan(tuple(plan))).lanes):
            if res.error is not None:
                out[w.lane].append(res.error)
                continue
            out[w.lane].append((res.sampled[0], res.logits[0].clone()))
            start = w.start + len(w.tokens)
            live.append(LaneWork(w.lane, start, res.sampled, w.page_table, False, sample_rows=(0,),
                                 logits_rows=(0,)))
        plan = live
    return out


def start_lanes(runner: ModelRunner, lanes: list[int]) -> None:
    """A round that only resets `lanes` and gives each a fresh greedy sampler (a seating)."""
    runner.run_round(RoundPlan(resets=tuple(lanes),
                               samplers=tuple(SamplerSetup(lane, SamplingParams(), ()) for lane in lanes)))


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (tok, row), (tok_want, row_want) in zip(got, want):
        assert tok == tok_want and torch.equal(row, row_want)


@pytest.mark.parametrize("which", ["llama_runner", "hybrid_runner", "hybrid_programs_runner"])
def test_garbage_in_reused_pages_changes_no_bits(which, request):
    runner = request.getfixturevalue(which)
    runner.kv.storage.zero_()
    clean = run_lanes(runner, list(range(NUM_LANES)), {})
    fill_garbage(runner)
    dirty = run_lanes(runner, list(range(NUM_LANES)), {})
    for lane in range(NUM_LANES):
        assert_same(dirty[lane], clean[lane])
        assert all(bool(torch.isfinite(row).all()) for _, row in dirty[lane])


@pytest.mark.parametrize("which", ["llama_runner", "hybrid_runner", "hybrid_programs_runner"])
def test_a_nan_image_fails_its_lane_alone_in_an_eight_lane_round(which, request):
    runner = request.getfixturevalue(which)
    solo = {lane: run_lanes(runner, [lane], {})[lane] for lane in range(NUM_LANES) if lane != BAD_LANE}
    together = run_lanes(runner, list(range(NUM_LANES)), {BAD_LANE: (nan_image(BAD_LANE, runner),)})
    assert together[BAD_LANE] == [f"the logits row at position {LENGTHS[BAD_LANE] - 1} is not finite (NaN or inf)"]
    for lane, want in solo.items():
        assert_same(together[lane], want)
    # the failed lane's pages (NaN rows) serve the next lane that gets them, bit for bit
    start_lanes(runner, [0])
    w = prefill(0)
    again = runner.run_round(RoundPlan((LaneWork(0, 0, w.tokens, lane_pages(BAD_LANE), True, sample_rows=w.sample_rows,
                                                 logits_rows=w.logits_rows),))).lanes[0]
    assert again.sampled == (solo[0][0][0],) and torch.equal(again.logits[0], solo[0][0][1])


def test_a_failing_sampler_fails_its_lane_alone(llama_runner, monkeypatch):
    runner = llama_runner
    solo = {lane: run_lanes(runner, [lane], {})[lane] for lane in range(NUM_LANES)}
    real_new = runner._new_sampler

    def new_sampler(item):
        sampler = real_new(item)
        if item.lane == BAD_LANE:
            def broken(*args):
                raise RuntimeError("logits row has no finite probability mass")
            monkeypatch.setattr(sampler, "sample", broken)
        return sampler

    monkeypatch.setattr(runner, "_new_sampler", new_sampler)
    together = run_lanes(runner, list(range(NUM_LANES)), {})
    assert together[BAD_LANE] == ["sampling failed: logits row has no finite probability mass"]
    for lane in range(NUM_LANES):
        if lane != BAD_LANE:
            assert_same(together[lane], solo[lane])


def test_image_rows_of_the_wrong_shape_keep_their_lane_out_of_the_round(llama_runner):
    runner = llama_runner
    want = run_lanes(runner, [0], {})[0][0]
    bad = ImageRows(ImageIdentity(at=1, tokens=4, gh=2, gw=2, hash=b"x"), np.zeros((4, 3), dtype=np.float32))
    start_lanes(runner, [0, 1])
    res = runner.run_round(RoundPlan((prefill(0), prefill(1, (bad,))))).lanes
    assert res[1].lane == 1 and res[1].sampled == () and res[1].logits is None
    assert res[1].error == f"image at row 1: rows of shape (4, 3), the model needs (4, {runner.config.hidden_size})"
    assert res[0].sampled == (want[0],) and torch.equal(res[0].logits[0], want[1])


def test_finite_rows_names_exactly_the_rows_with_a_nan_or_inf():
    """The one-sum shortcut never calls a bad row finite, nor a finite row bad when its values'
    sum overflows (3e38 + 3e38 is inf in float32)."""
    from prefixd.gpu.runner import _finite_rows

    logits = torch.zeros(6, 49152)
    logits[1, 7] = float("nan")
    logits[2, 40000] = float("inf")
    logits[3, 0] = float("-inf")
    logits[4, :2] = 3e38  # finite values, an infinite sum
    logits[5, 3], logits[5, 4] = float("inf"), float("-inf")  # their sum is NaN
    assert _finite_rows(logits) == [True, False, False, False, True, False]
    assert _finite_rows(logits[[0, 4]]) == [True, True]
    assert _finite_rows(torch.randn(3, 10)) == [True, True, True]
