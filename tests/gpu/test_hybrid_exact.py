"""Bit-exactness of the hybrid family: lane state, resume at a cut, lanes, drafts, rollback."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from prefixd.gpu.families.qwen3_5 import HybridModel
from prefixd.gpu.families.qwen3_5_config import HybridConfig, hybrid_config_from_hf
from prefixd.gpu.families.qwen3_5_tiny import random_tensors, tiny_hf_config
from prefixd.gpu.kv_pool import KVPool
from prefixd.scheduler.records import LaneWork
from tests.helpers.device import TEST_DEVICE

PAGE = 16
PAGES_PER_LANE = 16


def _model(config: HybridConfig, num_lanes: int = 9, dtype: torch.dtype = torch.float32) -> HybridModel:
    """A model with lane states and its own KV pool (as `model.kv`, for these tests)."""
    cpu = torch.device(TEST_DEVICE)  # the CPU unless PREFIXD_TEST_DEVICE says otherwise
    model = HybridModel(config, random_tensors(config, seed=11), device=cpu, dtype=dtype)
    model.new_lane_states(num_lanes)
    model.kv = KVPool(num_layers=model.num_kv_layers, num_pages=num_lanes * PAGES_PER_LANE,
                      page_size=PAGE, num_kv_heads=config.num_kv_heads,
                      head_dim=config.head_dim, device=cpu, dtype=dtype)
    return model


def _pages(lane: int) -> tuple[int, ...]:
    return tuple(range(lane * PAGES_PER_LANE, (lane + 1) * PAGES_PER_LANE))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(lane: int, tokens: Sequence[int], lo: int, hi: int) -> LaneWork:
    return LaneWork(lane=lane, start=lo, tokens=tuple(tokens[lo:hi]), page_table=_pages(lane),
                    prefill=True)


def _decode(lane: int, start: int, tokens: Sequence[int]) -> LaneWork:
    return LaneWork(lane=lane, start=start, tokens=tuple(tokens), page_table=_pages(lane),
                    prefill=False)


def _run(model: HybridModel, works: Sequence[LaneWork]) -> dict[int, torch.Tensor]:
    """Logits of every row, per lane."""
    logits = model.logits(model.forward_works(works, model.kv))
    out, lo = {}, 0
    for w in works:
        out[w.lane] = logits[lo:lo + len(w.tokens)]
        lo += len(w.tokens)
    return out


def _cold(model: HybridModel, lane: int, prompt: list[int], cuts: Sequence[int],
          num_decode: int) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill `prompt` with schedule `cuts`, then decode greedily; all logits rows."""
    rows, bounds = [], [0, *cuts, len(prompt)]
    for lo, hi in zip(bounds, bounds[1:]):
        rows.append(_run(model, [_prefill(lane, prompt, lo, hi)])[lane])
    tokens = list(prompt)
    for _ in range(num_decode):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(_run(model, [_decode(lane, len(tokens) - 1, tokens[-1:])])[lane])
    return rows, tokens


@pytest.fixture(scope="module", params=[dict(), dict(linear_conv_kernel_dim=2,
                                                      linear_num_key_heads=1, num_key_value_heads=1)],
                ids=["conv4-gqa", "conv2-mqa"])
def config(request: pytest.FixtureRequest) -> HybridConfig:
    return hybrid_config_from_hf(tiny_hf_config(**request.param))


def test_lane_state_bytes_counts_every_linear_layer(config: HybridConfig) -> None:
    model = _model(config)
    rec = 4 * config.lin_num_v_heads * config.lin_k_dim * config.lin_v_dim
    conv = 4 * (config.conv_kernel - 1) * config.conv_dim
    pad = lambda n: (n + 15) // 16 * 16  # noqa: E731
    assert model.lane_state_bytes == len(config.linear_layers) * (pad(rec) + pad(conv))
    assert model.capture(0).nbytes == model.lane_state_bytes
    assert model.kv.bytes_per_page == (len(config.full_layers) * 2 * PAGE * config.num_kv_heads
                                       * config.head_dim * 4)


def test_capture_then_restore_is_bit_exact_per_layer_and_kind(config: HybridConfig) -> None:
    model = _model(config)
    prompt = _prompt(70, seed=1)
    _run(model, [_prefill(0, prompt, 0, 50)])
    snap = model.capture(0)
    want = [(model.states.live.rec[s][0].clone(), model.states.live.conv[s][0].clone())
            for s in range(len(config.linear_layers))]
    _run(model, [_prefill(0, prompt, 50, 70)])
    assert model.restore(0, snap) == model.lane_state_bytes
    for slot, (rec, conv) in enumerate(want):
        assert torch.any(rec != 0) and torch.any(conv != 0)
        assert torch.equal(model.states.live.rec[slot][0], rec)
        assert torch.equal(model.states.live.conv[slot][0], conv)
    model.reset(0)
    assert not torch.any(model.states.live.buf[0])


def test_resumed_at_a_cut_equals_cold(config: HybridConfig) -> None:
    prompt, cuts = _prompt(100, seed=2), (40, 77)
    cold_model = _model(config)
    cold, _ = _cold(cold_model, 0, prompt, cuts, num_decode=6)
    # the same schedule again, stopping at cut 40 to snapshot
    model = _model(config)
    _run(model, [_prefill(0, prompt, 0, 40)])
    snap = model.capture(0)
    # resume on another lane: shared KV pages copied, state restored
    used = (40 + PAGE - 1) // PAGE
    model.kv.copy_pages(_pages(0)[:used], _pages(1)[:used])
    model.restore(1, snap)
    rows = [_run(model, [_prefill(1, prompt, 40, 77)])[1], _run(model, [_prefill(1, prompt, 77, 100)])[1]]
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(_run(model, [_decode(1, len(tokens) - 1, tokens[-1:])])[1])
    for got, want in zip(rows, cold[1:]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_concurrent_lanes_equal_solo(config: HybridConfig, dtype: torch.dtype) -> None:
    prompt, cuts = _prompt(90, seed=3), (33, 64)
    solo, _ = _cold(_model(config, dtype=dtype), 0, prompt, cuts, num_decode=5)
    model = _model(config, dtype=dtype)
    others = {lane: _prompt(20 + 13 * lane, seed=100 + lane) for lane in range(1, 8)}
    for lane, other in others.items():  # some neighbours are already decoding
        if lane % 2:
            _run(model, [_prefill(lane, other, 0, len(other))])
    bounds, rows, tokens = [0, *cuts, len(prompt)], [], list(prompt)
    pos = {lane: 0 if lane % 2 == 0 else len(o) for lane, o in others.items()}
    for step in range(len(bounds) - 1 + 5):
        works = []
        if step < len(bounds) - 1:
            works.append(_prefill(0, prompt, bounds[step], bounds[step + 1]))
        else:
            tokens.append(int(rows[-1][-1].argmax()))
            works.append(_decode(0, len(tokens) - 1, tokens[-1:]))
        for lane, other in others.items():
            n = len(other)
            if pos[lane] < n:
                hi = min(n, pos[lane] + 11)
                works.append(_prefill(lane, other, pos[lane], hi))
                pos[lane] = hi
            else:
                works.append(_decode(lane, pos[lane], [lane]))
                pos[lane] += 1
        works.reverse()  # lane 0 last: its rows sit at another offset of the batch
        rows.append(_run(model, works)[0])
    for got, want in zip(rows, solo):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_verifying_drafted_rows_equals_decoding_them_one_by_one(config: HybridConfig,
                                                                dtype: torch.dtype) -> None:
    prompt = _prompt(50, seed=4)
    draft = [7, 99, 300, 5]
    one = _model(config, dtype=dtype)
    _run(one, [_prefill(0, prompt, 0, 50)])
    singles = [_run(one, [_decode(0, 50 + j, [t])])[0] for j, t in enumerate(draft)]
    many = _model(config, dtype=dtype)
    _run(many, [_prefill(0, prompt, 0, 50)])
    verified = _run(many, [_decode(0, 50, draft)])[0]
    assert torch.equal(verified, torch.cat(singles))
    assert torch.equal(many.states.live.buf[0], one.states.live.buf[0])


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_rollback_equals_a_run_that_only_saw_the_kept_rows(config: HybridConfig, keep: int) -> None:
    prompt = _prompt(45, seed=5)
    draft, follow = [11, 22, 33, 44], [77, 88]
    model = _model(config)
    _run(model, [_prefill(0, prompt, 0, 45)])
    _run(model, [_decode(0, 45, draft)])
    model.rollback(0, keep)
    got = _run(model, [_decode(0, 45 + keep, follow)])[0]
    ref = _model(config)
    _run(ref, [_prefill(0, prompt, 0, 45)])
    _run(ref, [_decode(0, 45, draft[:keep])])
    want = _run(ref, [_decode(0, 45 + keep, follow)])[0]
    assert torch.equal(got, want)
    for slot in range(len(config.linear_layers)):
        assert torch.equal(model.states.live.rec[slot][0], ref.states.live.rec[slot][0])
        assert torch.equal(model.states.live.conv[slot][0], ref.states.live.conv[slot][0])


def test_rollback_without_a_record_is_refused(config: HybridConfig) -> None:
    model = _model(config)
    _run(model, [_prefill(0, _prompt(20, seed=6), 0, 20)])
    with pytest.raises(ValueError):
        model.rollback(0, 1)
    _run(model, [_decode(0, 20, [1, 2, 3])])
    _run(model, [_decode(0, 23, [4])])  # a newer row makes the verify's record stale
    with pytest.raises(ValueError):
        model.rollback(0, 2)


def test_decoded_rows_are_not_prefilled_rows(config: HybridConfig) -> None:
    """Why invariant_rows is False: the step form's rows differ in bits from the chunked form's."""
    prompt = _prompt(60, seed=7)
    pre = _model(config)
    prefilled = _run(pre, [_prefill(0, prompt, 0, 60)])[0]
    dec = _model(config)
    _run(dec, [_prefill(0, prompt, 0, 56)])
    decoded = torch.cat([_run(dec, [_decode(0, 56 + j, [prompt[56 + j]])])[0] for j in range(4)])
    assert HybridModel.invariant_rows is False
    assert not torch.equal(decoded, prefilled[56:])
    torch.testing.assert_close(decoded, prefilled[56:], atol=1e-4, rtol=1e-4)
