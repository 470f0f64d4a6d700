"""Mode int4: codes that represent GGUF Q4_1 blocks, the kernel's arithmetic bit for bit against a
torch reference, and its row invariance."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from prefixd.gpu import cpu_kernels
from prefixd.gpu.linear import (INT4_GROUP, Int4Weight, Int8Weight, dequantize_int4, int4_codes, int8_codes, linear,
                                quantize_int4, quantize_int4_residual, quantize_int8, scale_dtype)
from prefixd.gpu.model import check_mode

KERNEL_OK, KERNEL_WHY = cpu_kernels.available()
pytestmark = pytest.mark.skipif(not KERNEL_OK, reason=KERNEL_WHY)


def q4_1_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, q, d, m): x = d*q + m per group of 32, each group using codes 0 and 15 (as
    ggml's Q4_1 quantizer does); d and m are fp16, as a GGUF stores them (most not exact in bf16)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // INT4_GROUP, INT4_GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // INT4_GROUP, 1, generator=g) * 0.01 + 1e-4).to(torch.float16).float()
    m = (-torch.rand(n, k // INT4_GROUP, 1, generator=g) * 0.05).to(torch.float16).float()
    return torch.addcmul(m, d, q.float()).reshape(n, k), q.reshape(n, k), d[..., 0], m[..., 0]


def test_codes_of_q4_1_weights_are_the_blocks_own():
    """A GGUF Q4_1 block's fp16 d and m come back exactly (bf16 would round most of them), and
    the packed scales keep them as fp16."""
    weight, q, d, m = q4_1_weight(96, 128, seed=1)
    assert not torch.equal(d.bfloat16().float(), d)  # the case that needs fp16
    codes, scale, base = int4_codes(weight)
    assert torch.equal(codes, q.to(torch.int32))
    assert torch.equal(scale, d)
    assert torch.equal(base, m)
    assert torch.equal(dequantize_int4(codes, scale, base), weight)
    assert quantize_int4(weight).scales.dtype == torch.float16


def test_scales_fp16_would_hold_less_closely_than_bf16_stay_bf16():
    """Groups so small that fp16's subnormals keep fewer bits than bf16 (or too large for fp16):
    the whole weight's scales stay bf16, within bf16's rounding of the exact ones."""
    g = torch.Generator().manual_seed(4)
    for factor in (1e-7, 1e6):
        weight = torch.randn(64, 128, generator=g) * factor
        assert scale_dtype(torch.tensor([1e-3, factor])) == torch.bfloat16
        codes, scale, base = int4_codes(weight)
        groups = weight.reshape(64, 4, INT4_GROUP)
        exact = (groups.amax(-1) - groups.amin(-1)) / 15
        assert ((scale - exact).abs() <= exact.abs() * 2 ** -8).all()
        assert quantize_int4(weight).scales.dtype == torch.bfloat16
    assert scale_dtype(torch.tensor([1e-3, 0.0, -2.5])) == torch.float16


def test_packing_refuses_scales_neither_fp16_nor_bf16_holds():
    codes = torch.zeros(32, 32, dtype=torch.int32)
    scale = torch.full((32, 1), 1.0 + 2 ** -20)  # 21 significant bits
    with pytest.raises(ValueError, match="exact in fp16 or in bf16"):
        cpu_kernels.pack(codes, scale, torch.zeros(32, 1))


def test_codes_refuse_inputs_not_a_multiple_of_the_group():
    with pytest.raises(ValueError, match="divisible by 32"):
        int4_codes(torch.zeros(8, 48))


def reference_quantize(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, xq) of rows grouped (M, Gx, 32): d = amax / 127, xq = nearest-even(x / d), 0 where d is 0."""
    d = xf.abs().amax(-1) / 127
    return d, torch.where(d[..., None] > 0, torch.round(xf / torch.where(d > 0, d, 1)[..., None]), 0)


def reference_int4_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                      passes: int = 1) -> torch.Tensor:
    """csrc/int4_mm.cpp's arithmetic written with torch ops: x's rows quantized to 8 bits per
    group of 32, exact integer group products, then per group in order
    acc = acc + d * (float(dot) * scale + base * float(sum(xq))). With passes = 2, the same
    product of the rows' rounding error r = x - d * xq (one multiply, one subtract), quantized
    by the same rule, is added to it."""
    m, kx = x.shape
    n, k = codes.shape
    gx, groups = kx // INT4_GROUP, k // INT4_GROUP
    xf = x.float().reshape(m, gx, INT4_GROUP)
    quantized = [reference_quantize(xf)]
    if passes == 2:
        d, xq = quantized[0]
        quantized.append(reference_quantize(torch.where(d[..., None] > 0, xf - d[..., None] * xq, 0)))
    q = codes.to(torch.int64).reshape(n, groups, INT4_GROUP)
    out = None
    for d, xq in quantized:
        s = xq.sum(-1)  # small integers: exact
        acc = torch.zeros(m, n)
        for g in range(groups):
            j = g % gx
            dot = (xq[:, j].to(torch.int64) @ q[:, g].T).float()  # |dot| < 2^24: exact in fp32
            acc = acc + d[:, j:j + 1] * (dot * scale[:, g] + base[:, g] * s[:, j:j + 1])
        out = acc if out is None else out + acc
    return out


def kernel_paths() -> list[str]:
    return ["vnni", "portable"] if cpu_kernels.isa() == "avx512-vnni" else ["portable"]


@pytest.mark.parametrize(("magnitude", "scales_dtype"), [(0.05, torch.float16), (1e-7, torch.bfloat16)])
@pytest.mark.parametrize(("n", "k", "kx"), [(960, 576, 576), (576, 1536, 1536), (50, 64, 64), (1000, 1152, 576)])
def test_the_kernel_has_the_reference_arithmetics_bits_on_every_path(n, k, kx, magnitude, scales_dtype):
    """Bit for bit against `reference_int4_mm`: outputs not a multiple of 32, a residual weight
    (k = 2 kx: x read twice), bf16 and fp32 inputs, an all-zero row, every row count to 70, and
    scales held as fp16 (a model's) or bf16 (tiny weights)."""
    g = torch.Generator().manual_seed(n + k)
    codes, scale, base = int4_codes(torch.randn(n, k, generator=g) * magnitude)
    packed, scales = cpu_kernels.pack(codes, scale, base)
    assert scales.dtype == scales_dtype
    x = torch.randn(70, kx, generator=g) * 3
    x[5] = 0
    for dtype in (torch.bfloat16, torch.float32):
        xd = x.to(dtype)
        want = reference_int4_mm(xd, codes, scale, base)
        for path in kernel_paths():
            for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 33, 64, 65, 70):
                got = cpu_kernels.matmul(xd[:m], packed, scales, n, path)
                assert torch.equal(got.view(torch.int32), want[:m].view(torch.int32)), (dtype, path, m)


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize(("n", "k", "kx"), [(960, 576, 576), (50, 64, 64), (1000, 1152, 576)])
def test_the_8bit_kernel_has_the_reference_arithmetics_bits_on_every_path(n, k, kx, passes):
    """8-bit codes (the int4 lm_head's format), read by the same kernel with the same arithmetic,
    bit for bit against `reference_int4_mm` with codes 0..255: outputs not a multiple of 32, a
    weight wider than x, bf16 and fp32 inputs, an all-zero row, row counts to 70, one pass over
    the activations or two (the head's)."""
    g = torch.Generator().manual_seed(n + k + 8)
    codes, scale, base = int8_codes(torch.randn(n, k, generator=g) * 0.05)
    assert int(codes.min()) == 0 and int(codes.max()) == 255
    packed, scales = cpu_kernels.pack8(codes, scale, base)
    x = torch.randn(70, kx, generator=g) * 3
    x[5] = 0
    for dtype in (torch.bfloat16, torch.float32):
        xd = x.to(dtype)
        want = reference_int4_mm(xd, codes, scale, base, passes)
        for path in kernel_paths():
            for m in (1, 2, 3, 4, 5, 7, 8, 13, 33, 70):
                got = cpu_kernels.matmul(xd[:m], packed, scales, n, path, passes=passes)
                assert torch.equal(got.view(torch.int32), want[:m].view(torch.int32)), (dtype, path, m)


def test_two_passes_also_read_4bit_codes_and_a_normed_input_bit_for_bit():
    """passes = 2 is a property of the activations: 4-bit codes, a residual weight (x read
    twice) and the norm inside the call take it with the same arithmetic as the reference."""
    g = torch.Generator().manual_seed(12)
    codes, scale, base = int4_codes(torch.randn(100, 1152, generator=g) * 0.05)
    packed, scales = cpu_kernels.pack(codes, scale, base)
    x = torch.randn(9, 576, generator=g) * 4
    weight = torch.rand(576, generator=g) + 0.5
    want = reference_int4_mm(x, codes, scale, base, passes=2)
    codes1, scale1, base1 = int4_codes(torch.randn(64, 576, generator=g) * 0.05)
    packed1, scales1 = cpu_kernels.pack(codes1, scale1, base1)
    want_normed = reference_int4_mm(reference_rms_norm(x, weight, 1e-5), codes1, scale1, base1, passes=2)
    for path in kernel_paths():
        got = cpu_kernels.matmul(x, packed, scales, 100, path, passes=2)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), path
        got = cpu_kernels.matmul(x, packed1, scales1, 64, path, norm=(weight, 1e-5), passes=2)
        assert torch.equal(got.view(torch.int32), want_normed.view(torch.int32)), path
    with pytest.raises(RuntimeError, match="passes must be 1 or 2"):
        cpu_kernels.matmul(x, packed, scales, 100, passes=3)


def test_two_passes_over_the_activations_cut_their_rounding_error():
    """Against the exact product of the same 8-bit weight, a second pass (the activations'
    rounding error, quantized again) leaves many times less error than one pass; a lost or
    misplaced second pass (its d, its sums, its rows) fails the bound. Measured: 1/268."""
    g = torch.Generator().manual_seed(13)
    codes, scale, base = int8_codes(torch.randn(512, 576, generator=g) * 0.05)
    packed, scales = cpu_kernels.pack8(codes, scale, base)
    w = dequantize_int4(codes, scale, base)  # q * scale + base per group: the 8-bit weight's values
    x = torch.randn(6, 576, generator=g) * 3
    exact = x.double() @ w.double().T
    error = {p: (cpu_kernels.matmul(x, packed, scales, 512, passes=p).double() - exact).abs().mean().item()
             for p in (1, 2)}
    assert error[2] * 50 < error[1], error


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's norm: squares summed in 16 lanes by index, in order, joined by halvings."""
    m, k = x.shape
    lanes = torch.zeros(m, 16)
    for c in range(k // 16):
        part = x[:, 16 * c:16 * (c + 1)].float()
        lanes = lanes + part * part
    while lanes.shape[1] > 1:
        half = lanes.shape[1] // 2
        lanes = lanes[:, :half] + lanes[:, half:]
    # IEEE sqrt and 1 / root in fp32: torch's fp32 sqrt is not always correctly rounded, and
    # 1 / t divides in double; a double sqrt rounded to fp32 is the correctly rounded one
    root = torch.sqrt((lanes / k + eps).double()).float()
    inv = torch.ones_like(root) / root
    return (x.float() * inv) * weight


def test_the_norm_inside_the_kernel_is_the_reference_norm_then_the_product():
    g = torch.Generator().manual_seed(11)
    codes, scale, base = int4_codes(torch.randn(96, 576, generator=g) * 0.05)
    packed, scales = cpu_kernels.pack(codes, scale, base)
    x = torch.randn(9, 576, generator=g) * 4
    weight = torch.rand(576, generator=g) + 0.5
    want = reference_int4_mm(reference_rms_norm(x, weight, 1e-5), codes, scale, base)
    for path in kernel_paths():
        got = cpu_kernels.matmul(x, packed, scales, 96, path, norm=(weight, 1e-5))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), path
    # the same as torch's own RMSNorm up to its summation order
    torch.testing.assert_close(reference_rms_norm(x, weight, 1e-5),
                               torch.nn.functional.rms_norm(x, (576,), weight, 1e-5), rtol=1e-6, atol=1e-6)


def test_a_row_that_is_not_finite_spoils_its_own_outputs_only():
    g = torch.Generator().manual_seed(9)
    weight = quantize_int4(torch.randn(64, 128, generator=g) * 0.05)
    x = torch.randn(4, 128, generator=g)
    ref = linear(x, weight)
    x[2, 7] = float("nan")
    x[3, 100] = float("inf")
    got = linear(x, weight)
    assert torch.equal(got[:2], ref[:2])
    assert got[2:].isnan().all()


def test_the_kernels_bits_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(10)
    weight = quantize_int4(torch.randn(3072, 576, generator=g) * 0.05)
    x = torch.randn(40, 576, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, weight)
        torch.set_num_threads(max(2, threads))
        many = linear(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_int4_linear_computes_x_times_the_dequantized_weight():
    weight, q, d, m = q4_1_weight(64, 256, seed=2)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    want = x.double() @ weight.double().T
    got = linear(x, quantize_int4(weight))
    assert got.dtype == torch.float32
    # 8-bit activations: ~0.3 % of a group's largest input; a transposed scale layout, a lost
    # base or a misplaced nibble is off by far more
    scale = (x.abs().double() @ weight.abs().double().T)
    assert ((got.double() - want).abs() <= 0.01 * scale).all()


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
    top-1 and 0.068 mean |logit error| on this text; int4 99.3 % and 0.179 (revision 3, with
    bf16 activations and torch's attention: 100 % and 0.109; docs/runtime.md)."""
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
    assert (exact - int4).abs().mean().item() <= 0.25


def test_auto_mode_is_int4_for_the_llama_families_on_cpu_bf16_only():
    import prefixd.gpu.families.qwen3_5  # noqa: F401 - registers the hybrid family
    from prefixd.gpu.families import resolve_mode

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    fast = "int4" if cpu_kernels.fast() else "invariant"  # the portable paths are many times slower
    assert resolve_mode("auto", "llama", cpu, torch.bfloat16) == fast
    assert resolve_mode("auto", "qwen3", cpu, torch.bfloat16) == fast
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
    exact = x.double() @ weight.double().T
    error = lambda w: (linear(x, w).double() - exact).abs().mean().item()  # noqa: E731
    one, two, bf16 = error(quantize_int4(weight)), error(quantize_int4_residual(weight)), error(weight.bfloat16())
    assert two * 10 < one, (one, two)
    assert two < 3 * bf16, (two, bf16)


def test_int8_keeps_about_eight_bits_as_the_two_layers_do():
    """The lm_head's 8-bit codes: an error against the exact product many times below one 4-bit
    layer's and no more than about the two 4-bit layers' it replaced."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(512, 576, generator=g) * 0.05
    x = torch.randn(6, 576, generator=g)
    exact = x.double() @ weight.double().T
    error = lambda w: (linear(x, w).double() - exact).abs().mean().item()  # noqa: E731
    one, two, eight = error(quantize_int4(weight)), error(quantize_int4_residual(weight)), error(quantize_int8(weight))
    assert eight * 10 < one, (one, eight)
    assert eight < 1.5 * two, (eight, two)


@pytest.mark.parametrize("quantize", [quantize_int4_residual, quantize_int8, lambda w: quantize_int8(w, passes=2)],
                         ids=["two_4bit_layers", "8bit", "8bit_two_passes"])
def test_lm_head_rows_have_the_same_bits_for_every_row_count(quantize):
    """The lm_head shape of the default model (49152 x 576; two 4-bit layers are read as
    49152 x 1152), in each head format, the int4 mode's (8-bit, two passes) among them."""
    g = torch.Generator().manual_seed(6)
    weight = quantize(torch.randn(49152, 576, generator=g) * 0.05)
    x = torch.randn(40, 576, generator=g)
    ref = linear(x, weight)
    for m in (1, 2, 3, 4, 5, 8, 9, 17, 33):
        assert torch.equal(linear(x[:m], weight), ref[:m]), f"{m} rows"
    assert torch.equal(linear(x.roll(3, 0), weight), ref.roll(3, 0)), "rows moved in the call"


def test_int4_mode_runs_unpadded_rounds_and_an_8bit_lm_head(tiny_llama_dir):
    from tests.gpu.runner_helpers import make_runner

    int4 = make_runner(tiny_llama_dir, torch.bfloat16, mode="int4", num_lanes=1, num_pages=8).model
    bf16 = make_runner(tiny_llama_dir, torch.bfloat16, mode="invariant", num_lanes=1, num_pages=8).model
    assert [int4.padded_rows(n) for n in (1, 2, 3, 5)] == [1, 2, 3, 5]
    assert [bf16.padded_rows(n) for n in (1, 2, 3, 5)] == [4, 4, 4, 5]
    assert isinstance(int4.lm_head, Int8Weight) and int4.lm_head.passes == 2
    assert int4.lm_head.shape == tuple(bf16.lm_head.shape)


def test_int8_codes_of_q8_0_weights_are_the_blocks_own():
    """A GGUF Q8_0 block (x = d * q, q in -127..127, d fp16) on the symmetric grid: scale d,
    codes q + 128, the weights back exactly; other groups keep the finer asymmetric grid."""
    g = torch.Generator().manual_seed(6)
    d = (torch.rand(64, 4, 1, generator=g) * 0.01 + 1e-4).to(torch.float16).float()
    q = torch.randint(-127, 128, (64, 4, INT4_GROUP), generator=g)
    q[..., 0] = 127
    weight = (d * q).reshape(64, 128)
    codes, scale, base = int8_codes(weight)
    assert torch.equal(scale, d[..., 0]) and torch.equal(codes, (q + 128).reshape(64, 128).to(torch.int32))
    assert torch.equal(dequantize_int4(codes, scale, base), weight)
    skewed = torch.rand(8, 32, generator=g) * 0.05 + 0.01  # all positive: half the symmetric grid unused
    codes, scale, base = int8_codes(skewed)
    assert int(codes.min()) == 0 and int(codes.max()) == 255


def test_int4_packs_a_gguf_from_its_own_values_not_their_bf16_rounding(tmp_path, tiny_llama_dir):
    """Q8_0 embedding (the tied head) and Q4_1 projections, which a bf16 load rounds: int4's
    packs are made from the file's values (`Checkpoint.exact`), so the head's 8-bit codes give
    back the Q8_0 values exactly and the projections' codes are those of the Q4_1 values."""
    from gguf import GGMLQuantizationType as QT

    from prefixd.gpu.loading import load_checkpoint
    from prefixd.gpu.model import LlamaModel
    from tests.helpers.tiny_gguf import write_tiny_gguf

    qtypes = {"token_embd.weight": QT.Q8_0, "blk.0.attn_q.weight": QT.Q4_1, "blk.0.attn_k.weight": QT.Q4_1,
              "blk.0.attn_v.weight": QT.Q4_1, "blk.0.ffn_down.weight": QT.Q4_1}
    path = write_tiny_gguf(tmp_path / "q.gguf", tiny_llama_dir, qtypes=qtypes)
    cpu = torch.device("cpu")
    exact = load_checkpoint(path, device=cpu, dtype=torch.float32).tensors
    low = load_checkpoint(path, device=cpu, dtype=torch.bfloat16)
    embed = exact["model.embed_tokens.weight"]
    assert not torch.equal(low.tensors["model.embed_tokens.weight"].float(), embed)  # bf16 rounds it
    assert torch.equal(low.exact("model.embed_tokens.weight"), embed)
    assert low.exact("model.layers.0.input_layernorm.weight") is None  # stored plain: loaded as it is
    model = LlamaModel(low.config, dict(low.tensors), device=cpu, dtype=torch.bfloat16, mode="int4", exact=low.exact)
    codes, scale, base = int8_codes(embed)
    assert torch.equal(dequantize_int4(codes, scale, base), embed)
    want = cpu_kernels.pack8(codes, scale, base)
    assert torch.equal(model.lm_head.codes, want[0]) and torch.equal(model.lm_head.scales, want[1])
    a = "model.layers.0.self_attn."
    qkv = quantize_int4(torch.cat([exact[a + f"{n}_proj.weight"] for n in "qkv"]))
    assert torch.equal(model.layers[0].qkv.codes, qkv.codes) and torch.equal(model.layers[0].qkv.scales, qkv.scales)
    down = quantize_int4(exact["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(model.layers[0].down.codes, down.codes)


def test_int8_weights_take_9_bits_a_weight():
    n, k = 1000, 576  # 8-bit codes, a bf16 scale and base per 32 inputs, outputs padded to 32
    weight = quantize_int8(torch.randn(n, k))
    assert isinstance(weight, Int8Weight) and weight.nbytes == 32 * 32 * (k + k // 32 * 4)


def test_the_disk_tier_keys_a_mode_on_its_revision():
    """int4's bits changed (lately its 8-bit K/V pages): disk entries of an earlier
    revision must never be served."""
    from prefixd.gpu.families import mode_identity

    assert mode_identity("int4") == "int4@10"
    assert mode_identity("invariant") == "invariant@5"
    with pytest.raises(ValueError, match="no revision"):
        mode_identity("int3")


def test_without_a_compiler_auto_runs_invariant_and_int4_says_why(tmp_path):
    """A fresh process whose kernel cache is empty and whose compiler is missing: `auto` falls
    back with a note on stderr, an explicit int4 is refused with the reason."""
    code = """
import torch
from prefixd.gpu.families import resolve_mode
from prefixd.gpu.model import check_mode
print(resolve_mode("auto", "llama", torch.device("cpu"), torch.bfloat16))
try:
    check_mode("int4", torch.device("cpu"), torch.bfloat16)
except ValueError as exc:
    print("refused:", exc)
"""
    env = dict(os.environ, PREFIXD_KERNEL_DIR=str(tmp_path), CXX=str(tmp_path / "no-such-compiler"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "invariant"
    assert lines[1].startswith("refused: mode 'int4' needs prefixd's CPU kernel") and "no-such-compiler" in lines[1]
    assert "--mode auto runs the invariant mode" in done.stderr
    assert not list(tmp_path.glob("*.so"))


def one_call_and_loop(model, request, monkeypatch, host=True, **runner_args):
    """Two int4 runners of `model` ("tiny_llama" or "default"), the first running a round's
    layers in one call, its set-up built in the call from the lanes (`forward_host`) or, with
    `host` False, op by op in Python (`RoundInputs`, as a round with image rows takes it), the
    second the Python loop (`one_call = False`), and the list each one call appends to:
    whether it took the head too."""
    from tests.gpu.runner_helpers import make_runner

    spec = request.getfixturevalue("tiny_llama_dir" if model == "tiny_llama" else "default_gguf")
    calls = []
    real, real_rows = cpu_kernels.layers_int4, cpu_kernels.layers_int4_rows
    monkeypatch.setattr(cpu_kernels, "layers_int4", lambda *a, head=None: (calls.append(head is not None),
                                                                            real(*a, head=head))[1])
    monkeypatch.setattr(cpu_kernels, "layers_int4_rows", lambda *a, head=(): (calls.append(bool(head)),
                                                                               real_rows(*a, head=head))[1])
    runners = [make_runner(spec, torch.bfloat16, mode="int4", **runner_args) for _ in range(2)]
    runners[0].model.host_set_up = host
    runners[1].model.one_call = False
    assert runners[0].model.one_call and runners[0].model.host_rounds == host and not runners[1].model.host_rounds
    return runners, calls


@pytest.mark.parametrize("host", [True, False], ids=["set-up in the call", "set-up in Python"])
@pytest.mark.parametrize("model", ["tiny_llama", "default"])
def test_a_rounds_layers_in_one_call_have_the_python_loops_bits(model, host, request, monkeypatch):
    """Mode int4 runs a round's decoder layers as one call of the CPU kernels (csrc/layers.cpp):
    its logits and K/V are the Python loop's (`one_call = False`), bit for bit, over prefill
    chunks of three lanes, then decode rounds of all three together; every round wants every
    row's logits, so its call takes the final norm and the head too. The round's set-up (input
    rows, rope tables, buffers, attention index) is built in the call from the lanes' lists, or
    in Python from `RoundInputs`: the same bits. The tiny model's pages are bf16 (head_dim 16),
    the default model's 8-bit."""
    from prefixd.scheduler.records import RoundPlan
    from tests.gpu.runner_helpers import kv_equal, lane_pages, prompt, run_chunks, work

    runners, calls = one_call_and_loop(model, request, monkeypatch, host=host, num_lanes=3, num_pages=60)
    outs = []
    for runner in runners:
        logits = [run_chunks(runner, lane, prompt(19 + 7 * lane, seed=lane), lane_pages(lane), (8, 11 + 7 * lane))
                  for lane in range(3)]
        for step in range(3):
            plan = RoundPlan(tuple(work(lane, 19 + 7 * lane + step, (100 + step + lane,), lane_pages(lane), prefill=False)
                                   for lane in range(3)))
            logits += [r.logits for r in runner.run_round(plan).lanes]
        outs.append(logits)
    assert len(calls) == 6 + 3, "the one-call runner took the loop"
    assert all(calls), "every round here wants every row's logits: its call takes the head"
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for lane in range(3):
        assert kv_equal(runners[0], lane_pages(lane), runners[1], lane_pages(lane), 22 + 7 * lane)


@pytest.mark.parametrize("model", ["tiny_llama", "default"])
def test_one_call_layers_keep_the_loops_bits_where_a_lone_rows_keys_are_cut_between_threads(model, request, monkeypatch):
    """A lone lane past 1,536 keys on two threads: attention cuts its row's key chunks between
    the threads and joins them after (the one call's region runs those joins between barriers),
    and prefill chunks of 16 rows or more quantize a share of rows a thread. Decode logits and
    K/V are still the Python loop's, bit for bit."""
    from prefixd.scheduler.records import RoundPlan
    from tests.gpu.runner_helpers import kv_equal, pages, prompt, work

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runners, calls = one_call_and_loop(model, request, monkeypatch, num_lanes=1, num_pages=110)
        table, tokens = pages(0, 110), prompt(1700, seed=7)
        outs = []
        for runner in runners:
            for at, size in ((0, 600), (600, 600), (1200, 500)):
                runner.run_round(RoundPlan((work(0, at, tokens[at:at + size], table, all_logits=False),)))
            outs.append([runner.run_round(RoundPlan((work(0, 1700 + step, (200 + step,), table, prefill=False),))).lanes[0].logits
                         for step in range(3)])
        assert len(calls) == 6, "the one-call runner took the loop"
        assert calls == [False] * 3 + [True] * 3, "a prefill wanting its last row's logits keeps the head apart"
        for a, b in zip(*outs):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert kv_equal(runners[0], table, runners[1], table, 1703)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("model", ["tiny_llama", "default"])
def test_a_decode_rows_non_finite_logits_fail_its_lane_alone_where_the_call_takes_the_head(model, request, monkeypatch):
    """A decode round whose call takes the head: a row whose input embedding is NaN fails its
    lane with the runner's error, as on the Python loop's path, and the other lanes' logits are
    the loop's, bit for bit."""
    from prefixd.scheduler.records import RoundPlan
    from tests.gpu.runner_helpers import lane_pages, prompt, run_chunks, work

    runners, calls = one_call_and_loop(model, request, monkeypatch, num_lanes=3, num_pages=60)
    bad = 777  # the token lane 1 decodes: its embedding row is NaN
    outs = []
    for runner in runners:
        runner.model.embed[bad] = float("nan")
        for lane in range(3):
            run_chunks(runner, lane, prompt(20, seed=lane), lane_pages(lane), (20,))
        plan = RoundPlan(tuple(work(lane, 20, (bad if lane == 1 else 100 + lane,), lane_pages(lane), prefill=False)
                               for lane in range(3)))
        outs.append(runner.run_round(plan).lanes)
    assert calls[-1] and len(calls) == 4, "the decode round's call took the head"
    fused, loop = outs
    assert fused[1].error == loop[1].error == "the logits row at position 20 is not finite (NaN or inf)"
    for lane in (0, 2):
        assert fused[lane].error is None
        assert torch.equal(fused[lane].logits.view(torch.int32), loop[lane].logits.view(torch.int32))


@pytest.mark.parametrize("passes", [1, 2])
def test_the_heads_watch_is_each_rows_finite_flag_and_lowest_argmax_on_every_path(passes):
    """The head's call watches each row's outputs as its tiles store them: a flag, set where
    every output is finite, and the greedy pick, the lowest index of the largest output below a
    limit (numpy's argmax of the row's first `limit` outputs). Checked on both paths, with a tie
    at the maximum across blocks (outputs 10 and 500 share their weights; 500's block may be
    another thread's), limits inside a block, at a block's first column, at the vocabulary's
    end and at 0 (no pick), an all-zero row (every output ties), a row of NaN inputs (its flag
    alone falls), and an inf scale (every row's flag falls)."""
    g = torch.Generator().manual_seed(31 + passes)
    n, k = 1000, 576
    weights = torch.randn(n, k, generator=g) * 0.05
    weights[500] = weights[10]
    codes, scale, base = int8_codes(weights)
    base[[10, 500]] = 1.0  # positive rows' sums make these two the largest, tied
    packed, scales = cpu_kernels.pack8(codes, scale, base)
    x = torch.rand(12, k, generator=g) * 2
    x[3] = torch.randn(k, generator=g)  # a row of either sign: its maximum lies elsewhere
    x[5] = 0
    x[7, 100] = float("nan")
    for path in kernel_paths():
        for limit in (n, 977, 480, 32, 1, 0):
            finite, best = torch.empty(12, dtype=torch.uint8), torch.empty(12, dtype=torch.long)
            out = cpu_kernels.matmul(x, packed, scales, n, path, passes=passes, watch=(finite, best, limit))
            picks = cpu_kernels.head_picks(finite, best)
            assert finite.bool().tolist() == torch.isfinite(out).all(dim=1).tolist() == [r != 7 for r in range(12)]
            assert picks[7] == -1, "a row not finite has no pick"
            if limit == 0:
                continue
            want = out[:, :limit].numpy().argmax(axis=1).tolist()
            assert [p for r, p in enumerate(picks) if r != 7] == [w for r, w in enumerate(want) if r != 7], (path, limit)
            if limit > 500:
                assert picks[0] == 10 and out[0, 10] == out[0, 500] == out[0].max(), (path, limit)
            assert picks[5] == 0, "an all-zero row: every output ties, the lowest index wins"
    spoiled = scales.clone()
    spoiled[700 // 32, 0, 0, 700 % 32] = float("inf")
    for path in kernel_paths():
        finite, best = torch.empty(12, dtype=torch.uint8), torch.empty(12, dtype=torch.long)
        cpu_kernels.matmul(x, packed, spoiled, n, path, passes=passes, watch=(finite, best, n))
        assert finite.tolist() == [0] * 12 and cpu_kernels.head_picks(finite, best) == [-1] * 12, path


@pytest.mark.parametrize("host", [True, False], ids=["set-up in the call", "set-up in Python"])
@pytest.mark.parametrize("model", ["tiny_llama", "default"])
def test_greedy_lanes_take_the_heads_picks_and_every_lane_samples_as_the_loop_does(model, host, request, monkeypatch):
    """Where the one call takes the head it also picks each row's greedy token and screens the
    row as it stores it: a greedy lane with nothing else to apply (no penalty, grammar or
    logprobs) takes that pick without reading its logits, and the runner does not screen the
    rows again. A greedy lane with a repetition penalty and a sampled lane still sample from
    their rows. Every lane's tokens over four decode rounds are the Python loop's, whose
    runner samples every lane from its row."""
    from prefixd.gpu import runner as runner_module
    from prefixd.gpu.sampling import LaneSampler
    from prefixd.scheduler.records import LaneWork, RoundPlan, SamplerSetup, SamplingParams
    from tests.gpu.runner_helpers import lane_pages, prompt, run_chunks

    sampled_lanes, screened = [], []
    real_sample, real_screen = LaneSampler.sample, runner_module._finite_rows
    monkeypatch.setattr(LaneSampler, "sample", lambda self, row, pos: (sampled_lanes.append(self.params),
                                                                       real_sample(self, row, pos))[1])
    monkeypatch.setattr(runner_module, "_finite_rows", lambda logits: (screened.append(len(logits)),
                                                                     real_screen(logits))[1])
    runners, calls = one_call_and_loop(model, request, monkeypatch, host=host, num_lanes=3, num_pages=60)
    params = (SamplingParams(), SamplingParams(repetition_penalty=1.3), SamplingParams(temperature=0.8, seed=5))
    outs = []
    for runner in runners:
        histories = [prompt(20, seed=lane) for lane in range(3)]
        for lane in range(3):
            run_chunks(runner, lane, histories[lane], lane_pages(lane), (20,))
        runner.run_round(RoundPlan(samplers=tuple(SamplerSetup(lane, params[lane], histories[lane])
                                                  for lane in range(3))))
        sampled_lanes.clear()
        screened.clear()
        tokens = [[100 + lane] for lane in range(3)]
        for step in range(4):
            plan = RoundPlan(tuple(LaneWork(lane, 20 + step, (tokens[lane][-1],), lane_pages(lane), False,
                                            sample_rows=(0,)) for lane in range(3)))
            for lane, result in enumerate(runner.run_round(plan).lanes):
                assert result.error is None
                tokens[lane] += result.sampled
        outs.append((tokens, list(sampled_lanes), list(screened)))
    (one, one_sampled, one_screened), (loop, loop_sampled, loop_screened) = outs
    assert calls[-4:] == [True] * 4, "each decode round's call took the head"
    assert one == loop
    assert one_sampled == [params[1], params[2]] * 4, "the plain greedy lane read its row"
    assert loop_sampled == list(params) * 4
    assert one_screened == [] and loop_screened == [3] * 4


@pytest.mark.parametrize("column", [0, 20_000, 49_151])
def test_the_heads_watch_fails_every_lane_whose_row_holds_one_non_finite_logit(column, request, monkeypatch):
    """One head scale made inf gives every row one inf or NaN logit, in one column only (a
    block's first, one inside, the vocabulary's last): the call's flags fail every lane with the
    screen's error, as on the Python loop's path, greedy lanes included (their pick is not
    taken); a round whose logits are all finite fails none."""
    from prefixd.scheduler.records import LaneWork, RoundPlan
    from tests.gpu.runner_helpers import lane_pages, prompt, run_chunks, start_sampler

    runners, calls = one_call_and_loop("default", request, monkeypatch, num_lanes=2, num_pages=40)
    outs = []
    for runner in runners:
        for lane in range(2):
            run_chunks(runner, lane, prompt(20, seed=lane), lane_pages(lane), (20,))
            start_sampler(runner, lane, prompt(20, seed=lane))
        rounds = []
        for step, poisoned in enumerate((False, True)):
            if poisoned:
                scales = runner.model.lm_head.scales  # (NB, G, 2, 32): [nb, g, 0, c] the scale of output 32 nb + c
                scales[column // 32, 0, 0, column % 32] = float("inf")
            plan = RoundPlan(tuple(LaneWork(lane, 20 + step, (100 + lane,), lane_pages(lane), False, sample_rows=(0,))
                                   for lane in range(2)))
            rounds.append(runner.run_round(plan).lanes)
        outs.append(rounds)
    (clean, bad), (loop_clean, loop_bad) = outs
    assert calls[-2:] == [True, True], "the one call took the head in both decode rounds"
    for lane in range(2):
        assert clean[lane].error is None and clean[lane].sampled == loop_clean[lane].sampled
        assert bad[lane].error == loop_bad[lane].error == "the logits row at position 21 is not finite (NaN or inf)"
