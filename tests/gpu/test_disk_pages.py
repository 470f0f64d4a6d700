"""Device side of the disk tier: pages, lane state and logits rows exported to host bytes and
loaded into other pages of another runner continue with the same bits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from prefixd.gpu.families.qwen3_5_tiny import make_tiny_hybrid_dir
from prefixd.gpu.runner import ModelRunner
from prefixd.scheduler.records import DiskLoad, LaneWork, PageLoad, Restore, RoundPlan
from tests.gpu.runner_helpers import capture, kv_equal, make_runner, prompt, start_sampler

N = 40  # rows: pages 0, 1 and 8 rows of page 2


def _prefill(runner: ModelRunner, table: tuple[int, ...], tokens) -> torch.Tensor:
    start_sampler(runner, 0)
    res = runner.run_round(RoundPlan((LaneWork(0, 0, tuple(tokens), table, True, logits_rows=(len(tokens) - 1,)),)))
    return res.lanes[0].logits


def _decode(runner: ModelRunner, table: tuple[int, ...], pos: int, token: int) -> torch.Tensor:
    res = runner.run_round(RoundPlan((LaneWork(0, pos, (token,), table, False, logits_rows=(0,)),)))
    return res.lanes[0].logits


def _bytes(view) -> bytearray:
    return bytearray(bytes(view))  # what a read from the file gives: a fresh, writable buffer


def test_leading_pages_of_an_export_load_alone_and_decoding_goes_on_with_the_same_bits(tiny_llama_dir):
    a = make_runner(tiny_llama_dir, torch.bfloat16, num_lanes=1, num_pages=16)
    b = make_runner(tiny_llama_dir, torch.bfloat16, num_lanes=1, num_pages=16)
    tokens = prompt(N, seed=3)
    logits = _prefill(a, (0, 1, 2, 3), tokens)
    bpp = a.kv.bytes_per_page
    parent = a.export_pages([0, 1], None, None)  # a parent file: pages 0, 1
    child = a.export_pages([1, 2], None, logits)  # its child starts at the parent's last full page
    assert parent.kv.nbytes == 2 * bpp and child.state is None
    state, rows = b.load_pages(DiskLoad((PageLoad((7,), memoryview(_bytes(parent.kv))[:bpp]),
                                         PageLoad((3, 9), memoryview(_bytes(child.kv)))),
                                        None, _bytes(child.logits)))
    assert state is None and torch.equal(rows, logits)
    assert kv_equal(a, (0, 1, 2), b, (7, 3, 9), N)
    start_sampler(b, 0)
    assert torch.equal(_decode(a, (0, 1, 2, 3), N, 123), _decode(b, (7, 3, 9, 4), N, 123))


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    path = make_tiny_hybrid_dir(tmp_path_factory.mktemp("disk_qwen3_5"), seed=9, vocab_size=49152,
                                initializer_range=0.1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_llama_dir / name, path / name)
    return path


@pytest.mark.slow
def test_a_hybrid_lane_state_round_trips_through_bytes(hybrid_dir):
    a = make_runner(hybrid_dir, torch.float32, num_lanes=1, num_pages=8)
    b = make_runner(hybrid_dir, torch.float32, num_lanes=1, num_pages=8)
    tokens = prompt(N, seed=4)
    _prefill(a, (0, 1, 2, 3), tokens)
    captured = capture(a, 0, cut=N)
    out = a.export_pages([0, 1, 2], captured, None)
    assert out.state.nbytes == a.info.lane_state_bytes > 0
    state, rows = b.load_pages(DiskLoad((PageLoad((4, 5, 6), _bytes(out.kv)),), _bytes(out.state), None))
    assert rows is None and torch.equal(state.data, captured.data)
    b.run_round(RoundPlan(restores=(Restore(0, state),)))
    assert torch.equal(_decode(a, (0, 1, 2, 3), N, 77), _decode(b, (4, 5, 6, 7), N, 77))
