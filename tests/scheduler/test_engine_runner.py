"""The engine over the real torch ModelRunner (tiny random models, CPU): multi-turn
conversations give the same token ids and the same logits bits with the store off, on,
evicting every turn, via resident lanes, and with conversations sharing rounds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from prefixd.gpu.loading import load_checkpoint  # noqa: E402
from prefixd.gpu.runner import ModelRunner  # noqa: E402
from prefixd.scheduler.config import SchedulerConfig  # noqa: E402
from prefixd.scheduler.engine import Engine  # noqa: E402
from prefixd.scheduler.records import SamplingParams  # noqa: E402
from prefixd.scheduler.streams import DoneEvent, StreamRequest, TokenEvent  # noqa: E402
from tests.helpers.tiny_models import _tokenizer_files, make_tiny_hf_dir  # noqa: E402

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
NUM_TURNS = 2


@pytest.fixture(scope="module", params=["llama", "hybrid"])
def runner(request, tmp_path_factory) -> ModelRunner:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        make_tiny_hf_dir(path, "llama", seed=1, tie_word_embeddings=True, num_hidden_layers=2)
    else:
        tiny = pytest.importorskip("prefixd.gpu.families.qwen3_5_tiny")
        tiny.make_tiny_hybrid_dir(path, seed=0)
        shutil.copyfile(Path(_tokenizer_files()) / "tokenizer.json", path / "tokenizer.json")
    ckpt = load_checkpoint(path, device=CPU, dtype=torch.float32)
    return ModelRunner(ckpt, device=CPU, dtype=torch.float32, num_lanes=2, num_pages=48, page_size=8)


def conversations(vocab: int) -> dict[int, list[list[int]]]:
    """Per conversation, the tokens each turn adds: a message, then a 2-token reply header
    (turn 0 opens with a system prefix both conversations share)."""
    system = [(7 * i + 3) % vocab for i in range(12)]
    header = [5, 6]
    return {
        c: [system + [(c * 31 + i) % vocab for i in range(3 + c)] + header]
        + [[(c * 13 + t * 5 + i) % vocab for i in range(3)] + header for t in range(1, NUM_TURNS)]
        for c in (1, 2)
    }


def play(runner, *, num_lanes: int, cache: bool, budget: int | None, together: bool):
    """Run every turn of both conversations; returns {(conv, turn): (ids, logits digests, usage)}.

    Chunk starts are set as a chat template sets them: at each message and at each reply
    header, so the next turn shares the cut at the previous reply's header.
    """
    engine = Engine(runner, SchedulerConfig(num_lanes=num_lanes, grid=8, round_row_budget=12, cache=cache,
                                            cache_budget_bytes=budget))
    convs = conversations(runner.info.vocab_size)
    prompts = {c: [] for c in convs}
    starts = {c: [] for c in convs}
    out = {}
    for t in range(NUM_TURNS):
        batch = []
        for c in convs:
            if prompts[c]:
                starts[c].append(len(prompts[c]))  # the new message
            prompts[c] = prompts[c] + convs[c][t]
            starts[c].append(len(prompts[c]) - 2)  # the reply header
            sampling = SamplingParams(temperature=0.9, seed=10 * c + t)
            batch.append(StreamRequest(100 * t + c, tuple(prompts[c]), 3, sampling=sampling,
                                       chunk_starts=tuple(starts[c]), want_logits=True))
        groups = [batch] if together else [[r] for r in batch]
        for group in groups:
            for r in group:
                engine.submit(r)
            events = []
            while not engine.idle:
                events += engine.step()
                engine.check_integrity()
            for r in group:
                c = r.stream_id % 100
                ids = [i for ev in events if isinstance(ev, TokenEvent) and ev.stream_id == r.stream_id for i in ev.ids]
                rows = [d for ev in events if isinstance(ev, TokenEvent) and ev.stream_id == r.stream_id
                        for d in ev.logits_sha256]
                done = next(ev for ev in events if isinstance(ev, DoneEvent) and ev.stream_id == r.stream_id)
                out[c, t] = (ids, rows, done.usage)
                prompts[c] = prompts[c] + ids
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key][0] == b[key][0], key
        assert len(a[key][1]) == len(a[key][0])
        assert a[key][1] == b[key][1], key  # sha256 of every sampled row's fp32 bytes


def test_resumed_and_concurrent_turns_equal_cold_solo_in_ids_and_logits_bits(runner):
    cold = play(runner, num_lanes=1, cache=False, budget=None, together=False)
    resident = play(runner, num_lanes=2, cache=True, budget=None, together=True)
    restored = play(runner, num_lanes=1, cache=True, budget=None, together=False)
    info = runner.info
    tight = (info.weights_bytes + 2 * 8 * info.workspace_bytes_per_row + 2 * info.lane_state_bytes
             + 4 * info.kv_bytes_per_page)
    evicting = play(runner, num_lanes=1, cache=True, budget=tight, together=False)
    for run in (resident, restored, evicting):
        assert_same(cold, run)
    later = [(c, t) for c in (1, 2) for t in range(1, NUM_TURNS)]
    assert all(cold[k][2].cache == "off" for k in cold)
    assert all(resident[k][2].cache == "resident" for k in later)
    assert all(restored[k][2].cache == "hit" for k in later)
    # row-invariant families continue after the reply's last fed row, others at the reply header
    for k in later:
        n_prev = cold[k[0], k[1] - 1][2].prompt_tokens
        expect = n_prev + 2 if info.invariant_rows else n_prev - 2
        assert resident[k][2].cached_tokens == expect, k
    assert restored[2, 0][2].cached_tokens == (8 if info.invariant_rows else 0)  # the system prompt's full page


def test_a_whole_prompt_hit_equals_cold_without_a_forward_for_its_first_token(runner):
    vocab = runner.info.vocab_size
    prompt = tuple((11 * i + 5) % vocab for i in range(19))
    other = tuple((3 * i + 1) % vocab for i in range(9))
    sampling = SamplingParams(temperature=0.9, seed=4)

    def run(engine, sid, tokens):
        starts = (16,) if len(tokens) > 16 else ()
        engine.submit(StreamRequest(sid, tokens, 3, sampling=sampling, chunk_starts=starts, want_logits=True))
        events = []
        while not engine.idle:
            events += engine.step()
            engine.check_integrity()
        tok = [ev for ev in events if isinstance(ev, TokenEvent)]
        return [i for ev in tok for i in ev.ids], [d for ev in tok for d in ev.logits_sha256], events[-1].usage

    cold = run(Engine(runner, SchedulerConfig(num_lanes=1, grid=8, cache=False)), 1, prompt)
    engine = Engine(runner, SchedulerConfig(num_lanes=1, grid=8, cache_budget_bytes=1 << 30))  # logits rows fit
    run(engine, 1, prompt)
    run(engine, 2, other)  # takes the lane: the prompt's lane is published
    ids, rows, usage = run(engine, 3, prompt)
    assert (usage.cache, usage.cached_tokens, usage.prefilled_tokens) == ("hit", 19, 0)
    assert ids == cold[0]
    assert len(rows) == len(ids) and rows == cold[1]
