"""Fixtures for tests/gpu: tiny random HF model directories beyond the shared ones (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tiny_models import TOKENIZER_VOCAB, make_tiny_hf_dir

PADDED_VOCAB = TOKENIZER_VOCAB + 64


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny qwen2 (qkv bias), untied embeddings, padded vocab (49216 rows), fp32 weights."""
    return make_tiny_hf_dir(
        tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=2, vocab_size=PADDED_VOCAB
    )


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny qwen3 (q/k RMSNorm), untied embeddings, 3 layers, vocab 49152, fp32 weights."""
    return make_tiny_hf_dir(
        tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=3, num_hidden_layers=3
    )
