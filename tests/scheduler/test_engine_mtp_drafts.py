"""Drafted equals undrafted with the MTP head (`--draft mtp`): the engine over the real
ModelRunner with a draft head (tiny random qwen3_5 with an MTP layer; on the CPU, or the
device PREFIXD_TEST_DEVICE names, as bench/device_check.sh runs it) emits the same
token ids and logits bits as the same model undrafted: greedy and seeded sampling, four lanes
with some streams drafting and some not, a second turn resumed from the store (the draft
carry rides in the snapshot), and rejected verifies followed by captures of the same lane."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from prefixd.gpu.loading import load_checkpoint  # noqa: E402
from prefixd.gpu.runner import ModelRunner  # noqa: E402
from prefixd.scheduler.config import SchedulerConfig  # noqa: E402
from prefixd.scheduler.engine import Engine  # noqa: E402
from tests.helpers.device import TEST_DEVICE  # noqa: E402
from tests.helpers.tiny_models import _tokenizer_files  # noqa: E402
from tests.scheduler.test_engine_drafts import GREEDY, PAGE, SAMPLED, assert_same, play, requests  # noqa: E402

pytestmark = pytest.mark.slow
DEVICE = torch.device(TEST_DEVICE)


class Recorder:
    """The runner, recording each lane's rounds: ("verify", rows, accepted rows) or ("capture",)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.info = runner.info
        self.log: list[tuple[int, tuple]] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run_round(self, plan):
        result = self.runner.run_round(plan)
        for w, r in zip(plan.lanes, result.lanes):
            if w.drafts:
                self.log.append((w.lane, ("verify", len(w.tokens), len(r.sampled))))
        self.log += [(c.lane, ("capture",)) for c in plan.captures]
        return result

    def verifies(self) -> list[tuple[int, int]]:
        return [(e[1], e[2]) for _, e in self.log if e[0] == "verify"]


def tiny_mtp_dir(path: Path) -> Path:
    tiny = pytest.importorskip("prefixd.gpu.families.qwen3_5_tiny")
    tiny.make_tiny_hybrid_dir(path, seed=0, mtp_layers=1)
    shutil.copyfile(Path(_tokenizer_files()) / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return load_checkpoint(tiny_mtp_dir(tmp_path_factory.mktemp("mtp")), device=DEVICE, dtype=torch.float32)


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    """The tiny model with both final norms (the main model's and the head's) keeping hidden
    dimension 0 only: every logits row is a multiple of one column of the lm_head, so the
    model and its head each pick one of two tokens by the sign of that dimension (the same
    one, as it turns out, all along), and the rows are nearly flat."""
    from safetensors.torch import load_file, save_file

    path = tiny_mtp_dir(tmp_path_factory.mktemp("mtp_agreeing"))
    tensors = load_file(str(path / "model.safetensors"))
    for name in ("model.norm.weight", "mtp.norm.weight"):  # zero-centred: -1 zeroes a dimension
        tensors[name] = torch.full_like(tensors[name], -1.0)
        tensors[name][0] = 0.0
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return load_checkpoint(path, device=DEVICE, dtype=torch.float32)


def runner_of(checkpoint, draft_head: bool) -> ModelRunner:
    return ModelRunner(checkpoint, device=DEVICE, dtype=torch.float32, num_lanes=4, num_pages=512, page_size=PAGE,
                       draft_head=draft_head)


@pytest.fixture(scope="module")
def plain(checkpoint) -> ModelRunner:
    return runner_of(checkpoint, draft_head=False)


@pytest.fixture(scope="module")
def head(checkpoint) -> ModelRunner:
    return runner_of(checkpoint, draft_head=True)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_mtp_drafted_equals_undrafted_in_ids_and_logits_bits(plain, head, sampling):
    rec = Recorder(head)
    reqs = requests(plain.info.vocab_size, sampling, 1)
    off = play(plain, reqs, draft="off")
    on = play(rec, reqs, draft="mtp", free_rows=True)
    assert_same(off, on)
    usage = on[1, 0][2]
    assert usage.draft_tokens > 0
    assert usage.draft_tokens == sum(rows - 1 for rows, _ in rec.verifies())
    assert usage.accepted_tokens == sum(acc - 1 for _, acc in rec.verifies())


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_accepted_mtp_drafts_equal_undrafted(agreeing, sampling):
    rec = Recorder(runner_of(agreeing, draft_head=True))
    reqs = requests(rec.info.vocab_size, sampling, 2)
    off = play(runner_of(agreeing, draft_head=False), reqs, draft="off", cache=True, turns=2)
    on = play(rec, reqs, draft="mtp", cache=True, turns=2, free_rows=True)
    assert_same(off, on)
    verifies = rec.verifies()
    if sampling.greedy:  # the model and its head pick the same token: every draft is accepted
        assert verifies and all(acc == rows for rows, acc in verifies)
        assert any(acc > 2 for _, acc in verifies)  # drafts from chained passes of the head
    else:  # sampled from nearly flat rows: the head's argmax is rarely the token drawn
        assert any(acc < rows for rows, acc in verifies)


def test_four_lanes_a_resumed_turn_and_captures_after_rejections_equal_undrafted(plain, head):
    rec = Recorder(head)
    reqs = requests(plain.info.vocab_size, SAMPLED, 4, draft_every=2)
    off = play(plain, reqs, draft="off", cache=True, turns=2)
    on = play(rec, reqs, draft="mtp", cache=True, turns=2, free_rows=True)
    assert_same(off, on)
    assert all(on[s, t][2].draft_tokens == 0 for s in (1, 3) for t in (0, 1))  # draft: off in the request
    assert all(on[s, t][2].draft_tokens > 0 for s in (2, 4) for t in (0, 1))
    assert all(on[s, 1][2].cached_tokens > 0 for s in (1, 2, 3, 4))  # the second turn resumed
    rejected_then_captured = {lane for i, (lane, e) in enumerate(rec.log) if e[0] == "verify" and e[2] < e[1]
                              and (lane, ("capture",)) in rec.log[i + 1:]}
    assert rejected_then_captured


def test_mtp_mode_needs_a_draft_head(plain):
    with pytest.raises(ValueError, match="draft head"):
        Engine(plain, SchedulerConfig(num_lanes=4, draft="mtp"))
