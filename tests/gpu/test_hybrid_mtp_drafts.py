"""The runner's draft head (`draft_head=True`): after each round, the MTP head's rows for every
lane and up to `LaneWork.propose` drafts after the sampled token, equal to the head run by hand
over the whole sequence in one call; the same drafts when the lane was resumed from a snapshot,
or shares its rounds with other lanes; a model without MTP layers refuses a draft head."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from prefixd.gpu.families.qwen3_5 import HybridModel
from prefixd.gpu.families.qwen3_5_config import hybrid_config
from prefixd.gpu.families.qwen3_5_tiny import make_tiny_hybrid_dir
from prefixd.gpu.kv_pool import KVPool
from prefixd.gpu.loading import load_checkpoint
from prefixd.gpu.runner import ModelRunner
from prefixd.scheduler.records import Capture, LaneWork, PageCopy, Restore, RoundPlan, SamplerSetup, SamplingParams
from tests.helpers.device import TEST_DEVICE
from tests.helpers.tiny_models import _tokenizer_files

pytestmark = pytest.mark.slow

PAGE = 16
PAGES_PER_LANE = 8
VOCAB = 512
K = 3


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_tokenizer(make_tiny_hybrid_dir(tmp_path_factory.mktemp("mtp_drafts"), seed=3, mtp_layers=1,
                                                initializer_range=0.1))


def _with_tokenizer(path: Path) -> Path:
    shutil.copyfile(Path(_tokenizer_files()) / "tokenizer.json", path / "tokenizer.json")
    return path


def _runner(path: Path, num_lanes: int = 4, draft_head: bool = True) -> ModelRunner:
    device = torch.device(TEST_DEVICE)
    checkpoint = load_checkpoint(path, device=device, dtype=torch.float32)
    runner = ModelRunner(checkpoint, device=device, dtype=torch.float32, num_lanes=num_lanes,
                         num_pages=num_lanes * PAGES_PER_LANE, page_size=PAGE, draft_head=draft_head)
    runner.run_round(RoundPlan(samplers=tuple(SamplerSetup(lane, SamplingParams(), ()) for lane in range(num_lanes))))
    return runner


def _pages(lane: int) -> tuple[int, ...]:
    return tuple(range(lane * PAGES_PER_LANE, (lane + 1) * PAGES_PER_LANE))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _chunk(lane: int, prompt: list[int], lo: int, hi: int) -> LaneWork:
    last = hi == len(prompt)
    return LaneWork(lane, lo, tuple(prompt[lo:hi]), _pages(lane)[: -(-hi // PAGE)], True,
                    sample_rows=(hi - lo - 1,) if last else (), propose=K if last else 0)


def _decode(lane: int, pos: int, token: int) -> LaneWork:
    return LaneWork(lane, pos, (token,), _pages(lane)[: pos // PAGE + 1], False, sample_rows=(0,), propose=K)


def _by_hand(path: Path, tokens: list[int], k: int) -> tuple[tuple[int, ...], float]:
    """The head over all of `tokens` in one call, then chained k - 1 times: the drafts after
    the last token, and the head's probability of the first."""
    device = torch.device(TEST_DEVICE)
    ckpt = load_checkpoint(path, device=device, dtype=torch.float32)
    model = HybridModel(hybrid_config(ckpt.config), ckpt.tensors, device=device, dtype=torch.float32)
    model.new_lane_states(1)
    c = ckpt.config
    kv = KVPool(num_layers=model.num_kv_layers, num_pages=16, page_size=PAGE, num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim, device=device, dtype=torch.float32)
    pages = tuple(range(16))
    n = len(tokens)
    hidden = model.forward_works([LaneWork(0, 0, tuple(tokens[:-1]), pages, True)], kv)
    rows = model.mtp_works(hidden, [LaneWork(0, 0, tuple(tokens[1:]), pages, True)], kv)[-1:]
    logits = model.logits(rows)
    drafts = [int(logits.argmax())]
    p = float(torch.softmax(logits, dim=-1).max())
    for j in range(1, k):
        rows = model.mtp_works(rows, [LaneWork(0, n - 2 + j, (drafts[-1],), pages, True)], kv, step=j)
        drafts.append(int(model.logits(rows).argmax()))
    return tuple(drafts), p


def _same(res, want: tuple[tuple[int, ...], float]) -> bool:
    """Proposals equal, and the first one's probability within float32 noise (the runner's
    decoded rows and the hand's prefilled rows differ in the last bits)."""
    return res.proposals == want[0] and abs(res.proposal_p - want[1]) <= 1e-5 * want[1]


def _run(runner: ModelRunner, lane: int, prompt: list[int], bounds: list[int], steps: int,
         neighbour: bool = False) -> tuple[list[int], list[tuple[int, ...]]]:
    """Greedy: prefill in chunks at `bounds`, then decode; the tokens and each sampling round's result."""
    tokens, results = [], []
    works = [_chunk(lane, prompt, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    for i in range(len(works) + steps):
        work = works[i] if i < len(works) else _decode(lane, len(prompt) + len(tokens) - 1, tokens[-1])
        extra = (_chunk(lane + 1, prompt[:20], 0, 20),) if neighbour and i == 0 else ()
        res = runner.run_round(RoundPlan((work, *extra))).by_lane()[lane]
        if res.sampled:
            tokens.append(res.sampled[-1])
            results.append(res)
    return tokens, results


def test_proposals_equal_the_head_run_by_hand(mtp_dir: Path) -> None:
    prompt = _prompt(37, seed=1)
    tokens, results = _run(_runner(mtp_dir), 0, prompt, [0, 16, 30, 37], steps=3)
    assert all(len(r.proposals) == K for r in results)
    for i, res in enumerate(results):
        assert _same(res, _by_hand(mtp_dir, prompt + tokens[: i + 1], K)), i


def test_a_resumed_lane_proposes_what_a_cold_one_does(mtp_dir: Path) -> None:
    prompt = _prompt(40, seed=2)
    cold = _run(_runner(mtp_dir), 0, prompt, [0, 32, 40], steps=3)
    runner = _runner(mtp_dir)
    snap = runner.run_round(RoundPlan((_chunk(1, prompt, 0, 32),), captures=(Capture(1, 32),))).captured[0].state
    copies = tuple(PageCopy(_pages(1)[i], _pages(0)[i]) for i in range(2))
    runner.run_round(RoundPlan(restores=(Restore(0, snap),), page_copies=copies))
    tokens, results = _run(runner, 0, prompt, [32, 40], steps=3)
    assert tokens == cold[0]
    assert [(r.proposals, r.proposal_p) for r in results] == [(r.proposals, r.proposal_p) for r in cold[1]]


def test_proposals_do_not_depend_on_the_other_lanes(mtp_dir: Path) -> None:
    prompt = _prompt(30, seed=4)
    solo = _run(_runner(mtp_dir), 0, prompt, [0, 30], steps=3)
    beside = _run(_runner(mtp_dir), 0, prompt, [0, 30], steps=3, neighbour=True)
    assert beside[0] == solo[0]
    assert [(r.proposals, r.proposal_p) for r in beside[1]] == [(r.proposals, r.proposal_p) for r in solo[1]]


def test_a_model_without_mtp_layers_refuses_a_draft_head(tmp_path: Path) -> None:
    path = _with_tokenizer(make_tiny_hybrid_dir(tmp_path, seed=1))
    with pytest.raises(ValueError, match="no MTP layers"):
        _runner(path)


def _verify(lane: int, pos: int, tokens: list[int]) -> LaneWork:
    rows = tuple(range(len(tokens)))
    return LaneWork(lane, pos, tuple(tokens), _pages(lane)[: (pos + len(tokens) - 1) // PAGE + 1], False,
                    sample_rows=rows, drafts=tuple(tokens[1:]), propose=K)


@pytest.mark.parametrize("accepted", [2, 1], ids=["all_accepted", "one_rejected"])
def test_proposals_after_a_verify_follow_the_kept_rows(mtp_dir: Path, accepted: int) -> None:
    """A verify of two drafts (the model's own next tokens, the second one wrong when
    `accepted` is 1): the head's rows read only the kept rows, so the proposals after it, and
    after the next decode (its carry row from the rolled-back carry), equal the head by hand."""
    prompt = _prompt(37, seed=5)
    t, _ = _run(_runner(mtp_dir), 0, prompt, [0, 37], steps=5)
    runner = _runner(mtp_dir)
    runner.run_round(RoundPlan((_chunk(0, prompt, 0, 37),)))
    drafts = t[1:3] if accepted == 2 else [t[1], (t[2] + 1) % VOCAB]
    res = runner.run_round(RoundPlan((_verify(0, 37, [t[0], *drafts]),))).by_lane()[0]
    assert res.sampled == tuple(t[1:accepted + 2])
    assert _same(res, _by_hand(mtp_dir, prompt + t[:accepted + 2], K))
    pos = 37 + accepted + 1
    res = runner.run_round(RoundPlan((_decode(0, pos, t[accepted + 1]),))).by_lane()[0]
    assert res.sampled == (t[accepted + 2],)
    assert _same(res, _by_hand(mtp_dir, prompt + t[:accepted + 3], K))
