"""Random-weight hybrid models for tests and benchmarks.

`tiny_hf_config` gives a small `qwen3_5_text` config.json dict; `make_tiny_hybrid_dir` saves
a transformers `Qwen3_5ForCausalLM` with random weights (norm weights and gates perturbed so
every parameter matters) as a Hugging Face directory. transformers is imported lazily: it is
a test-only dependency of this family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_hf_config(**overrides: Any) -> dict[str, Any]:
    """A small Qwen3.5 text config: 4 layers (3 linear + 1 full), GQA, conv width 4."""
    fields: dict[str, Any] = {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }
    fields.update(overrides)
    return fields


def make_tiny_hybrid_model(seed: int = 0, **overrides: Any):
    """A transformers Qwen3_5ForCausalLM (float32, eval) with seeded random weights."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**tiny_hf_config(**overrides))
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("dt_bias"):
                param.add_(0.5 * torch.randn_like(param))
    return model


def make_tiny_hybrid_dir(path: Path, seed: int = 0, mtp_layers: int = 0, **overrides: Any) -> Path:
    """Save `make_tiny_hybrid_model(seed, **overrides)` as an HF directory at `path`; with
    `mtp_layers` > 0 the checkpoint also ships that many random MTP layers (`mtp.*`, which
    transformers ignores on load) and config.json says `mtp_num_hidden_layers`."""
    model = make_tiny_hybrid_model(seed, **overrides)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    if mtp_layers:
        _add_mtp(path, mtp_layers, seed)
    return path


def _add_mtp(path: Path, num_layers: int, seed: int) -> None:
    import json

    from safetensors.torch import load_file, save_file

    from prefixd.gpu.families.qwen3_5_config import hybrid_config_from_hf, mtp_tensor_shapes

    raw = json.loads((path / "config.json").read_text())
    raw["mtp_num_hidden_layers"] = num_layers
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    shapes = mtp_tensor_shapes(hybrid_config_from_hf(raw))
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update(_random(shapes, seed=seed + 1000, scale=0.1))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _random(shapes: dict, *, seed: int, scale: float) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {name: (0.1 if name.endswith("norm.weight") else scale) * torch.randn(shape, generator=gen)
            for name, shape in sorted(shapes.items())}


def random_tensors(config, *, seed: int = 0, dtype=None, scale: float = 0.02) -> dict:
    """Random weights for a HybridConfig without transformers (tests and benches).

    Matrices ~ N(0, scale), norm weights ~ N(0, 0.1) (zero-centred norms), A_log and
    dt_bias in the ranges transformers initialises them to.
    """
    import torch

    from prefixd.gpu.families.qwen3_5_config import hybrid_tensor_shapes

    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    out = {}
    for name, shape in sorted(hybrid_tensor_shapes(config).items()):
        if name.endswith("A_log"):
            w = torch.empty(shape).uniform_(0.01, 16, generator=gen).log()
        elif name.endswith("dt_bias"):
            w = 1.0 + 0.5 * torch.randn(shape, generator=gen)
        elif name.endswith("linear_attn.norm.weight"):  # the gated norm is not zero-centred
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("norm.weight"):
            w = 0.1 * torch.randn(shape, generator=gen)
        else:
            w = scale * torch.randn(shape, generator=gen)
        out[name] = w.to(dtype)
    return out
