"""Model loading: a GGUF file or a Hugging Face directory -> a `Checkpoint`.

`load_checkpoint` validates everything (architecture, every expected tensor's presence,
shape and type, the file's length, the tokenizer) before it builds any tensor, so a bad
file fails with a `ModelLoadError` naming the file and the tensor or key, and no partial
model ever exists. Tensors come back under Hugging Face names, in the compute dtype, on the
requested device; GGUF q/k rows are un-permuted to the HF layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from prefixd.gpu.config import ModelConfig
from prefixd.gpu.default_model import DefaultModelMissing, default_model_path
from prefixd.gpu.loading.errors import ModelLoadError
from prefixd.gpu.loading.gguf_loader import load_gguf
from prefixd.gpu.loading.hf_loader import load_hf_dir
from prefixd.gpu.loading.progress import stderr_progress
from prefixd.text.tokenizer import Tokenizer

__all__ = ["Checkpoint", "ModelLoadError", "load_checkpoint", "resolve_spec", "stderr_progress"]


@dataclass
class Checkpoint:
    """A loaded model: config, HF-named tensors (compute dtype, on device), tokenizer."""

    path: Path
    source: str  # "gguf" | "hf"
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    weights_bytes: int
    # a tensor's stored values in fp32, read again from the file, where the compute dtype may
    # round them (GGUF block types; `load_gguf`), else None: what int4 requantizes from
    exact: Callable[[str], torch.Tensor | None] | None = None


def resolve_spec(spec: str | Path) -> tuple[Path, str]:
    """(path, "gguf" | "hf") for "default", a .gguf file or an HF directory."""
    if str(spec) == "default":
        try:
            return default_model_path(), "gguf"
        except DefaultModelMissing as exc:
            raise ModelLoadError("default", str(exc)) from exc
    path = Path(spec).expanduser()
    if path.is_dir():
        return path, "hf"
    if not path.is_file():
        raise ModelLoadError(str(path), "no such file or directory")
    with open(path, "rb") as fh:
        if fh.read(4) == b"GGUF":
            return path, "gguf"
    raise ModelLoadError(str(path), "not a GGUF file (bad magic) and not a model directory")


def load_checkpoint(
    spec: str | Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[str, int, int], None] | None = None,
) -> Checkpoint:
    """Load "default", a .gguf path or an HF directory; raises ModelLoadError.

    progress(stage, done_bytes, total_bytes) is called as tensors are built
    (`stderr_progress()` prints it).
    """
    path, source = resolve_spec(spec)
    exact = None
    if source == "gguf":
        config, tensors, tokenizer, exact = load_gguf(path, device=torch.device(device), dtype=dtype, progress=progress)
    else:
        config, tensors, tokenizer = load_hf_dir(path, device=torch.device(device), dtype=dtype, progress=progress)
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    return Checkpoint(path, source, config, tensors, tokenizer, weights, exact)
