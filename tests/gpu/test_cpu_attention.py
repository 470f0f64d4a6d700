"""Mode int4's CPU attention (csrc/attention.cpp): its paths agree bit for bit, it is softmax
attention, a row's bits are its own, and stale or bad pool rows past a lane's last row are
never read."""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu import cpu_kernels
from prefixd.gpu.attention import AttentionSpan
from prefixd.gpu.kv_pool import from_key_pages, to_key_pages

KERNEL_OK, KERNEL_WHY = cpu_kernels.available()
pytestmark = pytest.mark.skipif(not KERNEL_OK, reason=KERNEL_WHY)

PAGE = 16


def paths() -> list[str]:
    """Every path this CPU can take, the fastest first."""
    order = ["avx512-bf16", "avx512", "portable"]
    return order[order.index(cpu_kernels.attention_path()):]


class Case:
    """A pool of `pages` pages of `page` rows, random K/V (K pages in the kernel's order), and
    lanes given as (start, rows) with their own pages."""

    def __init__(self, lanes: list[tuple[int, int]], *, heads: int = 9, kv_heads: int = 3, dim: int = 64,
                 pages: int = 64, page: int = PAGE, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.dim, self.page = heads, kv_heads, dim, page
        k_rows = cpu_kernels.flush_tiny(torch.randn(pages, page, kv_heads, dim, generator=g).bfloat16())
        self.v = (torch.randn(pages, page, kv_heads, dim, generator=g)).bfloat16()
        perm = torch.randperm(pages, generator=g).tolist()
        self.spans, row = [], 0
        for start, rows in lanes:
            need = -(-(start + rows) // page)
            table, perm = tuple(perm[:need]), perm[need:]
            self.spans.append(AttentionSpan(row, start, rows, table))
            # what a reused page holds past the lane's last row: anything, NaN included
            last = start + rows
            for t in range(last, need * page):
                k_rows[table[t // page], t % page] = float("nan")
                self.v[table[t // page], t % page] = float("inf")
            row += rows
        self.k_rows, self.k = k_rows, to_key_pages(k_rows)
        self.rows = row
        self.q_stride = heads + kv_heads
        self.q = cpu_kernels.flush_tiny((torch.randn((row + 1) * self.q_stride, dim, generator=g) * 0.3).bfloat16())

    def run(self, spans=None, path: str = "auto") -> torch.Tensor:
        out = torch.zeros(self.rows + 1, self.heads * self.dim)
        index = cpu_kernels.attention_index(self.spans if spans is None else spans)
        cpu_kernels.attend(self.q, self.k, self.v, *index, self.heads, self.q_stride, out, path)
        return out

    def reference(self) -> torch.Tensor:
        """float64 softmax attention of every row over its lane's keys 0..p."""
        def lane_rows(s: AttentionSpan) -> tuple[torch.Tensor, torch.Tensor]:
            slots = [s.page_table[t // self.page] * self.page + t % self.page for t in range(s.start + s.length)]
            return (self.k_rows.double().view(-1, self.kv_heads, self.dim)[slots],
                    self.v.double().view(-1, self.kv_heads, self.dim)[slots])

        q = self.q.double().view(self.rows + 1, self.q_stride, self.dim)
        return softmax_reference(q, self.spans, lane_rows, self.heads, self.kv_heads)


def softmax_reference(q: torch.Tensor, spans, lane_rows, heads: int, kv_heads: int) -> torch.Tensor:
    """float64 softmax attention of every span row r at position p over its lane's keys 0..p:
    q (rows + 1, q_stride, D) float64, q heads first; lane_rows(span) gives its keys' K and V
    (start + length, kv_heads, D) float64. Rows (rows + 1, heads * D)."""
    rows, d = q.shape[0], q.shape[2]
    out = torch.zeros(rows, heads * d, dtype=torch.float64)
    group = heads // kv_heads
    for s in spans:
        k, v = lane_rows(s)
        for i in range(s.length):
            r, p = s.row + i, s.start + i
            for h in range(heads):
                w = torch.softmax(k[: p + 1, h // group] @ q[r, h], dim=0)
                out[r, h * d:(h + 1) * d] = w @ v[: p + 1, h // group]
    return out


LANES = [(0, 40), (37, 1), (300, 3), (15, 1), (0, 1)]
# rows past 512 keys: reduced in chunks of 512 keys, joined after (one row at 1,536 keys ends
# a chunk exactly; a block of rows at 510..515 crosses from one chunk to two; alone, the rows
# at 1,536 and 2,100 have their chunks cut between threads)
LONG = [(1100, 1), (510, 6), (1535, 2), (40, 3), (2100, 1)]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 16), (4, 4, 128), (6, 2, 48)])
@pytest.mark.parametrize("lanes", [LANES, LONG], ids=["short", "long"])
def test_paths_agree_bit_for_bit_and_compute_softmax_attention(heads, kv_heads, dim, lanes):
    case = Case(lanes, heads=heads, kv_heads=kv_heads, dim=dim, pages=400)
    outs = [case.run(path=p) for p in paths()]
    for other in outs[1:]:
        assert torch.equal(outs[0].view(torch.int32), other.view(torch.int32))
    got = outs[0][: case.rows]
    assert torch.isfinite(got).all()  # the NaN / inf rows past each lane's end were never read
    torch.testing.assert_close(got.double(), case.reference()[: case.rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page", [8, 24, 32])
def test_pages_of_other_sizes_read_the_same_keys(page):
    """Pages that are not 16 rows (a block of 16 keys spans two pages, or starts inside one)
    give every path the bits that 16-row pages give for the same keys and values."""
    base = Case(LONG, pages=400)
    other = Case(LONG, pages=400 * PAGE // page + 8, page=page)
    # the same K/V rows and q in the other pages: row t of a lane at its own table's slot
    for s, o in zip(base.spans, other.spans):
        for t in range(s.start + s.length):
            other.k_rows[o.page_table[t // page], t % page] = base.k_rows[s.page_table[t // PAGE], t % PAGE]
            other.v[o.page_table[t // page], t % page] = base.v[s.page_table[t // PAGE], t % PAGE]
    other.k, other.q = to_key_pages(other.k_rows), base.q
    assert torch.equal(from_key_pages(other.k).view(torch.int16), other.k_rows.view(torch.int16))
    want = base.run(path=paths()[-1])
    for p in paths():
        assert torch.equal(other.run(path=p).view(torch.int32), want.view(torch.int32)), p


def with_threads(n: int, fn):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("lanes", [LANES, LONG], ids=["short", "long"])
@pytest.mark.parametrize("path", paths())
def test_a_rows_bits_do_not_depend_on_the_other_rows_of_the_call(path, lanes):
    """Each row alone (a one-row span at its position), then all lanes in one call, then the
    lanes in another order and thread count: the same bits. The calls cut their work into
    tasks of every shape the kernel has (with 2 threads: all of a lane's heads and key chunks
    in one task, together; alone, a task per key chunk, or ranges of 2 or 3 heads that cross
    kv heads; with 8 threads alone: a task per q head, per chunk)."""
    case = Case(lanes, pages=400)
    together = with_threads(2, lambda: case.run(path=path))
    for threads in (2, 8):
        alone = torch.zeros_like(together)
        for s in case.spans:
            for i in range(s.length):
                one = AttentionSpan(s.row + i, s.start + i, 1, s.page_table)
                alone[s.row + i] = with_threads(threads, lambda: case.run([one], path=path))[s.row + i]
        assert torch.equal(alone[: case.rows], together[: case.rows]), threads
    reversed_one_thread = with_threads(1, lambda: case.run(list(reversed(case.spans)), path=path))
    assert torch.equal(reversed_one_thread, together)


@pytest.mark.parametrize("path", paths())
def test_a_call_without_rows_writes_nothing(path):
    """Spans of no rows (or none at all) make no tasks: the call returns, `out` untouched."""
    case = Case([(0, 5)])
    for spans in ([AttentionSpan(0, 3, 0, case.spans[0].page_table)], []):
        out = torch.full((case.rows + 1, case.heads * case.dim), 7.0)
        index = cpu_kernels.attention_index(spans) if spans else (torch.zeros(0, 3, dtype=torch.long),
                                                                  torch.zeros(0, 1, dtype=torch.int32))
        cpu_kernels.attend(case.q, case.k, case.v, *index, case.heads, case.q_stride, out, path)
        assert (out == 7.0).all()


def test_rows_the_spans_do_not_name_keep_what_they_hold():
    case = Case([(0, 5)])
    out = torch.full((case.rows + 1, case.heads * case.dim), 7.0)
    cpu_kernels.attend(case.q, case.k, case.v, *cpu_kernels.attention_index(case.spans), case.heads,
                       case.q_stride, out)
    assert (out[case.rows] == 7.0).all()


@pytest.mark.parametrize(("span", "message"), [
    (AttentionSpan(0, 0, 5, (999,)), "names page 999"),
    (AttentionSpan(0, 30, 5, (1,)), "cannot hold row 34"),
    (AttentionSpan(4, 0, 5, (1,)), "out of range"),
])
def test_bad_index_is_refused_before_anything_is_read(span, message):
    case = Case([(0, 5)])
    out = torch.zeros(case.rows + 1, case.heads * case.dim)
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.attend(case.q, case.k, case.v, *cpu_kernels.attention_index([span]), case.heads,
                           case.q_stride, out)


@pytest.mark.parametrize("rows", [1, 5, 37])
def test_rope_kv_has_the_bits_of_the_torch_rope_and_pool_write(rows):
    """The fused rope and K/V write gives the q/k heads and pool rows of rope_qk_into (scaled
    tables) then flush_tiny, then KVPool.write with K pages in the kernel's order, bit for bit,
    and writes no other pool row."""
    from prefixd.gpu.kv_pool import KVPool
    from prefixd.gpu.model import rope_qk_into, scale_q_tables
    from prefixd.gpu.rope import rotation_tables

    heads, kv_heads, dim, pages = 9, 3, 64, 12
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g) * 3
    for head in (1, heads):  # a q head and a k head rotate to values below 2^-30: flushed to zero
        qkv[:, head * dim:(head + 1) * dim] *= 2.0 ** -40
    angles = torch.rand(rows, 1, dim // 2, generator=g) * 100
    cos, sin = rotation_tables(angles.cos(), angles.sin())
    scaled = tuple(scale_q_tables(t, heads, kv_heads, dim ** -0.5) for t in (cos, sin))
    n = max(rows - 2, 1)  # the last rows' K/V are not written (padding rows)
    slots = torch.randperm(pages * PAGE, generator=g)[:n]
    results, every = [], list(range(pages))
    for fused in (True, False):
        pool = KVPool(num_layers=1, num_pages=pages, page_size=PAGE, num_kv_heads=kv_heads, head_dim=dim,
                      device=torch.device("cpu"), dtype=torch.bfloat16, key_pages=fused)
        pool.storage.fill_(7.0)
        qk = torch.zeros(rows + 1, heads + kv_heads, dim, dtype=torch.bfloat16)
        if fused:
            cpu_kernels.rope_kv(qkv, scaled, qk, pool.k[0], pool.v[0], slots, heads)
        else:
            q_and_k = qkv[:, :(heads + kv_heads) * dim].unflatten(-1, (heads + kv_heads, dim))
            rope_qk_into(q_and_k, qk[:-1], heads, dim ** -0.5, (cos, sin), scaled)
            assert ((qk[:-1] != 0) & (qk[:-1].abs() < 2.0 ** -30)).any()  # the flush has work to do
            qk[:-1] = cpu_kernels.flush_tiny(qk[:-1])
            v = qkv[:, (heads + kv_heads) * dim:].unflatten(-1, (kv_heads, dim))
            pool.write(0, slots, qk[:n, heads:], v[:n])
            rows_written = pool.rows(0, every, pages * PAGE)
            pool.k[0].copy_(to_key_pages(pool.k[0].clone()))
            # KVPool.write into a key-pages pool (mode int4's path for qwen3's normed q and k)
            paged = KVPool(num_layers=1, num_pages=pages, page_size=PAGE, num_kv_heads=kv_heads, head_dim=dim,
                           device=torch.device("cpu"), dtype=torch.bfloat16, key_pages=True)
            paged.storage.fill_(7.0)
            paged.write(0, slots, qk[:n, heads:], v[:n])
            assert torch.equal(paged.storage.view(torch.int16), pool.storage.view(torch.int16))
        results.append((qk.view(torch.int16), pool.storage.view(torch.int16)))
        if fused:
            rows_read = pool.rows(0, every, pages * PAGE)  # a key-pages pool reads back as rows
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert all(torch.equal(a, b) for a, b in zip(rows_read, rows_written))


def test_rope_kv_refuses_a_slot_outside_the_pool():
    pool = torch.zeros(2, PAGE, 1, 16, dtype=torch.bfloat16)
    qkv = torch.zeros(1, 4 * 16)
    tables = (torch.zeros(1, 3, 16), torch.zeros(1, 3, 16))
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.rope_kv(qkv, tables, torch.zeros(2, 3, 16, dtype=torch.bfloat16), pool, pool.clone(),
                            torch.tensor([2 * PAGE]), 2)
