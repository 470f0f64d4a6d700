"""backend.resolve: device and dtype names, and the refusals that keep results exact."""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu import backend, kernels


def test_names_resolve_to_torch_values() -> None:
    assert backend.resolve("cpu", "bf16") == (torch.device("cpu"), torch.bfloat16)
    assert backend.resolve("cpu", "fp32") == (torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="dtype 'fp8'"):
        backend.resolve("cpu", "fp8")


def test_cuda_without_a_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="sees no CUDA device"):
        backend.resolve("cuda", "bf16")


def test_cuda_without_triton_is_refused_not_run_inexactly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="need Triton"):
        backend.resolve("cuda:0", "bf16")
