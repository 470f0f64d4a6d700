"""The sampling settings a model ships (HF `generation_config.json`, GGUF `general.sampling.*`),
reported in the hello reply's model map so clients can use them as their defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


def sampling_defaults(path: Path, source: str) -> dict[str, float | int]:
    """The model's own sampling settings, by protocol `sampling` key; {} when it ships none."""
    raw: dict[str, Any] = {}
    if source == "hf":
        config = path / "generation_config.json"
        try:
            data = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        except (OSError, ValueError):
            data = {}
        if isinstance(data, dict) and data.get("do_sample", True):
            raw = {ours: data[theirs] for theirs, ours in _HF_KEYS.items() if theirs in data}
    elif source == "gguf":
        from prefixd.gpu.loading.gguf_file import GGUFFile

        gf = GGUFFile(path)
        try:
            raw = {ours: gf.metadata[theirs] for theirs, ours in _GGUF_KEYS.items() if theirs in gf.metadata}
        finally:
            gf.close()
    return {k: v for k, v in raw.items() if type(v) in (int, float) and v >= 0}
