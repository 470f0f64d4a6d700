"""A qwen35 GGUF, written the way llama.cpp's converter lays out Qwen3.5, loads to the same
model as its Hugging Face directory."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from prefixd.gpu.families.qwen3_5 import HybridModel
from prefixd.gpu.families.qwen3_5_config import hybrid_config, hybrid_config_from_hf
from prefixd.gpu.families.qwen3_5_gguf import gguf_names
from prefixd.gpu.kv_pool import KVPool
from prefixd.gpu.loading import load_checkpoint
from prefixd.scheduler.records import LaneWork
from tests.helpers.tiny_models import make_tiny_hybrid_hf_dir

VOCAB = 49152
K_HEADS, V_HEADS, V_DIM, K_DIM = 2, 4, 8, 16


def _grouped_to_tiled(t: torch.Tensor, head_dim: int, dim: int = 0) -> torch.Tensor:
    """HF value-head order -> llama.cpp's tiled order along `dim`."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], K_HEADS, V_HEADS // K_HEADS, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _as_llama_cpp(name: str, t: torch.Tensor) -> torch.Tensor:
    """The tensor as the converter stores it (reordered V heads, -exp(A_log), 1 + w norms)."""
    qk = 2 * K_HEADS * K_DIM
    if ".linear_attn." in name:
        if "in_proj_qkv" in name or "conv1d" in name:
            t = t.squeeze(1) if "conv1d" in name else t
            t = torch.cat([t[:qk], _grouped_to_tiled(t[qk:], V_DIM)])
        elif "in_proj_z" in name:
            t = _grouped_to_tiled(t, V_DIM)
        elif "in_proj_a" in name or "in_proj_b" in name or "A_log" in name or "dt_bias" in name:
            t = _grouped_to_tiled(t, 1)
        elif "out_proj" in name:
            t = _grouped_to_tiled(t, V_DIM, dim=1)
        if name.endswith("A_log"):
            t = -torch.exp(t)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return t


def _copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> None:
    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value, kind = field.contents(), field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, default_gguf: Path):
    hf_dir = make_tiny_hybrid_hf_dir(tmp_path_factory.mktemp("hybrid_hf"), seed=4, vocab_size=VOCAB,
                                  initializer_range=0.1)
    config = hybrid_config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    path = tmp_path_factory.mktemp("hybrid_gguf") / "tiny-qwen35.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35")
    a = "qwen35"
    writer.add_uint32(f"{a}.block_count", config.num_layers)
    writer.add_uint32(f"{a}.context_length", config.max_context)
    writer.add_uint32(f"{a}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{a}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{a}.attention.head_count", config.num_heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", config.num_kv_heads)
    writer.add_uint32(f"{a}.attention.key_length", config.head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32(f"{a}.rope.freq_base", config.rope_theta)
    writer.add_uint32(f"{a}.rope.dimension_count", config.rotary_dim)
    writer.add_uint32(f"{a}.ssm.conv_kernel", config.conv_kernel)
    writer.add_uint32(f"{a}.ssm.state_size", config.lin_k_dim)
    writer.add_uint32(f"{a}.ssm.group_count", config.lin_num_k_heads)
    writer.add_uint32(f"{a}.ssm.time_step_rank", config.lin_num_v_heads)
    writer.add_uint32(f"{a}.ssm.inner_size", config.lin_value_dim)
    writer.add_uint32(f"{a}.full_attention_interval", 4)
    _copy_tokenizer(writer, default_gguf)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    names = gguf_names(config)
    for hf_name in sorted(names):
        data = _as_llama_cpp(hf_name, tensors[hf_name].float()).numpy().astype(np.float32)
        writer.add_tensor(names[hf_name], data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf_dir, path


def test_gguf_config_and_tensors_equal_the_hf_directory(pair) -> None:
    hf_dir, path = pair
    cpu = torch.device("cpu")
    from_hf = load_checkpoint(hf_dir, device=cpu, dtype=torch.float32)
    from_gguf = load_checkpoint(path, device=cpu, dtype=torch.float32)
    want_config, got_config = hybrid_config(from_hf.config), hybrid_config(from_gguf.config)
    assert got_config.rms_norm_eps == pytest.approx(want_config.rms_norm_eps)  # stored as f32
    assert replace(got_config, rms_norm_eps=want_config.rms_norm_eps) == want_config
    assert from_gguf.config.family == "qwen3_5"
    assert set(from_gguf.tensors) == set(from_hf.tensors)
    for name, want in from_hf.tensors.items():
        got = from_gguf.tensors[name]
        if name.endswith("A_log") or (name.endswith("norm.weight") and "linear_attn" not in name):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # log(exp()) / (1 + w) - 1
        else:
            assert torch.equal(got, want), name


def test_gguf_model_gives_the_hf_model_logits(pair) -> None:
    hf_dir, path = pair
    cpu = torch.device("cpu")
    logits = []
    for spec in (hf_dir, path):
        checkpoint = load_checkpoint(spec, device=cpu, dtype=torch.float32)
        model = HybridModel(hybrid_config(checkpoint.config), checkpoint.tensors, device=cpu,
                            dtype=torch.float32)
        model.new_lane_states(1)
        kv = KVPool(num_layers=model.num_kv_layers, num_pages=8, page_size=16,
                    num_kv_heads=model.hybrid.num_kv_heads, head_dim=model.hybrid.head_dim,
                    device=cpu, dtype=torch.float32)
        tokens = tuple(checkpoint.tokenizer.encode("The hybrid model reads its GGUF."))
        work = LaneWork(0, 0, tokens, tuple(range(8)), True)
        logits.append(model.logits(model.forward_works([work], kv)))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
