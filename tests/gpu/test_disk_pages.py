"""Device side of the disk tier, as round items: pages, lane state and logits rows exported to
host bytes (`RoundPlan.exports`) and loaded into other pages of another runner
(`RoundPlan.loads`) continue with the same bits, a load's state and logits row usable by the
same round's restore and stored sample."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixd.gpu.runner import ModelRunner
from prefixd.scheduler.records import (DiskLoad, FromDisk, LaneWork, PageExport, PageLoad, Restore, RoundPlan,
                                       StoredSample)
from tests.gpu.runner_helpers import capture, kv_equal, make_runner, prompt, start_sampler
from tests.helpers.tiny_models import make_tiny_hybrid_hf_dir

N = 40  # rows: pages 0, 1 and 8 rows of page 2


def _prefill(runner: ModelRunner, table: tuple[int, ...], tokens) -> torch.Tensor:
    start_sampler(runner, 0)
    res = runner.run_round(RoundPlan((LaneWork(0, 0, tuple(tokens), table, True, logits_rows=(len(tokens) - 1,)),)))
    return res.lanes[0].logits


def _decode(runner: ModelRunner, table: tuple[int, ...], pos: int, token: int) -> torch.Tensor:
    res = runner.run_round(RoundPlan((LaneWork(0, pos, (token,), table, False, logits_rows=(0,)),)))
    return res.lanes[0].logits


def _export(runner: ModelRunner, pages, state=None, logits=None):
    return runner.run_round(RoundPlan(exports=(PageExport(tuple(pages), state, logits),))).exported[0]


def _bytes(view) -> bytearray:
    return bytearray(bytes(view))  # what a read from the file gives: a fresh, writable buffer


def test_leading_pages_of_an_export_load_alone_and_decoding_goes_on_with_the_same_bits(tiny_llama_dir):
    a = make_runner(tiny_llama_dir, torch.bfloat16, num_lanes=1, num_pages=16)
    b = make_runner(tiny_llama_dir, torch.bfloat16, num_lanes=1, num_pages=16)
    tokens = prompt(N, seed=3)
    logits = _prefill(a, (0, 1, 2, 3), tokens)
    bpp = a.kv.bytes_per_page
    parent = _export(a, [0, 1])  # a parent file: pages 0, 1
    child = _export(a, [1, 2], logits=logits)  # its child starts at the parent's last full page
    assert parent.kv.nbytes == 2 * bpp and child.state is None
    rows = FromDisk(child.logits.nbytes)
    start_sampler(b, 0)
    # the load, then in the same round a stored sample from the row it makes (a full disk hit)
    res = b.run_round(RoundPlan(loads=(DiskLoad((PageLoad((7,), memoryview(_bytes(parent.kv))[:bpp]),
                                                 PageLoad((3, 9), memoryview(_bytes(child.kv)))),
                                                None, _bytes(child.logits), None, rows),),
                                stored=(StoredSample(0, rows, 0, digest=True),)))
    assert torch.equal(rows.made, logits) and res.stored[0].digests and not res.exported
    assert kv_equal(a, (0, 1, 2), b, (7, 3, 9), N)
    assert torch.equal(_decode(a, (0, 1, 2, 3), N, 123), _decode(b, (7, 3, 9, 4), N, 123))


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_hybrid_hf_dir(tmp_path_factory.mktemp("disk_qwen3_5"), seed=9, vocab_size=49152,
                                initializer_range=0.1)
    return path


@pytest.mark.slow
def test_a_hybrid_lane_state_round_trips_through_bytes(hybrid_dir):
    a = make_runner(hybrid_dir, torch.float32, num_lanes=1, num_pages=8)
    b = make_runner(hybrid_dir, torch.float32, num_lanes=1, num_pages=8)
    tokens = prompt(N, seed=4)
    _prefill(a, (0, 1, 2, 3), tokens)
    captured = capture(a, 0, cut=N)
    out = _export(a, [0, 1, 2], state=captured)
    assert out.state.nbytes == a.info.lane_state_bytes > 0
    state = FromDisk(out.state.nbytes)
    # the load, then in the same round the restore of the state it makes
    b.run_round(RoundPlan(loads=(DiskLoad((PageLoad((4, 5, 6), _bytes(out.kv)),), _bytes(out.state), None,
                                          state, None),),
                          restores=(Restore(0, state),)))
    assert torch.equal(state.made.data, captured.data)
    assert torch.equal(_decode(a, (0, 1, 2, 3), N, 77), _decode(b, (4, 5, 6, 7), N, 77))
