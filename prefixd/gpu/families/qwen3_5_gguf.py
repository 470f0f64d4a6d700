"""GGUF files of the hybrid family (general.architecture `qwen35`).

llama.cpp's converter stores a Qwen3.5 text model differently from Hugging Face:

- value heads of every linear layer in *tiled* order (v0 of each key group, then v1, ...)
  instead of HF's *grouped* order (all values of key group 0, then group 1, ...): the V
  rows of in_proj_qkv, the rows of in_proj_z / in_proj_a / in_proj_b, A_log, dt_bias, the
  V channels of conv1d and the input columns of out_proj;
- A_log as ssm_a = -exp(A_log); dt_bias as ssm_dt.bias; conv1d squeezed to (C, K);
- zero-centred RMSNorm weights as 1 + w (every norm except the GDN output norm).

The gguf package's `qwen35` tensor list has no NextN (MTP) tensors, so its converter drops
`mtp.*`; a file that does carry them (`qwen35.nextn_predict_layers` > 0) is read with the
NextN names other architectures use, MTP layer j as block num_layers + j.

`register` puts the family (HF and GGUF) in the registry; the GGUF fixup
undoes the three rewrites above on the loaded tensors. No torch import at module level.
"""

from __future__ import annotations

from typing import Any, Mapping

from prefixd.gpu.families.qwen3_5_config import (FULL, LINEAR, HybridConfig, HybridConfigError,
                                                 hybrid_config, model_config)

GGUF_ARCH = "qwen35"
_TENSOR_SHAPES_KEY = "prefixd.tensor_shapes"  # gpu.config.GGUF_TENSOR_SHAPES_KEY


def _req(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise HybridConfigError(f"GGUF metadata: missing key {key!r}")
    return meta[key]


def hybrid_config_from_gguf(meta: Mapping[str, Any]) -> HybridConfig:
    """HybridConfig from `qwen35.*` metadata (plus the tensor shapes the loader adds)."""
    a = GGUF_ARCH
    shapes: Mapping[str, tuple[int, ...]] = meta.get(_TENSOR_SHAPES_KEY, {})
    embd = shapes.get("token_embd.weight")
    if embd is None:
        raise HybridConfigError("GGUF: missing tensor 'token_embd.weight'")
    hidden, heads = int(_req(meta, f"{a}.embedding_length")), int(_req(meta, f"{a}.attention.head_count"))
    num_layers = int(_req(meta, f"{a}.block_count"))
    interval = int(meta.get(f"{a}.full_attention_interval", 4))
    head_dim = int(meta.get(f"{a}.attention.key_length") or hidden // heads)
    v_heads = int(_req(meta, f"{a}.ssm.time_step_rank"))
    return HybridConfig(
        vocab_size=int(embd[0]), hidden_size=hidden,
        intermediate_size=int(_req(meta, f"{a}.feed_forward_length")),
        layer_types=tuple(LINEAR if (i + 1) % interval else FULL for i in range(num_layers)),
        num_heads=heads, num_kv_heads=int(meta.get(f"{a}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(_req(meta, f"{a}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{a}.rope.freq_base", 10000.0)),
        partial_rotary_factor=int(meta.get(f"{a}.rope.dimension_count", head_dim // 4)) / head_dim,
        max_context=int(meta.get(f"{a}.context_length", 32768)),
        tie_embeddings="output.weight" not in shapes, attention_bias=False,
        conv_kernel=int(_req(meta, f"{a}.ssm.conv_kernel")),
        lin_num_k_heads=int(_req(meta, f"{a}.ssm.group_count")), lin_num_v_heads=v_heads,
        lin_k_dim=int(_req(meta, f"{a}.ssm.state_size")),
        lin_v_dim=int(_req(meta, f"{a}.ssm.inner_size")) // v_heads,
        num_mtp_layers=int(meta.get(f"{a}.nextn_predict_layers", 0)),
    )


_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


# MTP layer j is block num_layers + j, as llama.cpp's NextN tensors (gguf MODEL_TENSOR.NEXTN_*)
_MTP = {"fc.weight": "nextn.eh_proj.weight", "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
        "pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "norm.weight": "nextn.shared_head_norm.weight"}


def gguf_names(config: HybridConfig) -> dict[str, str]:
    """HF name -> GGUF name for every tensor `config` expects."""
    from prefixd.gpu.families.qwen3_5_config import hybrid_tensor_shapes

    out = {}
    for name in hybrid_tensor_shapes(config):
        if name in _GLOBAL:
            out[name] = _GLOBAL[name]
        elif name.startswith("mtp.layers."):
            layer, suffix = name[len("mtp.layers."):].split(".", 1)
            out[name] = f"blk.{config.num_layers + int(layer)}.{_LAYER[suffix]}"
        elif name.startswith("mtp."):  # shared by the MTP layers: stored on the first
            out[name] = f"blk.{config.num_layers}.{_MTP[name[len('mtp.'):]]}"
        else:
            layer, suffix = name[len("model.layers."):].split(".", 1)
            out[name] = f"blk.{layer}.{_LAYER[suffix]}"
    return out


def tiled_to_grouped(num_k_heads: int, num_v_heads: int, head_dim: int):
    """Index i of the HF (grouped) order -> its position in the GGUF (tiled) order, over
    num_v_heads * head_dim rows: `gguf_rows[index]` gives the rows in HF order."""
    import torch

    per_k = num_v_heads // num_k_heads
    grouped = torch.arange(num_v_heads * head_dim).view(num_k_heads, per_k, head_dim)
    return grouped.transpose(0, 1).reshape(-1).argsort()


def fixup(config: HybridConfig, tensors: dict[str, Any]) -> None:
    """Undo llama.cpp's storage rewrites on loaded tensors, in place (see module doc)."""
    c = config
    for name in list(tensors):
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensors[name] = tensors[name] - 1
        elif name.endswith("linear_attn.A_log"):
            tensors[name] = (-tensors[name].float()).log().to(tensors[name].dtype)
    if c.lin_num_k_heads == c.lin_num_v_heads:
        return
    heads = tiled_to_grouped(c.lin_num_k_heads, c.lin_num_v_heads, 1)
    values = tiled_to_grouped(c.lin_num_k_heads, c.lin_num_v_heads, c.lin_v_dim)
    qk = 2 * c.lin_key_dim
    for i in c.linear_layers:
        p = f"model.layers.{i}.linear_attn."
        qkv = tensors[p + "in_proj_qkv.weight"]
        tensors[p + "in_proj_qkv.weight"] = _reorder_tail(qkv, qk, values)
        conv = tensors[p + "conv1d.weight"]
        tensors[p + "conv1d.weight"] = _reorder_tail(conv, qk, values)
        tensors[p + "in_proj_z.weight"] = tensors[p + "in_proj_z.weight"][values.to(qkv.device)]
        for name in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
            tensors[p + name] = tensors[p + name][heads.to(qkv.device)]
        out = tensors[p + "out_proj.weight"]
        tensors[p + "out_proj.weight"] = out[:, values.to(out.device)]


def _reorder_tail(t, start: int, index):
    """t with its rows [start:] taken in `index` order (the V part of a q|k|v stack)."""
    import torch

    return torch.cat([t[:start], t[start:][index.to(t.device)]])


def register() -> None:
    """Register `qwen3_5_text` (HF directories) and GGUF architecture `qwen35`, run by
    `qwen3_5.build_qwen3_5` (mode invariant only)."""
    from prefixd.gpu.config import register_family
    from prefixd.gpu.families.qwen3_5_config import hybrid_config_from_hf, hybrid_tensor_shapes

    register_family(
        "qwen3_5_text",
        from_hf=lambda raw: model_config(hybrid_config_from_hf(raw)),
        tensor_shapes=lambda mc: hybrid_tensor_shapes(hybrid_config(mc)),
        family="qwen3_5",
        from_gguf=lambda meta: model_config(hybrid_config_from_gguf(meta)),
        gguf_arch=GGUF_ARCH,
        gguf_names=lambda mc: gguf_names(hybrid_config(mc)),
        gguf_fixup=lambda mc, tensors: fixup(hybrid_config(mc), tensors),
        build="prefixd.gpu.families.qwen3_5:build_qwen3_5",
    )
