"""Built-in llama-style families for the config registry: llama (+ mistral), qwen2, qwen3.

All three share one layout (HF names below); they differ in qkv bias (qwen2), per-head q/k
RMSNorm (qwen3) and in whether GGUF stores q/k rows permuted for llama.cpp's rope (llama).
"""

from __future__ import annotations

from typing import Any, Mapping

from prefixd.gpu.config import (
    GGUF_TENSOR_SHAPES_KEY,
    ConfigError,
    ModelConfig,
    RopeScaling,
    register_family,
)


_LLAMA_FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _req(src: Mapping[str, Any], key: str) -> Any:
    if key not in src or src[key] is None:
        raise ConfigError(key, "missing")
    return src[key]


def _rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either `rope_parameters` or the older rope_theta/rope_scaling."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or {}) or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(_req(scaling, "factor")))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(_req(scaling, "factor")),
            float(scaling.get("low_freq_factor", 1.0)),
            float(scaling.get("high_freq_factor", 4.0)),
            int(scaling.get("original_max_position_embeddings", 8192)),
        )
    raise ConfigError("rope_scaling", f"unsupported rope type {kind!r} (have: default, linear, llama3)")


def _llama_from_hf(cfg: dict) -> ModelConfig:
    model_type = cfg["model_type"]
    family = _LLAMA_FAMILIES[model_type]
    hidden, heads = int(_req(cfg, "hidden_size")), int(_req(cfg, "num_attention_heads"))
    if cfg.get("mlp_bias"):
        raise ConfigError("mlp_bias", "MLP biases are not supported")
    if family == "llama" and cfg.get("attention_bias"):
        raise ConfigError("attention_bias", "llama attention biases (incl. o_proj) are not supported")
    if family == "qwen2" and cfg.get("use_sliding_window"):
        raise ConfigError("use_sliding_window", "sliding-window attention is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError("hidden_act", f"unsupported activation {cfg.get('hidden_act')!r}")
    theta, scaling = _rope_from_hf(cfg)
    max_context = int(cfg.get("max_position_embeddings", 4096))
    window = cfg.get("sliding_window") if family == "llama" else None
    if window:
        # Contexts up to the window attend exactly as full attention does.
        max_context = min(max_context, int(window))
    return ModelConfig(
        family=family,
        vocab_size=int(_req(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_req(cfg, "intermediate_size")),
        num_layers=int(_req(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_context=max_context,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        extra={"model_type": model_type},
    )


def _rope_from_gguf(meta: Mapping[str, Any], arch: str) -> RopeScaling | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(_req(meta, f"{arch}.rope.scaling.factor")))
    raise ConfigError(f"{arch}.rope.scaling.type", f"unsupported rope scaling {kind!r}")


def _llama_from_gguf(meta: dict) -> ModelConfig:
    arch = str(meta["general.architecture"])
    shapes: Mapping[str, tuple[int, ...]] = meta.get(GGUF_TENSOR_SHAPES_KEY, {})
    hidden, heads = int(_req(meta, f"{arch}.embedding_length")), int(_req(meta, f"{arch}.attention.head_count"))
    embd = shapes.get("token_embd.weight")
    if embd is None:
        raise ConfigError("token_embd.weight", "missing tensor")
    ctx = int(meta.get(f"{arch}.context_length", 4096))
    window = meta.get(f"{arch}.attention.sliding_window")
    return ModelConfig(
        family=arch,
        vocab_size=int(embd[0]),
        hidden_size=hidden,
        intermediate_size=int(_req(meta, f"{arch}.feed_forward_length")),
        num_layers=int(_req(meta, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        rms_norm_eps=float(_req(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_from_gguf(meta, arch),
        max_context=min(ctx, int(window)) if window else ctx,
        tie_embeddings="output.weight" not in shapes,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        extra={"gguf_arch": arch},
    )


def _layer_names(i: int) -> dict[str, str]:
    """HF suffix -> GGUF name for layer i (every optional tensor included)."""
    hf, gg = f"model.layers.{i}.", f"blk.{i}."
    pairs = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    return {hf + k: gg + v for k, v in pairs.items()}


def _llama_tensor_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, c.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def _llama_gguf_names(c: ModelConfig) -> dict[str, str]:
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(c.num_layers):
        names.update(_layer_names(i))
    return {hf: gg for hf, gg in names.items() if hf in _llama_tensor_shapes(c)}


def _llama_unpermute(c: ModelConfig) -> dict[str, int]:
    """llama.cpp's llama converter permutes q/k rows; qwen2/qwen3 store them as HF does."""
    if c.family != "llama":
        return {}
    heads: dict[str, int] = {}
    for i in range(c.num_layers):
        heads[f"model.layers.{i}.self_attn.q_proj.weight"] = c.num_heads
        heads[f"model.layers.{i}.self_attn.k_proj.weight"] = c.num_kv_heads
    return heads


for _model_type, _family in _LLAMA_FAMILIES.items():
    register_family(
        _model_type,
        from_hf=_llama_from_hf,
        tensor_shapes=_llama_tensor_shapes,
        from_gguf=_llama_from_gguf if _model_type == _family else None,
        gguf_names=_llama_gguf_names,
        family=_family,
        gguf_unpermute=_llama_unpermute,
        build="prefixd.gpu.model:build_llama",
        modes=("invariant", "int4"),
    )
