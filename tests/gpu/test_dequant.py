"""Our vectorized GGUF dequantizers equal gguf.quants.dequantize (the package's reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from prefixd.gpu.loading.dequant import BLOCK_TYPES, SUPPORTED_TYPES, dequantize

# Byte offsets of the float16 scale fields in each block type.
_F16_FIELDS = {
    QT.Q8_0: (0,),
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}


def _random_blocks(qtype: QT, num_blocks: int, seed: int) -> np.ndarray:
    """Random block bytes whose float16 fields are finite (random bits elsewhere)."""
    rng = np.random.default_rng(seed)
    _, block_bytes, _ = BLOCK_TYPES[qtype]
    raw = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        scale = rng.uniform(-0.1, 0.1, size=num_blocks).astype(np.float16)
        raw[:, off : off + 2] = scale.view(np.uint8).reshape(num_blocks, 2)
    return raw


@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES, key=lambda q: q.name), ids=lambda q: q.name)
def test_block_types_equal_reference_bits(qtype: QT) -> None:
    block_elems, _, _ = BLOCK_TYPES[qtype]
    rows = 6
    per_row = 4
    raw = _random_blocks(qtype, rows * per_row, seed=int(qtype))
    shape = (rows, per_row * block_elems)  # torch order
    ref = quants.dequantize(raw.reshape(rows, -1), qtype)
    ours = dequantize(torch.from_numpy(raw.copy()), qtype, shape, torch.float32)
    assert ours.shape == shape
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda q: q.name)
def test_plain_types_equal_reference_bits(qtype: QT) -> None:
    rng = np.random.default_rng(7)
    values = rng.standard_normal((5, 64)).astype(np.float32)
    raw = quants.quantize(values, qtype) if qtype != QT.F32 else values
    raw_bytes = np.ascontiguousarray(raw).view(np.uint8)
    ref = quants.dequantize(raw_bytes.reshape(5, -1), qtype)
    ours = dequantize(torch.from_numpy(raw_bytes.copy()), qtype, (5, 64), torch.float32)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1], ids=lambda q: q.name)
def test_quantized_real_values_roundtrip_reference(qtype: QT) -> None:
    """Values quantized by gguf's own quantizer decode to the reference's values."""
    rng = np.random.default_rng(11)
    values = rng.standard_normal((3, 128)).astype(np.float32)
    raw = quants.quantize(values, qtype)
    ref = quants.dequantize(raw, qtype)
    ours = dequantize(torch.from_numpy(raw.copy()), qtype, (3, 128), torch.float32)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))


def test_bf16_output_is_rounded_float32_result() -> None:
    raw = _random_blocks(QT.Q4_1, 8, seed=3)
    as_f32 = dequantize(torch.from_numpy(raw.copy()), QT.Q4_1, (8, 32), torch.float32)
    as_bf16 = dequantize(torch.from_numpy(raw.copy()), QT.Q4_1, (8, 32), torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16, as_f32.to(torch.bfloat16))


def test_wrong_byte_count_and_unsupported_type_raise() -> None:
    raw = torch.zeros(33, dtype=torch.uint8)
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(raw, QT.Q8_0, (32,), torch.float32)
    assert QT.Q2_K not in SUPPORTED_TYPES
    with pytest.raises(ValueError, match="unsupported"):
        dequantize(torch.zeros(84, dtype=torch.uint8), QT.Q2_K, (256,), torch.float32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES, key=lambda q: q.name), ids=lambda q: q.name)
def test_cuda_dequantize_equals_cpu(qtype: QT) -> None:
    block_elems, _, _ = BLOCK_TYPES[qtype]
    raw = torch.from_numpy(_random_blocks(qtype, 64, seed=5).copy())
    shape = (8, 8 * block_elems)
    cpu = dequantize(raw, qtype, shape, torch.float32)
    cuda = dequantize(raw.to("cuda"), qtype, shape, torch.float32)
    assert torch.equal(cuda.cpu(), cpu)
