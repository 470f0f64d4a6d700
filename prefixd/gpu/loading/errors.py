"""The one error a failed load raises."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be loaded; `path` is the file at fault, `detail` names the tensor
    or key and what is wrong with it."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = str(path)
        self.detail = detail


def same_up_to_unit_dims(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """True when shapes are equal once size-1 dims are dropped (e.g. (C, 1, K) vs (C, K))."""
    return tuple(d for d in a if d != 1) == tuple(d for d in b if d != 1)
