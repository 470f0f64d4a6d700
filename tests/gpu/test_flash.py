"""flash.py's paged attention kernel: right, and row-invariant by construction.

On a CUDA machine these run the compiled kernel; elsewhere Triton's interpreter runs it on
the CPU (tests/conftest.py sets TRITON_INTERPRET=1 where there is no CUDA device), with fp32
operands in its products (flash.py says why). Each case plans tiles the way the runner does
(`plan_attention` with the kernel switched on) and compares:
- against float64 attention, to a tolerance (right);
- bits of the same rows planned other ways: in one tile or chunks, alone or beside lanes of
  other lengths and row counts, in any lane order (invariant);
- with a reused page's stale rows holding NaN and inf against holding zeros (isolated).
"""

from __future__ import annotations

import math

import pytest
import torch

from prefixd.gpu import flash
from prefixd.gpu.attention import AttentionSpan, attend, plan_attention

pytestmark = pytest.mark.skipif(not flash.kernels.triton_available(), reason="needs Triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not flash.INTERPRETING:  # pragma: no cover - conftest sets it
    pytestmark = pytest.mark.skip(reason="Triton runs on the CPU only interpreted (TRITON_INTERPRET=1)")
PAGE = 16


@pytest.fixture(autouse=True)
def _flash_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flash.kernels, "TRITON_ON_CPU", True)


class Pool:
    """K and V pools (pages, PAGE, kv_heads, D) of random rows, every page shuffled among lanes."""

    def __init__(self, *, pages: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        shape = (pages, PAGE, kv_heads, head_dim)
        self.k = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
        self.v = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
        order = torch.randperm(pages, generator=g).tolist()
        self.tables = [tuple(order[i:i + 12]) for i in range(0, pages - 11, 12)]  # 192 rows a lane


def _q(rows: int, heads: int, head_dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, heads, head_dim, generator=g) / math.sqrt(head_dim)).to(DEVICE)


def _attend(q: torch.Tensor, pool: Pool, spans: list[AttentionSpan], group: int) -> torch.Tensor:
    tiles = plan_attention(spans, total_rows=q.shape[0], group=group, page_size=PAGE, device=DEVICE,
                           dtype=pool.k.dtype)
    assert tiles and all(t.masked is None and t.qpos is not None for t in tiles), "not planned for the kernel"
    return attend(q, pool.k, pool.v, tiles)


def _reference(q: torch.Tensor, pool: Pool, span: AttentionSpan, kv_heads: int) -> torch.Tensor:
    """float64 causal attention of one span's rows over its lane's pages."""
    heads, d = q.shape[1], q.shape[2]
    end = span.start + span.length
    slots = torch.tensor([span.page_table[p // PAGE] * PAGE + p % PAGE for p in range(end)], device=DEVICE)
    k = pool.k.view(-1, kv_heads, d)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
    v = pool.v.view(-1, kv_heads, d)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
    qd = q[span.row:span.row + span.length].to(pool.k.dtype).double()
    s = torch.einsum("rhd,khd->hrk", qd, k)
    pos = torch.arange(span.start, end, device=DEVICE).view(-1, 1)
    s = s.masked_fill(torch.arange(end, device=DEVICE).view(1, -1) > pos, float("-inf"))
    return torch.einsum("hrk,khd->rhd", s.softmax(-1), v).reshape(span.length, heads * d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (2, 2, 48), (4, 2, 128), (4, 1, 256)],
                         ids=str)  # 128 and 256: blocks of 32 and 16 keys (flash.block_n)
def test_flash_attention_matches_float64_attention(dtype: torch.dtype, heads: int, kv_heads: int,
                                                   head_dim: int) -> None:
    pool = Pool(pages=60, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    # a prefill chunk that starts mid-lane, a decode row, verify rows, a fresh 1-row lane
    spans = [AttentionSpan(0, 70, 90, pool.tables[0]), AttentionSpan(90, 150, 1, pool.tables[1]),
             AttentionSpan(91, 60, 5, pool.tables[2]), AttentionSpan(96, 0, 1, pool.tables[3])]
    q = _q(97, heads, head_dim, seed=1)
    out = _attend(q, pool, spans, heads // kv_heads)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for span in spans:
        ref = _reference(q, pool, span, kv_heads)
        got = out[span.row:span.row + span.length].double()
        assert torch.allclose(got, ref, rtol=tol, atol=tol), f"span at row {span.row}: {(got - ref).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_flash_row_bits_do_not_depend_on_chunks_neighbours_or_order(dtype: torch.dtype) -> None:
    heads, kv_heads, d = 9, 3, 64
    pool = Pool(pages=100, kv_heads=kv_heads, head_dim=d, dtype=dtype, seed=2)
    n = 170  # three key blocks of the kernel, the last partial
    q = _q(n, heads, d, seed=3)
    table = pool.tables[0]
    whole = _attend(q, pool, [AttentionSpan(0, 0, n, table)], heads // kv_heads)

    # the same rows in chunks, each chunk's q rows placed after other lanes' rows
    for chunks in ([1, 63, 64, 42], [100, 70], [7] * 9 + [107]):
        at = 0
        for size in chunks:
            spans = [AttentionSpan(0, 5, 3, pool.tables[1]), AttentionSpan(3, 0, 70, pool.tables[2]),
                     AttentionSpan(73, at, size, table), AttentionSpan(73 + size, 40, 1, pool.tables[3])]
            rows = torch.cat([_q(73, heads, d, seed=4), q[at:at + size], _q(1, heads, d, seed=5)])
            got = _attend(rows, pool, spans, heads // kv_heads)[73:73 + size]
            assert torch.equal(got, whole[at:at + size]), f"chunks {chunks}: rows {at}..{at + size} differ"
            at += size

    # decode rows (one row a lane) beside 0..7 other lanes of other lengths, in either order
    for row in (0, 63, 64, 169):
        alone = _attend(q[row:row + 1], pool, [AttentionSpan(0, row, 1, table)], heads // kv_heads)
        assert torch.equal(alone, whole[row:row + 1]), f"row {row} decoded alone"
        for others in (1, 3, 7):
            spans = _lay_out([(10 + 23 * i, 1 + i % 3, pool.tables[1 + i]) for i in range(others)])
            first = sum(s.length for s in spans)
            rows = torch.cat([_q(first, heads, d, seed=6 + others), q[row:row + 1]])
            for lanes in (spans + [AttentionSpan(first, row, 1, table)],
                          [AttentionSpan(first, row, 1, table)] + spans[::-1]):
                got = _attend(rows, pool, lanes, heads // kv_heads)[first:first + 1]
                assert torch.equal(got, whole[row:row + 1]), f"row {row} beside {others} lanes"


def _lay_out(lanes: list[tuple[int, int, tuple[int, ...]]]) -> list[AttentionSpan]:
    """Spans for (start, rows, page table) lanes, their rows one after another."""
    spans, row = [], 0
    for start, length, table in lanes:
        spans.append(AttentionSpan(row, start, length, table))
        row += length
    return spans


def test_flash_never_reads_stale_rows_of_a_reused_page() -> None:
    heads, kv_heads, d = 4, 2, 16
    clean = Pool(pages=40, kv_heads=kv_heads, head_dim=d, dtype=torch.bfloat16, seed=7)
    dirty = Pool(pages=40, kv_heads=kv_heads, head_dim=d, dtype=torch.bfloat16, seed=7)
    spans = [AttentionSpan(0, 0, 37, clean.tables[0]), AttentionSpan(37, 20, 1, clean.tables[1])]
    for pool, fill in ((clean, 0.0), (dirty, float("nan"))):
        for span in spans:  # every row past the lane's end: zeros in one pool, NaN / inf in the other
            end = span.start + span.length
            for p in range(end, len(span.page_table) * PAGE):
                slot = span.page_table[p // PAGE], p % PAGE
                pool.k[slot] = fill
                pool.v[slot] = fill if p % 2 else -float("inf") if fill else 0.0
    q = _q(38, heads, d, seed=8)
    a, b = _attend(q, clean, spans, 2), _attend(q, dirty, spans, 2)
    assert torch.isfinite(b).all(), "a stale non-finite row reached the output"
    assert torch.equal(a, b)
