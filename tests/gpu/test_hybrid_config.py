"""Parsing qwen3_5_text config.json dicts and registering the family."""

from __future__ import annotations

import pytest

from prefixd.gpu.config import config_from_hf, tensor_shapes
from prefixd.gpu.families.qwen3_5_config import (FULL, LINEAR, HybridConfigError,
                                                 hybrid_config, hybrid_config_from_hf)
from prefixd.gpu.families.qwen3_5_tiny import tiny_hf_config


def _raw(**overrides) -> dict:
    return {"model_type": "qwen3_5_text", **tiny_hf_config(**overrides)}


def test_registry_builds_a_qwen3_5_model_config() -> None:
    config = config_from_hf(_raw())
    hybrid = hybrid_config(config)
    assert config.family == "qwen3_5" and config.qk_norm and config.num_layers == 4
    assert hybrid.layer_types == (LINEAR, LINEAR, LINEAR, FULL)
    assert hybrid.conv_dim == 2 * 2 * 16 + 4 * 8 and hybrid.rotary_dim == 4
    shapes = tensor_shapes(config)
    assert shapes["model.layers.0.linear_attn.conv1d.weight"] == (96, 1, 4)
    assert shapes["model.layers.3.self_attn.q_proj.weight"] == (2 * 4 * 16, 64)
    assert "model.layers.3.linear_attn.A_log" not in shapes


def test_layer_types_default_to_every_fourth_layer_full() -> None:
    raw = _raw(num_hidden_layers=8)
    raw.pop("layer_types", None)
    assert hybrid_config_from_hf(raw).full_layers == (3, 7)
    raw["full_attention_interval"] = 2
    assert hybrid_config_from_hf(raw).full_layers == (1, 3, 5, 7)


def test_rope_parameters_give_theta_and_partial_rotary() -> None:
    raw = _raw(rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                "partial_rotary_factor": 0.5})
    config = hybrid_config_from_hf(raw)
    assert (config.rope_theta, config.rotary_dim) == (5e6, 8)


@pytest.mark.parametrize("change, key", [
    ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_configs_name_the_key(change: dict, key: str) -> None:
    with pytest.raises(HybridConfigError, match=key):
        hybrid_config_from_hf(_raw(**change))


def test_missing_key_is_named() -> None:
    raw = _raw()
    del raw["hidden_size"]
    with pytest.raises(HybridConfigError, match="hidden_size"):
        hybrid_config_from_hf(raw)
