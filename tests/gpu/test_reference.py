"""Our forward against transformers' (a reference nobody here wrote).

Tolerances: both sides compute in fp32 from the same dequantized weights, but sum in other
orders (our fused QKV / gate-up GEMMs, blocked attention with per-block sums, fp32 SiLU
product), so logits differ by accumulated rounding only: about 1e-5 relative. We allow
2e-3 absolute on logits of magnitude ~10-30 (1e-4 relative), far below any real bug (a wrong
rope layout, norm or mask moves logits by >0.1). Greedy continuations are compared fp32 vs
fp32: our bf16 weights are a different model at the bits level and may flip a near tie.
"""

from __future__ import annotations

import pytest
import torch

from prefixd.scheduler.records import LaneWork, RoundPlan
from tests.gpu.runner_helpers import make_runner, pages, prompt, run_chunks, start_sampler

LOGITS_ATOL = 2e-3

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "def add(a, b):\n    return a + b\n\nExplain this code."}],
    [{"role": "user", "content": "Translate 'good morning' into German and Spanish."}],
]


def hf_model(path):
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32).eval()


def greedy(runner, lane: int, ids: list[int], n: int) -> list[int]:
    """n greedy tokens: prefill in one chunk, then one row per round."""
    table = pages(12 * lane, 12)
    start_sampler(runner, lane)
    res = runner.run_round(RoundPlan((LaneWork(lane, 0, tuple(ids), table, True,
                                               sample_rows=(len(ids) - 1,)),)))
    out = [res.lanes[0].sampled[0]]
    while len(out) < n:
        w = LaneWork(lane, len(ids) + len(out) - 1, (out[-1],), table, False, sample_rows=(0,))
        out.append(runner.run_round(RoundPlan((w,))).lanes[0].sampled[0])
    return out


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def compare_logits(runner, model, n: int = 300) -> None:
    tokens = prompt(n, seed=21, vocab=runner.tokenizer.vocab_size)
    ours = run_chunks(runner, 0, tokens, pages(0), [37, n - 37])
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].float()
    assert ours.shape == ref.shape
    diff = float((ours - ref).abs().max())
    assert diff < LOGITS_ATOL, f"max |ours - transformers| = {diff}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def default_pair(default_gguf):
    return make_runner(default_gguf, torch.float32, num_pages=120), hf_model(default_gguf)


@pytest.mark.slow
def test_default_model_logits_close_to_transformers(default_pair):
    compare_logits(*default_pair)


@pytest.mark.slow
def test_default_model_greedy_32_tokens_equal_transformers(default_pair):
    runner, model = default_pair
    for lane, chat in enumerate(CHATS):
        ids = list(runner.tokenizer.render_chat(chat).ids)
        assert greedy(runner, lane % 8, ids, 32) == hf_greedy(model, ids, 32), f"chat {lane}"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_llama_dir"])
def test_tiny_models_match_transformers(request, family):
    path = request.getfixturevalue(family)
    runner = make_runner(path, torch.float32)
    model = hf_model(path)
    compare_logits(runner, model)
    ids = list(prompt(12, seed=22, vocab=runner.tokenizer.vocab_size))
    assert greedy(runner, 1, ids, 32) == hf_greedy(model, ids, 32)
