"""Copy engine: exact page/state copies, byte counts, and fences that order copies."""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu.copy import CopyEngine

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def make_pools(device: torch.device) -> list[torch.Tensor]:
    """Two KV-like bf16 pools (8 pages of 4 rows x 3 heads x 2 dims) and one f32 state pool."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(8, 4, 3, 2, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(8, 4, 3, 2, generator=gen).to(device, torch.bfloat16)
    s = torch.randn(8, 5, generator=gen).to(device)
    return [k, v, s]


def reset(engine: CopyEngine, state: torch.Tensor) -> None:
    """A lane reset as the runner does it: wait for every in-flight copy, then write."""
    engine.wait_all()
    state.zero_()


def test_copy_pages_copies_every_pool_and_nothing_else(device):
    pools = make_pools(device)
    before = [p.clone() for p in pools]
    engine = CopyEngine(device)
    fence = engine.copy_pages(pools, src=[1, 2], dst=[5, 0])
    fence.wait()
    for pool, old in zip(pools, before):
        expected = old.clone()
        expected[5], expected[0] = old[1], old[2]
        assert torch.equal(pool, expected)


def test_copy_pages_counts_exact_bytes(device):
    engine = CopyEngine(device)
    fence = engine.copy_pages(make_pools(device), src=[1, 2], dst=[5, 6])
    assert fence.nbytes == (48 + 48 + 20) * 2
    engine.gather([torch.zeros(10, device=device)])
    assert engine.bytes_copied == 232 + 40


def test_copy_pages_with_no_pages_is_a_done_fence(device):
    engine = CopyEngine(device)
    fence = engine.copy_pages(make_pools(device), src=[], dst=[])
    assert fence.done and fence.nbytes == 0


@pytest.mark.parametrize(
    "src,dst",
    [([1], [2, 3]), ([1, 2], [3, 3]), ([1, 2], [2, 4]), ([1], [8]), ([-1], [2])],
    ids=["lengths", "repeated-dst", "overlap", "past-end", "negative"],
)
def test_copy_pages_rejects_bad_page_lists(src, dst):
    with pytest.raises(ValueError):
        CopyEngine(torch.device("cpu")).copy_pages(make_pools(torch.device("cpu")), src, dst)


def test_gather_clones_survive_later_writes(device):
    engine = CopyEngine(device)
    state = torch.arange(6.0, device=device)
    (clone,), fence = engine.gather([state])
    fence.wait()
    state.fill_(-1.0)
    assert torch.equal(clone.cpu(), torch.arange(6.0))


def test_scatter_restores_and_checks_shapes(device):
    engine = CopyEngine(device)
    dst = torch.zeros(2, 3, device=device)
    engine.scatter([torch.ones(2, 3, device=device)], [dst]).wait()
    assert torch.equal(dst.cpu(), torch.ones(2, 3))
    with pytest.raises(ValueError):
        engine.scatter([torch.ones(3, 2, device=device)], [dst])
    with pytest.raises(ValueError):
        engine.scatter([torch.ones(2, 3, device=device)], [])


def test_deferred_copy_is_in_flight_until_waited(device):
    engine = CopyEngine(device)
    state = torch.zeros(4, device=device)
    with engine.defer():
        fence = engine.scatter([torch.ones(4, device=device)], [state])
        assert not fence.done and engine.pending == 1
        assert torch.equal(state.cpu(), torch.zeros(4))
        fence.wait()
        assert fence.done and engine.pending == 0
        assert torch.equal(state.cpu(), torch.ones(4))


def test_fence_wait_covers_its_own_and_earlier_copies_only(device):
    engine = CopyEngine(device)
    a, b = torch.zeros(3, device=device), torch.zeros(3, device=device)
    with engine.defer():
        first = engine.scatter([torch.ones(3, device=device)], [a])
        second = engine.scatter([torch.full((3,), 2.0, device=device)], [b])
        first.wait()
        assert first.done and not second.done and engine.pending == 1
        assert torch.equal(a.cpu(), torch.ones(3)) and torch.equal(b.cpu(), torch.zeros(3))


def test_copies_land_in_issue_order(device):
    engine = CopyEngine(device)
    state = torch.zeros(3, device=device)
    with engine.defer():
        engine.scatter([torch.ones(3, device=device)], [state])
        (seen,), _ = engine.gather([state])
        engine.scatter([torch.full((3,), 2.0, device=device)], [state])
        engine.wait_all()
    assert torch.equal(seen.cpu(), torch.ones(3))  # the gather ran after the first scatter
    assert torch.equal(state.cpu(), torch.full((3,), 2.0))


def test_leaving_defer_launches_held_copies(device):
    engine = CopyEngine(device)
    state = torch.zeros(2, device=device)
    with engine.defer():
        engine.scatter([torch.ones(2, device=device)], [state])
    engine.wait_all()
    assert torch.equal(state.cpu(), torch.ones(2)) and engine.pending == 0


def test_reset_waits_for_an_in_flight_rollback(device):
    """A rejected verify's rollback copy is still in flight when the next request resets
    the lane: the reset must land last, so the lane starts from zeros."""
    engine = CopyEngine(device)
    state = torch.full((4,), 7.0, device=device)
    rolled_back = torch.full((4,), 3.0, device=device)
    with engine.defer():
        engine.scatter([rolled_back], [state])
        reset(engine, state)
    engine.wait_all()
    assert torch.equal(state.cpu(), torch.zeros(4))


def test_a_reset_that_skips_the_wait_is_overwritten(device):
    """The hook is real: writing without wait_all lets the held copy land afterwards."""
    engine = CopyEngine(device)
    state = torch.full((4,), 7.0, device=device)
    with engine.defer():
        engine.scatter([torch.full((4,), 3.0, device=device)], [state])
        state.zero_()
    engine.wait_all()
    assert torch.equal(state.cpu(), torch.full((4,), 3.0))


def test_use_cupy_on_cpu_is_refused():
    with pytest.raises(ValueError):
        CopyEngine(torch.device("cpu"), use_cupy=True)
    assert not CopyEngine(torch.device("cpu")).uses_cupy


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cupy_kernel_matches_torch_page_copy():
    pytest.importorskip("cupy")
    device = torch.device("cuda")
    results = []
    for use_cupy in (True, False):
        pools = make_pools(device) + [torch.arange(8 * 7, dtype=torch.uint8, device=device).view(8, 7)]
        engine = CopyEngine(device, use_cupy=use_cupy)
        assert engine.uses_cupy == use_cupy
        engine.copy_pages(pools, src=[0, 3, 4], dst=[7, 1, 2]).wait()
        torch.cuda.synchronize()
        results.append([p.cpu() for p in pools])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_page_copy_over_the_kv_pool_layout_matches_the_pool_copy(device):
    """The runner's pool keeps every layer in one storage tensor; its per-layer views are
    the pools the engine copies."""
    from prefixd.gpu.kv_pool import KVPool

    pools = []
    for _ in range(2):
        kv = KVPool(num_layers=3, num_pages=6, page_size=4, num_kv_heads=2, head_dim=8,
                    device=device, dtype=torch.bfloat16)
        kv.storage.copy_(torch.randn(kv.storage.shape, generator=torch.Generator().manual_seed(5)))
        pools.append(kv)
    expected = pools[0].copy_pages([0, 4], [3, 1])
    fence = CopyEngine(device).copy_pages(pools[1].pools(), [0, 4], [3, 1])
    fence.wait()
    assert fence.nbytes == expected == 2 * pools[1].bytes_per_page
    assert torch.equal(pools[0].storage.cpu(), pools[1].storage.cpu())
