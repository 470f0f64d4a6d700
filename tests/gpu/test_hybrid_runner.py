"""The hybrid family behind the Device interface: HF dir -> load_checkpoint -> ModelRunner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixd.gpu.loading import load_checkpoint
from prefixd.gpu.runner import ModelRunner
from prefixd.scheduler.records import (Capture, LaneWork, PageCopy, Restore, RoundPlan, SamplerSetup,
                                       SamplingParams)
from tests.gpu.runner_helpers import capture
from tests.helpers.device import TEST_DEVICE
from tests.helpers.tiny_models import make_tiny_hybrid_hf_dir

PAGE = 16
PAGES_PER_LANE = 12
VOCAB = 49152  # the tokenizer's own size


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_hybrid_hf_dir(tmp_path_factory.mktemp("tiny_qwen3_5"), seed=9, vocab_size=VOCAB,
                                initializer_range=0.1)
    return path


def _runner(path: Path, num_lanes: int = 8) -> ModelRunner:
    cpu = torch.device(TEST_DEVICE)  # the CPU unless PREFIXD_TEST_DEVICE says otherwise
    checkpoint = load_checkpoint(path, device=cpu, dtype=torch.float32)
    runner = ModelRunner(checkpoint, device=cpu, dtype=torch.float32, num_lanes=num_lanes,
                         num_pages=num_lanes * PAGES_PER_LANE, page_size=PAGE)
    runner.run_round(RoundPlan(samplers=tuple(SamplerSetup(lane, SamplingParams(), ()) for lane in range(num_lanes))))
    return runner


def _pages(lane: int) -> tuple[int, ...]:
    return tuple(range(lane * PAGES_PER_LANE, (lane + 1) * PAGES_PER_LANE))


def _prefill(lane: int, prompt: list[int], lo: int, hi: int) -> LaneWork:
    return LaneWork(lane, lo, tuple(prompt[lo:hi]), _pages(lane), True, sample_rows=(hi - lo - 1,),
                    logits_rows=(hi - lo - 1,))


def _decode(lane: int, pos: int, token: int) -> LaneWork:
    return LaneWork(lane, pos, (token,), _pages(lane), False, sample_rows=(0,), logits_rows=(0,))


def _decode_rows(lane: int, pos: int, tokens: list[int]) -> LaneWork:
    rows = tuple(range(len(tokens)))
    return LaneWork(lane, pos, tuple(tokens), _pages(lane), False, sample_rows=rows, logits_rows=rows)


def _generate(runner: ModelRunner, lane: int, prompt: list[int], bounds: list[int], n: int,
              neighbours: dict[int, list[int]] | None = None):
    """Greedy tokens and logits rows of `lane`; neighbours decode in the same rounds."""
    neighbours = neighbours or {}
    pos = {other: len(p) for other, p in neighbours.items()}
    rows, tokens, last = [], [], None
    for step in range(len(bounds) - 1 + n - 1):
        if step < len(bounds) - 1:
            work = _prefill(lane, prompt, bounds[step], bounds[step + 1])
        else:
            work = _decode(lane, len(prompt) + len(tokens) - 1, tokens[-1])
        extra = [_decode(other, pos[other], 1 + other) for other in neighbours]
        for other in neighbours:
            pos[other] += 1
        last = runner.run_round(RoundPlan((*extra, work))).by_lane()[lane]
        if step >= len(bounds) - 2:
            tokens.append(last.sampled[0])
        rows.append(last.logits)
    return tokens, rows


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_runner_reports_the_hybrid_facts(hybrid_dir: Path) -> None:
    runner = _runner(hybrid_dir, num_lanes=2)
    info = runner.info
    assert info.invariant_rows is False
    assert info.lane_state_bytes == capture(runner, 0).nbytes > 0
    config = runner.model.hybrid
    assert info.kv_bytes_per_page == 2 * len(config.full_layers) * PAGE * config.num_kv_heads * config.head_dim * 4


def test_runner_resume_at_a_cut_equals_cold(hybrid_dir: Path) -> None:
    prompt, bounds = _prompt(70, seed=1), [0, 32, 55, 70]
    cold_tokens, cold_rows = _generate(_runner(hybrid_dir), 0, prompt, bounds, n=8)
    runner = _runner(hybrid_dir)
    runner.run_round(RoundPlan((_prefill(0, prompt, 0, 32),)))
    snapshot = capture(runner, 0, cut=32)
    copies = tuple(PageCopy(s, d) for s, d in zip(_pages(0)[:2], _pages(3)[:2]))  # rows 0..31: two whole pages
    runner.run_round(RoundPlan(resets=(3,), page_copies=copies))
    runner.run_round(RoundPlan(restores=(Restore(3, snapshot),)))
    assert snapshot.nbytes == runner.info.lane_state_bytes
    tokens, rows = _generate(runner, 3, prompt, bounds[1:], n=8)
    assert tokens == cold_tokens
    for got, want in zip(rows, cold_rows[1:]):
        assert torch.equal(got, want)


def test_runner_eight_lanes_equal_solo(hybrid_dir: Path) -> None:
    prompt, bounds = _prompt(50, seed=2), [0, 21, 50]
    solo_tokens, solo_rows = _generate(_runner(hybrid_dir), 5, prompt, bounds, n=6)
    runner = _runner(hybrid_dir)
    neighbours = {lane: _prompt(9 + 7 * lane, seed=20 + lane) for lane in range(8) if lane != 5}
    for lane, other in neighbours.items():
        runner.run_round(RoundPlan((_prefill(lane, other, 0, len(other)),)))
    tokens, rows = _generate(runner, 5, prompt, bounds, n=6, neighbours=neighbours)
    assert tokens == solo_tokens
    for got, want in zip(rows, solo_rows):
        assert torch.equal(got, want)


def test_runner_rollback_equals_a_run_that_only_saw_the_kept_rows(hybrid_dir: Path) -> None:
    """A verify whose first draft is wrong keeps only its first row: the lane's next row then
    has the logits of a lane that decoded that one row alone."""
    prompt = _prompt(40, seed=3)
    ref = _runner(hybrid_dir)
    t0 = ref.run_round(RoundPlan((_prefill(0, prompt, 0, 40),))).by_lane()[0].sampled[0]
    t1 = ref.run_round(RoundPlan((_decode(0, 40, t0),))).by_lane()[0].sampled[0]
    want = ref.run_round(RoundPlan((_decode(0, 41, t1),))).by_lane()[0].logits
    runner = _runner(hybrid_dir)
    runner.run_round(RoundPlan((_prefill(0, prompt, 0, 40),)))
    out = runner.run_round(RoundPlan((_verify(0, 40, t0, [(t1 + 1) % VOCAB, 22, 33]),)))
    assert out.by_lane()[0].sampled == (t1,)  # the first draft rejected: one row kept
    got = runner.run_round(RoundPlan((_decode(0, 41, t1),))).by_lane()[0].logits
    assert torch.equal(got, want)


def test_reset_waits_for_an_in_flight_rollback_copy(hybrid_dir: Path) -> None:
    """A rejected verify's rollback copy is still in flight when the lane is reset for the
    next request: the reset must land last (removing the runner's wait makes the held copy win)."""
    prompt = _prompt(40, seed=4)
    runner = _runner(hybrid_dir)
    t0 = runner.run_round(RoundPlan((_prefill(0, prompt, 0, 40),))).by_lane()[0].sampled[0]
    with runner.copies.defer():
        out = runner.run_round(RoundPlan((_verify(0, 40, t0, [5, 6, 7]),)))
        assert len(out.by_lane()[0].sampled) < 4  # a draft rejected: the rollback copy is held
        assert runner.copies.pending == 1
        runner.run_round(RoundPlan(resets=(0,)))
    assert not bool(capture(runner, 0).data.any())


@pytest.mark.slow
def test_runner_greedy_matches_transformers(hybrid_dir: Path) -> None:
    from transformers import Qwen3_5ForCausalLM

    ref = Qwen3_5ForCausalLM.from_pretrained(str(hybrid_dir), dtype=torch.float32).eval()
    prompt = _prompt(40, seed=3)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                            do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    tokens, _ = _generate(_runner(hybrid_dir, num_lanes=1), 0, prompt, [0, 17, 40], n=16)
    assert tokens == want


def _verify(lane: int, pos: int, last: int, drafts: list[int]) -> LaneWork:
    rows = tuple(range(1 + len(drafts)))
    return LaneWork(lane, pos, (last, *drafts), _pages(lane), False, sample_rows=rows, logits_rows=rows,
                    drafts=tuple(drafts))


@pytest.mark.parametrize("same_round", [False, True], ids=["next_round", "same_round"])
def test_a_rejected_verify_then_an_immediate_capture_holds_only_accepted_rows(hybrid_dir: Path,
                                                                              same_round: bool) -> None:
    """A verify whose second draft is wrong rolls the lane back inside the round; a capture
    taken at once (the rollback copy still in flight) must wait for it and hold the state of
    a lane that decoded only the accepted rows. Skipping the rollback, or capturing before
    its fence, makes the captured bytes differ."""
    prompt = _prompt(40, seed=6)
    ref = _runner(hybrid_dir)
    t0 = ref.run_round(RoundPlan((_prefill(0, prompt, 0, 40),))).by_lane()[0].sampled[0]
    t1 = ref.run_round(RoundPlan((_decode(0, 40, t0),))).by_lane()[0].sampled[0]
    t2 = ref.run_round(RoundPlan((_decode(0, 41, t1),))).by_lane()[0].sampled[0]
    want = capture(ref, 0).data
    runner = _runner(hybrid_dir)
    runner.run_round(RoundPlan((_prefill(0, prompt, 0, 40),)))
    wrong = (t2 + 1) % VOCAB
    with runner.copies.defer():
        captures = (Capture(0, 42),) if same_round else ()
        out = runner.run_round(RoundPlan((_verify(0, 40, t0, [t1, wrong, 5]),), captures=captures))
        assert out.by_lane()[0].sampled == (t1, t2)  # t1 accepted, the wrong draft rejected: the model's t2
        got = (out.captured[0].state if same_round else capture(runner, 0)).data
    assert torch.equal(got, want)
