"""Configuration of the hybrid family `qwen3_5` (transformers model_type `qwen3_5_text`).

No torch here: this module parses a Hugging Face config.json dict into a frozen
`HybridConfig` and lists the tensor names and shapes a checkpoint must hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from prefixd.gpu.config import ModelConfig

LINEAR = "linear_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class HybridConfig:
    """Shapes of a Qwen3.5-style model: Gated DeltaNet layers mixed with gated attention."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int  # full attention query heads
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_context: int
    tie_embeddings: bool
    attention_bias: bool
    conv_kernel: int  # linear_conv_kernel_dim
    lin_num_k_heads: int
    lin_num_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    num_mtp_layers: int = 0  # multi-token-prediction layers the checkpoint ships (mtp.*)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def lin_key_dim(self) -> int:
        return self.lin_num_k_heads * self.lin_k_dim

    @property
    def lin_value_dim(self) -> int:
        return self.lin_num_v_heads * self.lin_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v of the linear layers."""
        return 2 * self.lin_key_dim + self.lin_value_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)


class HybridConfigError(ValueError):
    """config.json does not describe a model this family can run."""


def _text_fields(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    # a multimodal qwen3_5 config nests the text model under text_config
    if raw.get("model_type") != "qwen3_5_text" and isinstance(raw.get("text_config"), dict):
        return raw["text_config"]
    return raw


def hybrid_config_from_hf(raw: Mapping[str, Any]) -> HybridConfig:
    """Parse a `qwen3_5_text` config.json dict; raises HybridConfigError naming the key."""
    d = _text_fields(raw)
    try:
        num_layers = int(d["num_hidden_layers"])
        layer_types = d.get("layer_types")
        if layer_types is None:
            interval = int(d.get("full_attention_interval", 4))
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
        rope = d.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
        num_heads = int(d["num_attention_heads"])
        config = HybridConfig(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            layer_types=tuple(str(t) for t in layer_types),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads", num_heads)),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            partial_rotary_factor=partial,
            max_context=int(d.get("max_position_embeddings", 32768)),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            conv_kernel=int(d.get("linear_conv_kernel_dim", 4)),
            lin_num_k_heads=int(d.get("linear_num_key_heads", 16)),
            lin_num_v_heads=int(d.get("linear_num_value_heads", 32)),
            lin_k_dim=int(d.get("linear_key_head_dim", 128)),
            lin_v_dim=int(d.get("linear_value_head_dim", 128)),
            num_mtp_layers=int(d.get("mtp_num_hidden_layers", 0)),
        )
    except KeyError as exc:
        raise HybridConfigError(f"config.json: missing key {exc.args[0]!r}") from None
    _check(config, d)
    return config


def _check(config: HybridConfig, d: Mapping[str, Any]) -> None:
    if len(config.layer_types) != int(d["num_hidden_layers"]):
        raise HybridConfigError("config.json: layer_types length differs from num_hidden_layers")
    unknown = set(config.layer_types) - {LINEAR, FULL}
    if unknown:
        raise HybridConfigError(f"config.json: unknown layer_types {sorted(unknown)}")
    if config.lin_num_v_heads % config.lin_num_k_heads:
        raise HybridConfigError("config.json: linear_num_value_heads not a multiple of key heads")
    if config.num_heads % config.num_kv_heads:
        raise HybridConfigError("config.json: num_attention_heads not a multiple of kv heads")
    if config.rotary_dim % 2:
        raise HybridConfigError("config.json: head_dim * partial_rotary_factor must be even")
    if d.get("hidden_act", "silu") != "silu":
        raise HybridConfigError(f"config.json: hidden_act {d.get('hidden_act')!r} (need silu)")


def hybrid_tensor_shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names -> shapes for this config."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                                          "model.norm.weight": (c.hidden_size,)}
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        if kind == LINEAR:
            a = p + "linear_attn."
            shapes[a + "in_proj_qkv.weight"] = (c.conv_dim, c.hidden_size)
            shapes[a + "in_proj_z.weight"] = (c.lin_value_dim, c.hidden_size)
            shapes[a + "in_proj_b.weight"] = (c.lin_num_v_heads, c.hidden_size)
            shapes[a + "in_proj_a.weight"] = (c.lin_num_v_heads, c.hidden_size)
            shapes[a + "conv1d.weight"] = (c.conv_dim, 1, c.conv_kernel)
            shapes[a + "dt_bias"] = (c.lin_num_v_heads,)
            shapes[a + "A_log"] = (c.lin_num_v_heads,)
            shapes[a + "norm.weight"] = (c.lin_v_dim,)
            shapes[a + "out_proj.weight"] = (c.hidden_size, c.lin_value_dim)
        else:
            a = p + "self_attn."
            shapes[a + "q_proj.weight"] = (2 * c.num_heads * c.head_dim, c.hidden_size)
            shapes[a + "k_proj.weight"] = (c.num_kv_heads * c.head_dim, c.hidden_size)
            shapes[a + "v_proj.weight"] = (c.num_kv_heads * c.head_dim, c.hidden_size)
            shapes[a + "o_proj.weight"] = (c.hidden_size, c.num_heads * c.head_dim)
            shapes[a + "q_norm.weight"] = (c.head_dim,)
            shapes[a + "k_norm.weight"] = (c.head_dim,)
            if c.attention_bias:
                shapes[a + "q_proj.bias"] = (2 * c.num_heads * c.head_dim,)
                shapes[a + "k_proj.bias"] = (c.num_kv_heads * c.head_dim,)
                shapes[a + "v_proj.bias"] = (c.num_kv_heads * c.head_dim,)
                shapes[a + "o_proj.bias"] = (c.hidden_size,)
    shapes.update(mtp_tensor_shapes(c))
    return shapes


def mtp_tensor_shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the multi-token-prediction head (none when the config has no MTP
    layer): fc over [norm(embedding) | norm(hidden)], one gated-attention decoder layer per
    MTP layer with the main layers' names under `mtp.layers.{j}.`, and a final norm."""
    c = config
    if c.num_mtp_layers == 0:
        return {}
    h = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    q, kv = 2 * c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for j in range(c.num_mtp_layers):
        p = f"mtp.layers.{j}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, h),
            p + "mlp.up_proj.weight": (c.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, c.intermediate_size),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, c.num_heads * c.head_dim),
            p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)})
        if c.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)})
    return shapes


def model_config(config: HybridConfig) -> "ModelConfig":
    """The runtime-wide ModelConfig of a hybrid model; the HybridConfig rides in extra."""
    from prefixd.gpu.config import ModelConfig

    c = config
    return ModelConfig(
        family="qwen3_5", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=c.num_layers, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, rope_scaling=None, max_context=c.max_context,
        tie_embeddings=c.tie_embeddings, attention_bias=c.attention_bias, qk_norm=True,
        extra={"hybrid": c},
    )


def hybrid_config(config: "ModelConfig") -> HybridConfig:
    """The HybridConfig carried by a qwen3_5 ModelConfig."""
    hybrid = config.extra.get("hybrid")
    if not isinstance(hybrid, HybridConfig):
        raise ValueError(f"ModelConfig of family {config.family!r} carries no HybridConfig")
    return hybrid
