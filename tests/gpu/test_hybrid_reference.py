"""The hybrid family against transformers' own Qwen3_5ForCausalLM (tiny random models).

Tolerance: both sides compute in float32; ours differs only in summation order (GEMM
blocking, the chunked UT solve, blocked conv taps), which moves logits by ~1e-6 here.
We allow ATOL = 1e-4 on logits whose spread is O(1), and require greedy tokens identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prefixd.gpu.config import config_from_hf, tensor_shapes
from prefixd.gpu.families.qwen3_5 import HybridModel
from prefixd.gpu.families.qwen3_5_config import hybrid_config
from prefixd.gpu.families.qwen3_5_tiny import make_tiny_hybrid_dir
from prefixd.gpu.kv_pool import KVPool
from prefixd.scheduler.records import LaneWork

pytestmark = pytest.mark.slow

ATOL = 1e-4
CONFIGS = {
    "conv4-gqa-untied": dict(initializer_range=0.1),
    "conv2-mqa-tied-interval2": dict(initializer_range=0.1, linear_conv_kernel_dim=2,
                                     num_key_value_heads=1, tie_word_embeddings=True,
                                     num_hidden_layers=5, layer_types=None,
                                     full_attention_interval=2, linear_num_key_heads=1),
    "conv3-equal-heads-odd-dims": dict(initializer_range=0.1, linear_conv_kernel_dim=3,
                                       hidden_size=48, num_attention_heads=3, num_key_value_heads=3,
                                       head_dim=32, linear_num_key_heads=3, linear_num_value_heads=3,
                                       linear_key_head_dim=8, linear_value_head_dim=16,
                                       partial_rotary_factor=0.5, intermediate_size=96),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(transformers model loaded back from the HF dir, our model built from the same dir)."""
    from safetensors.torch import load_file
    from transformers import Qwen3_5ForCausalLM

    overrides = {k: v for k, v in CONFIGS[request.param].items() if v is not None}
    if "full_attention_interval" in overrides:
        n, every = overrides["num_hidden_layers"], overrides.pop("full_attention_interval")
        overrides["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                    for i in range(n)]
    if "partial_rotary_factor" in overrides:
        overrides["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                        "partial_rotary_factor": overrides.pop("partial_rotary_factor")}
    path = make_tiny_hybrid_dir(tmp_path_factory.mktemp(request.param), seed=5, **overrides)
    ref = Qwen3_5ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    config = config_from_hf(json.loads((Path(path) / "config.json").read_text()))
    tensors = load_file(str(Path(path) / "model.safetensors"))
    expected = tensor_shapes(config)
    assert {k: tuple(v.shape) for k, v in tensors.items() if k in expected} == expected
    cpu = torch.device("cpu")
    ours = HybridModel(hybrid_config(config), tensors, device=cpu, dtype=torch.float32)
    ours.new_lane_states(1)
    kv = KVPool(num_layers=ours.num_kv_layers, num_pages=32, page_size=16,
                num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, device=cpu,
                dtype=torch.float32)
    return ref, (ours, kv)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ours(ours: tuple[HybridModel, KVPool], tokens: list[int], start: int, prefill: bool) -> torch.Tensor:
    model, kv = ours
    work = LaneWork(lane=0, start=start, tokens=tuple(tokens), page_table=tuple(range(32)),
                    prefill=prefill)
    return model.logits(model.forward_works([work], kv))


def _theirs(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


def test_config_and_tensor_names_come_from_the_registry(pair) -> None:
    _, (ours, _) = pair
    assert ours.hybrid.layer_types.count("full_attention") >= 1
    assert ours.config.family == "qwen3_5" and ours.invariant_rows is False


def test_logits_match_after_a_prompt(pair) -> None:
    ref, ours = pair
    ours[0].reset(0)
    prompt = _prompt(77)
    want = _theirs(ref, prompt)
    assert want.std() > 0.05  # logits spread enough for the tolerance to mean something
    torch.testing.assert_close(_ours(ours, prompt, 0, True), want, atol=ATOL, rtol=0)


def test_logits_match_after_chunked_prefill_and_while_decoding(pair) -> None:
    ref, ours = pair
    ours[0].reset(0)
    tokens = _prompt(150, seed=1)
    want = _theirs(ref, tokens)
    got, lo = [], 0
    for hi in (13, 77, 141):  # odd chunk sizes crossing the 32-row UT blocks
        got.append(_ours(ours, tokens[lo:hi], lo, True))
        lo = hi
    for pos in range(141, 150):  # then one decode row at a time
        got.append(_ours(ours, tokens[pos:pos + 1], pos, False))
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)


def test_greedy_32_tokens_identical(pair) -> None:
    ref, ours = pair
    for seed in range(1):
        ours[0].reset(0)
        prompt = _prompt(21 + 17 * seed, seed=10 + seed)
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                min_new_tokens=32, pad_token_id=0)[0, len(prompt):].tolist()
        logits = _ours(ours, prompt, 0, True)
        got = []
        for _ in range(32):
            got.append(int(logits[-1].argmax()))
            logits = _ours(ours, got[-1:], len(prompt) + len(got) - 1, False)
        assert got == want
