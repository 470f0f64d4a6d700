"""Mode int4's 8-bit K/V pages (kv_pool.py, csrc/attention.cpp): the block quantizer's rule,
the pages' layout as the pool writes and reads it, and the attention over them: its paths agree
bit for bit, it is softmax attention of the dequantized q, K and V, a row's bits are its own,
and rows past a lane's last row are never read."""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu import cpu_kernels
from prefixd.gpu.attention import AttentionSpan
from prefixd.gpu.kv_pool import QBLOCK, KVPool, quantize_blocks
from tests.gpu.test_cpu_attention import LANES, LONG, softmax_reference, with_threads

KERNEL_OK, KERNEL_WHY = cpu_kernels.available()
needs_kernel = pytest.mark.skipif(not KERNEL_OK, reason=KERNEL_WHY)

PAGE = 16
CPU = torch.device("cpu")


def paths() -> list[str]:
    """Every 8-bit path this CPU can take, the fastest first."""
    if not KERNEL_OK:
        return ["portable"]
    order = ["avx512-bf16", "avx512-vnni", "portable"]
    return order[order.index(cpu_kernels.attention_path(q8=True)):]


def dequantized(x: torch.Tensor) -> torch.Tensor:
    codes, scales = quantize_blocks(x)
    return (codes.double().unflatten(-1, (-1, QBLOCK)) * scales.double()[..., None]).flatten(-2)


# -- the quantizer ------------------------------------------------------------------------------

def test_a_block_is_its_codes_times_its_scale_within_half_a_step():
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(1)) * 4
    codes, scales = quantize_blocks(x)
    assert codes.dtype == torch.int8 and scales.shape == (50, 3, 2)
    blocks = x.unflatten(-1, (-1, QBLOCK))
    assert torch.equal(scales, blocks.abs().amax(-1) / torch.full_like(scales, 127.0))
    assert (codes.abs().unflatten(-1, (-1, QBLOCK)).amax(-1) == 127).all()  # the largest value takes code 127
    err = (dequantized(x) - x.double()).abs().unflatten(-1, (-1, QBLOCK))
    assert (err <= scales.double()[..., None] / 2 * (1 + 1e-6)).all()


def test_a_block_s_codes_are_its_own():
    """A row's codes and scales do not depend on the rows quantized with it."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    together = quantize_blocks(x)
    for i in range(8):
        alone = quantize_blocks(x[i:i + 1])
        assert torch.equal(alone[0][0], together[0][i]) and torch.equal(alone[1][0], together[1][i])


def test_non_finite_and_tiny_blocks():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, :32] = 2.0 ** -70  # below 2^-60: codes 0, scale 0
    codes, scales = quantize_blocks(x)
    assert scales[0, 0].isnan() and scales[1, 1].isnan()  # a non-finite block poisons what reads it
    assert (codes[0, :32] == 0).all() and (codes[1, 32:] == 0).all()
    assert scales[2, 0] == 0 and (codes[2, :32] == 0).all()
    assert torch.isfinite(scales[0, 1]) and torch.isfinite(scales[1, 0]) and torch.isfinite(scales[3]).all()


# -- the pool -----------------------------------------------------------------------------------

def pool8(pages: int, *, page: int = PAGE, kv_heads: int = 3, dim: int = 64, layers: int = 1) -> KVPool:
    return KVPool(num_layers=layers, num_pages=pages, page_size=page, num_kv_heads=kv_heads, head_dim=dim,
                  device=CPU, dtype=torch.bfloat16, codes8=True)


def test_the_pool_reads_back_what_it_wrote_dequantized_and_bytes_per_page():
    pool = pool8(6, layers=2)
    assert pool.storage.dtype == torch.uint8
    assert pool.bytes_per_page == 2 * 2 * PAGE * 3 * (64 + 8)  # a byte a dim, 4 bytes a block of 32
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(20, 3, 64, generator=g).bfloat16(), torch.randn(20, 3, 64, generator=g)
    table = (4, 1, 5)
    slots = torch.tensor([table[t // PAGE] * PAGE + t % PAGE for t in range(20)])
    pool.write(1, slots, k, v)
    got_k, got_v = pool.rows(1, table, 20)
    assert torch.equal(got_k.double(), dequantized(k).float().double())
    assert torch.equal(got_v.double(), dequantized(v).float().double())
    assert not pool.storage[:, 0].any()  # the other layer untouched


def test_a_pool_refuses_a_head_dim_off_the_block():
    with pytest.raises(ValueError, match="multiple of 32"):
        pool8(2, dim=48)


# -- attention over 8-bit pages -------------------------------------------------------------

class Case:
    """An 8-bit pool of `pages` pages, random K (bf16, as rope_kv leaves it) and V (fp32) rows
    written through the pool, lanes given as (start, rows) with their own pages, and rows past
    each lane's last one poisoned (NaN K and inf V: NaN scales)."""

    def __init__(self, lanes: list[tuple[int, int]], *, heads: int = 9, kv_heads: int = 3, dim: int = 64,
                 pages: int = 64, page: int = PAGE, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.dim, self.page = heads, kv_heads, dim, page
        self.pool = pool8(pages, page=page, kv_heads=kv_heads, dim=dim)
        self.k_rows = cpu_kernels.flush_tiny(torch.randn(pages * page, kv_heads, dim, generator=g).bfloat16())
        self.v_rows = torch.randn(pages * page, kv_heads, dim, generator=g)
        perm = torch.randperm(pages, generator=g).tolist()
        self.spans, row = [], 0
        for start, rows in lanes:
            need = -(-(start + rows) // page)
            table, perm = tuple(perm[:need]), perm[need:]
            self.spans.append(AttentionSpan(row, start, rows, table))
            for t in range(start + rows, need * page):  # what a reused page holds past the lane's last row
                self.k_rows[table[t // page] * page + t % page] = float("nan")
                self.v_rows[table[t // page] * page + t % page] = float("inf")
            row += rows
        self.write()
        self.rows = row
        self.q_stride = heads + kv_heads
        self.q = cpu_kernels.flush_tiny((torch.randn((row + 1) * self.q_stride, dim, generator=g) * 0.3).bfloat16())

    def write(self) -> None:
        self.pool.write(0, torch.arange(self.k_rows.shape[0]), self.k_rows, self.v_rows)

    def run(self, spans=None, path: str = "auto") -> torch.Tensor:
        out = torch.zeros(self.rows + 1, self.heads * self.dim)
        index = cpu_kernels.attention_index(self.spans if spans is None else spans)
        cpu_kernels.attend(self.q, self.pool.k[0], self.pool.v[0], *index, self.heads, self.q_stride, out, path)
        return out

    def reference(self, magnitudes: bool = False) -> torch.Tensor:
        """float64 softmax attention of each row's q (its blocks quantized) over its lane's
        dequantized keys and values 0..p; with `magnitudes`, over the values' magnitudes."""
        q = dequantized(self.q).view(self.rows + 1, self.q_stride, self.dim)

        def lane_rows(s: AttentionSpan) -> tuple[torch.Tensor, torch.Tensor]:
            k, v = (x.double() for x in self.pool.rows(0, s.page_table, s.start + s.length))
            return k, v.abs() if magnitudes else v

        return softmax_reference(q, self.spans, lane_rows, self.heads, self.kv_heads)

    def check_softmax(self, got: torch.Tensor) -> None:
        """`got` is the reference within what the value sums' bf16 weights allow: each weight
        (a key's softmax weight times its V scale) rounded to bf16 moves by at most 2^-8 of
        itself, so an output by at most 2^-8 of the softmax-weighted sum of its values'
        magnitudes (and the fp32 arithmetic's own error)."""
        want = self.reference()[: self.rows]
        bound = self.reference(magnitudes=True)[: self.rows] * 2.0 ** -8 * 1.001 + 1e-5
        err = (got.double() - want).abs()
        assert (err <= bound).all(), f"{(err > bound).sum()} outputs past the bound; worst {(err - bound).max()}"
        torch.testing.assert_close(got.double(), want, rtol=0, atol=float(bound.max()))


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 32), (4, 4, 128), (6, 2, 96)])
@pytest.mark.parametrize("lanes", [LANES, LONG], ids=["short", "long"])
def test_paths_agree_bit_for_bit_and_compute_softmax_attention(heads, kv_heads, dim, lanes):
    """Widths of one, two, three and four blocks of 32 dims."""
    case = Case(lanes, heads=heads, kv_heads=kv_heads, dim=dim, pages=400)
    outs = [case.run(path=p) for p in paths()]
    for other in outs[1:]:
        assert torch.equal(outs[0].view(torch.int32), other.view(torch.int32))
    got = outs[0][: case.rows]
    assert torch.isfinite(got).all()  # the poisoned rows past each lane's end were never read
    case.check_softmax(got)


@needs_kernel
@pytest.mark.parametrize("page", [8, 24, 32])
def test_pages_of_other_sizes_read_the_same_keys(page):
    """Pages that are not 16 rows (a block of 16 keys gathered across pages, or read inside a
    larger one) give every path the bits that 16-row pages give for the same rows."""
    base = Case(LONG, pages=400)
    other = Case(LONG, pages=400 * PAGE // page + 8, page=page)
    for s, o in zip(base.spans, other.spans):
        for t in range(s.start + s.length):
            other.k_rows[o.page_table[t // page] * page + t % page] = base.k_rows[s.page_table[t // PAGE] * PAGE + t % PAGE]
            other.v_rows[o.page_table[t // page] * page + t % page] = base.v_rows[s.page_table[t // PAGE] * PAGE + t % PAGE]
    other.write()
    other.q = base.q
    want = base.run(path=paths()[-1])
    for p in paths():
        assert torch.equal(other.run(path=p).view(torch.int32), want.view(torch.int32)), p


@needs_kernel
@pytest.mark.parametrize("lanes", [LANES, LONG], ids=["short", "long"])
@pytest.mark.parametrize("path", paths())
def test_a_rows_bits_do_not_depend_on_the_other_rows_of_the_call(path, lanes):
    """Each row alone, then all lanes in one call, then reversed on one thread: the same bits
    (the calls cut their work into every task shape the kernel has)."""
    case = Case(lanes, pages=400)
    together = with_threads(2, lambda: case.run(path=path))
    for threads in (2, 8):
        alone = torch.zeros_like(together)
        for s in case.spans:
            for i in range(s.length):
                one = AttentionSpan(s.row + i, s.start + i, 1, s.page_table)
                alone[s.row + i] = with_threads(threads, lambda: case.run([one], path=path))[s.row + i]
        assert torch.equal(alone[: case.rows], together[: case.rows]), threads
    assert torch.equal(with_threads(1, lambda: case.run(list(reversed(case.spans)), path=path)), together)


@needs_kernel
@pytest.mark.parametrize("path", paths())
def test_a_non_finite_row_of_a_lane_poisons_that_lane_only(path):
    """A NaN in a key a row reads (its block's scale NaN) makes that row NaN, as bf16 keys
    would; the other lanes' rows keep their bits."""
    case = Case(LANES, pages=400)
    clean = case.run(path=path)
    s = case.spans[1]  # (37, 1): its one row reads keys 0..37
    case.k_rows[s.page_table[5 // PAGE] * PAGE + 5, 0, 7] = float("nan")
    case.write()
    poisoned = case.run(path=path)
    assert poisoned[s.row, : 3 * case.dim].isnan().all()  # kv head 0's q heads
    assert torch.equal(poisoned[s.row, 3 * case.dim:], clean[s.row, 3 * case.dim:])
    others = [r for r in range(case.rows) if r != s.row]
    assert torch.equal(poisoned[others], clean[others])


@needs_kernel
def test_wrong_pages_and_paths_are_refused():
    case = Case([(0, 5)])
    out = torch.zeros(case.rows + 1, case.heads * case.dim)
    index = cpu_kernels.attention_index(case.spans)
    with pytest.raises(RuntimeError, match="for 8-bit pages"):  # a bf16 pool's path only
        cpu_kernels.attend(case.q, case.pool.k[0], case.pool.v[0], *index, case.heads, case.q_stride, out,
                           "avx512")
    odd = torch.zeros(4, PAGE, 3, 70, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="D \\+ D/8"):
        cpu_kernels.attend(case.q, odd, odd.clone(), *index, case.heads, case.q_stride, out)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_rope_kv_has_the_bits_of_the_torch_rope_and_pool_write(rows):
    """The fused rope and 8-bit K/V write gives the q/k heads of rope_qk_into (scaled tables)
    then flush_tiny, and the pool bytes of KVPool.write of those k heads and the fp32 v heads,
    bit for bit; no other pool byte changes."""
    from prefixd.gpu.model import rope_qk_into, scale_q_tables
    from prefixd.gpu.rope import rotation_tables

    heads, kv_heads, dim, pages = 9, 3, 64, 12
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g) * 3
    angles = torch.rand(rows, 1, dim // 2, generator=g) * 100
    cos, sin = rotation_tables(angles.cos(), angles.sin())
    scaled = tuple(scale_q_tables(t, heads, kv_heads, dim ** -0.5) for t in (cos, sin))
    n = max(rows - 2, 1)  # the last rows' K/V are not written (padding rows)
    slots = torch.randperm(pages * PAGE, generator=g)[:n]
    fused, torch_way = pool8(pages), pool8(pages)
    fused.storage.fill_(7)
    torch_way.storage.fill_(7)
    qk_fused = torch.zeros(rows + 1, heads + kv_heads, dim, dtype=torch.bfloat16)
    cpu_kernels.rope_kv(qkv, scaled, qk_fused, fused.k[0], fused.v[0], slots, heads)
    qk = torch.zeros_like(qk_fused)
    rope_qk_into(qkv[:, :(heads + kv_heads) * dim].unflatten(-1, (heads + kv_heads, dim)), qk[:-1], heads,
                 dim ** -0.5, (cos, sin), scaled)
    qk[:-1] = cpu_kernels.flush_tiny(qk[:-1])
    v = qkv[:, (heads + kv_heads) * dim:].unflatten(-1, (kv_heads, dim))
    torch_way.write(0, slots, qk[:n, heads:], v[:n])
    assert torch.equal(qk_fused.view(torch.int16), qk.view(torch.int16))
    assert torch.equal(fused.storage, torch_way.storage)
    written = set((slots // PAGE).tolist())
    untouched = [p for p in range(pages) if p not in written]
    assert (fused.storage[:, :, untouched] == 7).all()
