"""Mode int4: codes that represent GGUF Q4_1 blocks, the kernel's meaning, and its row invariance."""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu.linear import INT4_GROUP, Int4Weight, int4_codes, linear, quantize_int4, quantize_int4_residual
from prefixd.gpu.model import check_mode

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="torch without the int4 CPU kernel")


def q4_1_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, q, d, m): x = d*q + m per group of 32, each group using codes 0 and 15 (as
    ggml's Q4_1 quantizer does); d and m are exact in bf16 so the codes can be exact too."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // INT4_GROUP, INT4_GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // INT4_GROUP, 1, generator=g) * 0.01 + 1e-4).to(torch.bfloat16).float()
    m = (-torch.rand(n, k // INT4_GROUP, 1, generator=g) * 0.05).to(torch.bfloat16).float()
    return torch.addcmul(m, d, q.float()).reshape(n, k), q.reshape(n, k), d[..., 0], m[..., 0]


def test_codes_of_q4_1_weights_are_the_blocks_own():
    weight, q, d, m = q4_1_weight(96, 128, seed=1)
    codes, scale, zero = int4_codes(weight)
    assert torch.equal(codes, q.to(torch.int32))
    assert torch.equal(scale, d)
    # zero = m + 8d rounded to bf16: dequantized weights differ from d*q + m by that rounding only
    assert torch.equal(zero, (m + 8 * d).to(torch.bfloat16).float())


def test_codes_refuse_inputs_not_a_multiple_of_the_group():
    with pytest.raises(ValueError, match="divisible by 32"):
        int4_codes(torch.zeros(8, 48))


def test_int4_linear_computes_x_times_the_dequantized_weight():
    weight, q, d, m = q4_1_weight(64, 256, seed=2)
    codes, scale, zero = int4_codes(weight)
    dequant = ((codes.float().reshape(64, -1, INT4_GROUP) - 8) * scale[..., None] + zero[..., None]).reshape(64, 256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    want = x.to(torch.bfloat16).double() @ dequant.double().T
    got = linear(x, quantize_int4(weight))
    assert got.dtype == torch.float32
    # bf16 output rounding only: a transposed scale layout or a wrong zero is off by far more
    assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 576), (3072, 576), (576, 1536)])
def test_int4_rows_have_the_same_bits_for_every_row_count(n, k):
    """The default model's projection shapes: the probe of bench/probe_cpu.py, kept as a test."""
    g = torch.Generator().manual_seed(n + k)
    weight = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(300, k, generator=g)
    ref = linear(x, weight)
    for m in (1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 64, 129, 256):
        assert torch.equal(linear(x[:m], weight), ref[:m]), f"{m} rows"
    assert torch.equal(linear(x.roll(7, 0), weight), ref.roll(7, 0)), "rows moved in the call"


def test_int4_mode_is_cpu_bf16_only():
    check_mode("int4", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="CPU in bf16 only"):
        check_mode("int4", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="not available"):
        check_mode("int3", torch.device("cpu"), torch.bfloat16)


ACCURACY_TEXT = ("The quick brown fox jumps over the lazy dog. " * 12
                 + "Once upon a time, in a small village by the sea, there lived an old fisherman who")


@pytest.mark.slow
def test_default_model_int4_agrees_with_its_exact_gguf_values(default_gguf):
    """Reference: fp32 mode (the GGUF's dequantized values, exact). bf16 mode measured 98.6 %
    top-1 and 0.068 mean |logit error| on this text; int4 100 % and 0.109 (docs/runtime.md)."""
    from tests.gpu.runner_helpers import lane_pages, make_runner, run_chunks

    logits = {}
    for dtype, mode in ((torch.float32, "invariant"), (torch.bfloat16, "int4")):
        runner = make_runner(default_gguf, dtype, mode=mode, num_lanes=1, num_pages=20)
        tokens = runner.tokenizer.encode(ACCURACY_TEXT)
        logits[mode] = run_chunks(runner, 0, tokens, lane_pages(0), [len(tokens)])
        del runner
    exact, int4 = logits["invariant"], logits["int4"]
    top1 = (exact.argmax(-1) == int4.argmax(-1)).float().mean().item()
    assert top1 >= 0.97, f"top-1 agreement {top1:.3f}"
    assert (exact - int4).abs().mean().item() <= 0.15


def test_auto_mode_is_int4_for_the_llama_families_on_cpu_bf16_only():
    import prefixd.gpu.families.qwen3_5  # noqa: F401 - registers the hybrid family
    from prefixd.gpu.families import resolve_mode

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_mode("auto", "llama", cpu, torch.bfloat16) == "int4"
    assert resolve_mode("auto", "qwen3", cpu, torch.bfloat16) == "int4"
    assert resolve_mode("auto", "llama", cpu, torch.float32) == "invariant"
    assert resolve_mode("auto", "llama", cuda, torch.bfloat16) == "invariant"
    assert resolve_mode("auto", "qwen3_5", cpu, torch.bfloat16) == "invariant"  # no int4 there
    assert resolve_mode("invariant", "llama", cpu, torch.bfloat16) == "invariant"


def test_residual_int4_keeps_about_eight_bits_where_one_layer_keeps_four():
    """The lm_head's two 4-bit layers: an error against the exact product many times below one
    4-bit layer's (measured 15x) and within a few times a bf16 weight's (measured 2.3x); a lost
    or misplaced error layer fails the first bound."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(512, 576, generator=g) * 0.05
    x = torch.randn(6, 576, generator=g)
    exact = x.to(torch.bfloat16).double() @ weight.double().T
    error = lambda w: (linear(x, w).double() - exact).abs().mean().item()  # noqa: E731
    one, two, bf16 = error(quantize_int4(weight)), error(quantize_int4_residual(weight)), error(weight.bfloat16())
    assert two * 10 < one, (one, two)
    assert two < 3 * bf16, (two, bf16)


def test_residual_int4_lm_head_rows_have_the_same_bits_for_every_row_count():
    """The lm_head shape of the default model (49152 x 576, read as 49152 x 1152)."""
    g = torch.Generator().manual_seed(6)
    weight = quantize_int4_residual(torch.randn(49152, 576, generator=g) * 0.05)
    x = torch.randn(40, 576, generator=g)
    ref = linear(x, weight)
    for m in (1, 2, 3, 4, 5, 8, 9, 17, 33):
        assert torch.equal(linear(x[:m], weight), ref[:m]), f"{m} rows"
    assert torch.equal(linear(x.roll(3, 0), weight), ref.roll(3, 0)), "rows moved in the call"


def test_int4_mode_runs_unpadded_rounds_and_a_two_layer_lm_head(tiny_llama_dir):
    from tests.gpu.runner_helpers import make_runner

    int4 = make_runner(tiny_llama_dir, torch.bfloat16, mode="int4", num_lanes=1, num_pages=8).model
    bf16 = make_runner(tiny_llama_dir, torch.bfloat16, mode="invariant", num_lanes=1, num_pages=8).model
    assert [int4.padded_rows(n) for n in (1, 2, 3, 5)] == [1, 2, 3, 5]
    assert [bf16.padded_rows(n) for n in (1, 2, 3, 5)] == [4, 4, 4, 5]
    assert isinstance(int4.lm_head, Int4Weight) and int4.lm_head.residual
    assert int4.lm_head.shape == tuple(bf16.lm_head.shape)


def test_the_disk_tier_keys_a_mode_on_its_revision():
    """int4's bits changed (two-layer lm_head, unpadded rows): its disk entries of revision 1
    must never be served."""
    from prefixd.gpu.families import mode_identity

    assert mode_identity("int4") == "int4@3"
    assert mode_identity("invariant") == "invariant@3"
    with pytest.raises(ValueError, match="no revision"):
        mode_identity("int3")
