"""Digests of logits rows, computed where the rows are: the sha256 of each row's float32 bytes."""

from __future__ import annotations

import hashlib

import torch


def logits_sha256(rows: torch.Tensor) -> tuple[str, ...]:
    """Hex sha256 of each row's float32 bytes; `rows` is (n, vocab) or (vocab,), on any device."""
    array = rows.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    if array.ndim == 1:
        array = array[None, :]
    return tuple(hashlib.sha256(row.tobytes()).hexdigest() for row in array)
