"""Hybrid-family weights rearranged for the forward: fused projections, (1 + w) norms."""

from __future__ import annotations

from typing import Mapping

import torch

from prefixd.gpu.families.qwen3_5_config import LINEAR, HybridConfig


def plus_one(w: torch.Tensor) -> torch.Tensor:
    """A zero-centred RMSNorm weight as the float32 factor it multiplies by."""
    return 1.0 + w.float()


def prepare_layer(config: HybridConfig, t: Mapping[str, torch.Tensor], i: int) -> dict:
    """Layer i's tensors (HF names in `t`, already on the device in the compute dtype).

    Projections that read the same input are concatenated: linear layers get one
    in_proj (qkv | z | b | a), attention layers one qkv, the MLP one gate_up. `slot` is the
    layer's index among its kind (state slot or KV layer).
    """
    c, p = config, f"model.layers.{i}."
    layer: dict = {
        "ln1": plus_one(t[p + "input_layernorm.weight"]),
        "ln2": plus_one(t[p + "post_attention_layernorm.weight"]),
        "gate_up": torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]]),
        "down": t[p + "mlp.down_proj.weight"],
    }
    if c.layer_types[i] == LINEAR:
        a = p + "linear_attn."
        layer["slot"] = c.linear_layers.index(i)
        layer["w_in"] = torch.cat([t[a + "in_proj_qkv.weight"], t[a + "in_proj_z.weight"],
                                   t[a + "in_proj_b.weight"], t[a + "in_proj_a.weight"]])
        layer["conv"] = t[a + "conv1d.weight"].float().squeeze(1).contiguous()  # (C, K)
        layer["a_log"] = t[a + "A_log"].float()
        layer["dt_bias"] = t[a + "dt_bias"].float()
        layer["norm"] = t[a + "norm.weight"]
        layer["w_out"] = t[a + "out_proj.weight"]
        return layer
    a = p + "self_attn."
    layer["slot"] = c.full_layers.index(i)
    layer["w_qkv"] = torch.cat([t[a + "q_proj.weight"], t[a + "k_proj.weight"],
                                t[a + "v_proj.weight"]])
    if c.attention_bias:
        layer["b_qkv"] = torch.cat([t[a + "q_proj.bias"], t[a + "k_proj.bias"],
                                    t[a + "v_proj.bias"]])
        layer["b_o"] = t[a + "o_proj.bias"]
    layer["q_norm"] = plus_one(t[a + "q_norm.weight"])
    layer["k_norm"] = plus_one(t[a + "k_norm.weight"])
    layer["w_o"] = t[a + "o_proj.weight"]
    return layer
