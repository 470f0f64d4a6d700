"""Drafted equals undrafted: the engine over the real ModelRunner (tiny random llama, qwen3
and qwen3_5; on the CPU, or the device PREFIXD_TEST_DEVICE names, as bench/device_check.sh
runs it) emits the same token ids and the same logits bits with n-gram drafting on as with
it off: greedy and seeded sampling (top-k, top-p, repetition penalty), several lanes
with some streams drafting and some not, a second turn resumed from the store, and rejected
drafts whose verify rows cross a page boundary."""

from __future__ import annotations

import itertools
import shutil
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from prefixd.gpu.loading import load_checkpoint  # noqa: E402
from prefixd.gpu.runner import ModelRunner  # noqa: E402
from prefixd.scheduler.config import SchedulerConfig  # noqa: E402
from prefixd.scheduler.engine import Engine  # noqa: E402
from prefixd.scheduler.records import SamplingParams  # noqa: E402
from prefixd.scheduler.streams import DoneEvent, StreamRequest, TokenEvent  # noqa: E402
from tests.helpers.device import TEST_DEVICE  # noqa: E402
from tests.helpers.tiny_models import _tokenizer_files, make_tiny_hf_dir  # noqa: E402

pytestmark = pytest.mark.slow
DEVICE = torch.device(TEST_DEVICE)
PAGE = 8
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.3, top_k=40, top_p=0.95, repetition_penalty=1.05, seed=7)


class Recorder:
    """The runner, recording every verify work and what it accepted."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.info = runner.info
        self.verifies: list[tuple[int, int, int]] = []  # (start, rows, accepted rows)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run_round(self, plan):
        result = self.runner.run_round(plan)
        for w, r in zip(plan.lanes, result.lanes):
            if w.drafts:
                self.verifies.append((w.start, len(w.tokens), len(r.sampled)))
        return result


@pytest.fixture(scope="module", params=["llama", "qwen3", "hybrid"])
def runner(request, tmp_path_factory) -> ModelRunner:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "hybrid":
        tiny = pytest.importorskip("prefixd.gpu.families.qwen3_5_tiny")
        tiny.make_tiny_hybrid_dir(path, seed=0)
        shutil.copyfile(Path(_tokenizer_files()) / "tokenizer.json", path / "tokenizer.json")
    else:
        make_tiny_hf_dir(path, request.param, seed=1, tie_word_embeddings=True, num_hidden_layers=2)
    ckpt = load_checkpoint(path, device=DEVICE, dtype=torch.float32)
    return ModelRunner(ckpt, device=DEVICE, dtype=torch.float32, num_lanes=4, num_pages=512, page_size=PAGE)


def echo_prompt(vocab: int, seed: int) -> tuple[int, ...]:
    """A prompt that repeats itself (as agent transcripts do) after a sweep over many ids, so
    lookups find matches for most tokens even a random tiny model produces."""
    sweep = [(seed + 2 * i) % vocab for i in range(min(256, vocab // 2))]
    line = [(seed * 97 + 13 * i) % vocab for i in range(6)]
    return tuple(sweep + line * 3 + [(seed + 5) % vocab, (seed + 9) % vocab] + line[:2])


def play(runner, reqs: list[StreamRequest], *, draft: str, cache: bool = False, turns: int = 1,
         free_rows: bool = False):
    """Run `reqs` together for `turns` turns (each turn's prompt: the last prompt, its reply
    and two more tokens); returns {(stream, turn): (ids, logits rows' sha256, usage)}.
    `free_rows`: the engine's clock ticks once a call, so every decode round costs the same
    whatever its rows and the draft policy grants every offer in full (not only the ones a
    real round's timing would pay for)."""
    clock = (lambda ticks=itertools.count(): float(next(ticks))) if free_rows else time.monotonic
    engine = Engine(runner, SchedulerConfig(num_lanes=4, grid=64, round_row_budget=128, cache=cache,
                                            draft=draft, draft_max=4), clock=clock)
    out = {}
    for t in range(turns):
        events = []
        for r in reqs:
            engine.submit(r)
        while not engine.idle:
            events += engine.step()
            engine.check_integrity()
        nxt = []
        for r in reqs:
            tok = [ev for ev in events if isinstance(ev, TokenEvent) and ev.stream_id == r.stream_id]
            ids = [i for ev in tok for i in ev.ids]
            done = next(ev for ev in events if isinstance(ev, DoneEvent) and ev.stream_id == r.stream_id)
            out[r.stream_id % 100, t] = (ids, [d for ev in tok for d in ev.logits_sha256], done.usage)
            prompt = r.tokens + tuple(ids) + (3, 4)
            nxt.append(StreamRequest(r.stream_id + 100, prompt, r.max_tokens, sampling=r.sampling,
                                     want_logits=True, draft=r.draft))
        reqs = nxt
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key][0] == b[key][0], key
        assert len(a[key][1]) == len(a[key][0]) == len(b[key][1])
        assert a[key][1] == b[key][1], key


def requests(vocab: int, sampling: SamplingParams, n: int, *, draft_every: int = 1) -> list[StreamRequest]:
    return [StreamRequest(s, echo_prompt(vocab, s), 24, sampling=sampling, want_logits=True,
                          draft=s % draft_every == 0)
            for s in range(1, n + 1)]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_drafted_equals_undrafted_in_ids_and_logits_bits(runner, sampling):
    rec = Recorder(runner)
    reqs = requests(runner.info.vocab_size, sampling, 1)
    off = play(runner, reqs, draft="off")
    on = play(rec, reqs, draft="ngram")
    assert_same(off, on)
    usage = on[1, 0][2]
    assert usage.draft_tokens > 0
    assert off[1, 0][2].draft_tokens == 0
    assert usage.draft_tokens == sum(rows - 1 for _, rows, _ in rec.verifies)
    assert usage.accepted_tokens == sum(acc - 1 for _, _, acc in rec.verifies)


def test_four_lanes_some_drafting_and_a_resumed_turn_equal_undrafted(runner):
    rec = Recorder(runner)
    reqs = requests(runner.info.vocab_size, SAMPLED, 4, draft_every=2)
    off = play(runner, reqs, draft="off", cache=True, turns=2)
    on = play(rec, reqs, draft="ngram", cache=True, turns=2)
    assert_same(off, on)
    assert all(on[s, 0][2].draft_tokens == 0 for s in (1, 3))  # draft: off in the request
    assert any(on[s, t][2].draft_tokens > 0 for s in (2, 4) for t in (0, 1))
    assert all(on[s, 1][2].cached_tokens > 0 for s in (1, 2, 3, 4))  # the second turn resumed


def test_rejected_drafts_cross_page_boundaries(runner):
    """Among the verifies of the runs above' shape, some rejected rows lie on a later page than
    the last accepted row: the trimmed page and the rolled-back state are exercised."""
    rec = Recorder(runner)
    reqs = requests(runner.info.vocab_size, SAMPLED, 4)
    off = play(runner, reqs, draft="off")
    on = play(rec, reqs, draft="ngram", free_rows=True)  # every offer granted, whatever rounds cost here
    assert_same(off, on)
    crossing = [(s, n, a) for s, n, a in rec.verifies if a < n and (s + a - 1) // PAGE < (s + n - 1) // PAGE]
    assert crossing, rec.verifies


@pytest.fixture(scope="module")
def default_runner() -> ModelRunner:
    from tests.helpers.tiny_models import default_gguf_path

    path = default_gguf_path()
    if path is None:
        pytest.skip("the default model is not installed")
    ckpt = load_checkpoint(path, device=DEVICE, dtype=torch.bfloat16)
    return ModelRunner(ckpt, device=DEVICE, dtype=torch.bfloat16, num_lanes=4, num_pages=256, page_size=PAGE)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_default_model_drafted_equals_undrafted(default_runner, sampling):
    """The default model (bf16, the daemon's CPU mode), two lanes: one drafting, one not."""
    line = [28, 1152, 314, 253, 3459, 30, 1033, 2205]  # an echo-heavy prompt of real ids
    reqs = [StreamRequest(s, tuple(line * 4 + line[:3]), 24, sampling=sampling, want_logits=True, draft=s == 1)
            for s in (1, 2)]
    off = play(default_runner, reqs, draft="off")
    on = play(default_runner, reqs, draft="ngram")
    assert_same(off, on)
    assert on[1, 0][2].draft_tokens > 0 and on[2, 0][2].draft_tokens == 0
