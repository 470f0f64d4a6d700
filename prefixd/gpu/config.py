"""Model configuration and the family registry (no torch here).

A `ModelConfig` is the one frozen description of a model's shapes that every part of the
runtime reads. It is built from a Hugging Face `config.json` dict or from GGUF metadata by
the family registered for that model type / GGUF architecture. Families also say which
tensors (Hugging Face names and shapes) a checkpoint must contain, how GGUF names map onto
them, and which GGUF tensors are stored row-permuted for llama.cpp's rope layout.

Each family is one `FamilyRecord` in this registry: its config parsers, tensor shapes, GGUF
names and rewrites, and its model builder with the numeric modes it has (the builder is named,
not imported, so parsing a config never loads torch). Built-in families: llama (HF model_type
llama, mistral; GGUF arch llama), qwen2 (qkv bias) and qwen3 (per-head q/k RMSNorm), in
config_llama.py, and qwen3_5 (families/qwen3_5_gguf.py) register themselves with
`register_family` when their module is imported; the modules in `_PLUGIN_MODULES` are imported
on the first lookup that misses, so this module imports none of them.
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# The modules that register families when imported (the built-in llama-style ones first),
# imported on the first lookup that misses.
_PLUGIN_MODULES = ("prefixd.gpu.config_llama", "prefixd.gpu.families.qwen3_5")

# The GGUF metadata dict passed to `from_gguf` carries the tensor shapes under this key:
# {gguf tensor name: shape in torch order (rows, cols)}.
GGUF_TENSOR_SHAPES_KEY = "prefixd.tensor_shapes"


class ConfigError(ValueError):
    """A config.json / GGUF metadata value is missing, malformed or unsupported."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"{key}: {detail}")
        self.key = key
        self.detail = detail


@dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling: "llama3" (banded) or "linear" (positions divided by factor)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of one model; `extra` holds family-specific values (read-only)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_context: int
    tie_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    extra: Mapping[str, Any] = field(default_factory=lambda: types.MappingProxyType({}))

    def __post_init__(self) -> None:
        if not isinstance(self.extra, types.MappingProxyType):
            object.__setattr__(self, "extra", types.MappingProxyType(dict(self.extra)))


@dataclass(frozen=True)
class FamilyRecord:
    """Everything prefixd knows of one model family, in one place: how its config is parsed
    (Hugging Face and GGUF), which tensors it has and how GGUF names and stores them, and the
    model code that runs it (`build`, "module:function", imported only when a model is built,
    so this module stays torch-free) with the numeric modes that code has."""

    family: str
    from_hf: Callable[[dict], ModelConfig]
    tensor_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    from_gguf: Callable[[dict], ModelConfig] | None
    gguf_names: Callable[[ModelConfig], dict[str, str]] | None
    gguf_unpermute: Callable[[ModelConfig], dict[str, int]] | None
    gguf_fixup: Callable[[ModelConfig, dict[str, Any]], None] | None
    build: str | None = None
    modes: tuple[str, ...] = ("invariant",)


_BY_MODEL_TYPE: dict[str, FamilyRecord] = {}
_BY_GGUF_ARCH: dict[str, FamilyRecord] = {}
_BY_FAMILY: dict[str, FamilyRecord] = {}


def register_family(
    model_type: str,
    *,
    from_hf: Callable[[dict], ModelConfig],
    tensor_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]],
    from_gguf: Callable[[dict], ModelConfig] | None = None,
    gguf_names: Callable[[ModelConfig], dict[str, str]] | None = None,
    family: str | None = None,
    gguf_arch: str | None = None,
    gguf_unpermute: Callable[[ModelConfig], dict[str, int]] | None = None,
    gguf_fixup: Callable[[ModelConfig, dict[str, Any]], None] | None = None,
    build: str | None = None,
    modes: tuple[str, ...] = ("invariant",),
) -> None:
    """Register (or replace) a family under an HF `model_type`.

    from_hf(config_json_dict) and from_gguf(metadata_dict) build the ModelConfig;
    tensor_shapes(config) gives the expected {HF name: shape}; gguf_names(config) gives
    {HF name: GGUF name}; gguf_unpermute(config) gives {HF name: heads} for tensors GGUF
    stores with llama.cpp's rope row permutation. `family` is the ModelConfig.family the
    callables produce (default: model_type); `gguf_arch` is the GGUF general.architecture
    served by from_gguf (default: model_type). gguf_fixup(config, tensors) may rewrite the
    loaded {HF name: tensor} dict in place where GGUF stores a value differently from HF.
    A GGUF tensor whose shape equals the HF shape up to size-1 dims is reshaped to it.
    `build` ("module:function") is the model code: function(checkpoint, device, dtype, mode)
    returns the family's FamilyModel (prefixd.gpu.families), for each mode in `modes`.
    """
    entry = FamilyRecord(family or model_type, from_hf, tensor_shapes, from_gguf, gguf_names, gguf_unpermute,
                         gguf_fixup, build, tuple(modes))
    _BY_MODEL_TYPE[model_type] = entry
    _BY_FAMILY.setdefault(entry.family, entry)
    if from_gguf is not None:
        _BY_GGUF_ARCH[gguf_arch or model_type] = entry


def _lookup(table: dict[str, FamilyRecord], name: str) -> FamilyRecord | None:
    if name not in table:
        for module in _PLUGIN_MODULES:
            if importlib.util.find_spec(module.rsplit(".", 1)[0]) and importlib.util.find_spec(module):
                importlib.import_module(module)
    return table.get(name)


def config_from_hf(config_json: dict) -> ModelConfig:
    """ModelConfig from a parsed config.json; ConfigError names the bad key."""
    model_type = config_json.get("model_type")
    entry = _lookup(_BY_MODEL_TYPE, str(model_type))
    if entry is None:
        raise ConfigError("model_type", f"unknown architecture {model_type!r}; known: {sorted(_BY_MODEL_TYPE)}")
    return entry.from_hf(config_json)


def config_from_gguf(meta: dict) -> ModelConfig:
    """ModelConfig from GGUF metadata (plus GGUF_TENSOR_SHAPES_KEY); ConfigError names the key."""
    arch = meta.get("general.architecture")
    entry = _lookup(_BY_GGUF_ARCH, str(arch))
    if entry is None or entry.from_gguf is None:
        raise ConfigError("general.architecture", f"unknown architecture {arch!r}; known: {sorted(_BY_GGUF_ARCH)}")
    return entry.from_gguf(meta)


def registered_families() -> list[str]:
    """Every family a record exists for (plugins imported)."""
    _lookup(_BY_FAMILY, "")  # a miss: imports the plugin modules
    return sorted(_BY_FAMILY)


def family_record(family: str) -> FamilyRecord | None:
    """The record of `family` (a ModelConfig.family), or None when no module registers it."""
    return _lookup(_BY_FAMILY, family)


def _family_entry(config: ModelConfig) -> FamilyRecord:
    entry = family_record(config.family)
    if entry is None:
        raise ConfigError("family", f"no registered family {config.family!r}")
    return entry


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected Hugging Face tensor names -> shapes (torch order) for `config`."""
    return _family_entry(config).tensor_shapes(config)


def gguf_tensor_names(config: ModelConfig) -> dict[str, str]:
    """HF name -> GGUF name for `config`'s family; ConfigError if the family has no GGUF map."""
    entry = _family_entry(config)
    if entry.gguf_names is None:
        raise ConfigError("family", f"family {config.family!r} has no GGUF tensor names")
    return entry.gguf_names(config)


def gguf_unpermute_heads(config: ModelConfig) -> dict[str, int]:
    """HF name -> head count for tensors GGUF stores rope-permuted (empty if none)."""
    entry = _family_entry(config)
    return entry.gguf_unpermute(config) if entry.gguf_unpermute is not None else {}


def gguf_fixup(config: ModelConfig) -> Callable[[ModelConfig, dict[str, Any]], None] | None:
    """The family's post-load GGUF tensor rewrite, if it has one."""
    return _family_entry(config).gguf_fixup


