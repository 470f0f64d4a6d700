"""kernels.py: on CPU the plain torch ops (the bits every CPU test relies on); on CUDA a row's
bits do not depend on how many rows, batches or trailing zero columns share the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixd.gpu import kernels

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="needs Triton")
DTYPES = [torch.bfloat16, torch.float32]


# (in, out): the default model's projections, its lm_head, and the hybrid test shapes
SHAPES = [(576, 1728), (1536, 576), (576, 49152), (1024, 3584)]
ROW_COUNTS = [1, 2, 3, 5, 7, 8, 16, 17, 63, 64, 65, 130, 257, 1000]


def _randn(*shape: int, seed: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_ops_are_the_torch_ops(dtype: torch.dtype) -> None:
    x, w = _randn(20, 64, seed=1, dtype=dtype), _randn(48, 64, seed=2, dtype=dtype)
    a, b = _randn(3, 20, 64, seed=3, dtype=dtype), _randn(3, 64, 40, seed=4, dtype=dtype)
    assert torch.equal(kernels.mm_t(x, w), F.linear(x, w))
    assert torch.equal(kernels.bmm(a, b), torch.bmm(a, b))
    f = x.float()
    assert torch.equal(kernels.sum_dim(f, -1), f.sum(dim=-1))
    assert torch.equal(kernels.sum_dim(a.float(), 1), a.float().sum(dim=1))
    assert torch.equal(kernels.mean_last(f), f.mean(-1, keepdim=True))


# Row counts (beside 1..4) where 2-thread oneDNN / MKL calls gave other bits on a CPU
# without BF16 instructions, and the fp32 K-split range (docs/runtime.md)
CPU_ROW_COUNTS = [16, 17, 31, 33, 63, 64, 65, 96, 128, 192, 300]


@pytest.fixture
def two_threads():
    """torch at 2 intra-op threads for the test (oversubscribed on a 1-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_products_keep_a_rows_bits_at_two_threads(dtype: torch.dtype, two_threads) -> None:
    """mm_t and bmm on CPU: a row's bits do not depend on the call's row count when torch
    runs several threads (the libraries' own thread split is what changes them)."""
    for k, n in [(576, 3072), (1536, 576), (576, 960)]:
        x, w = _randn(512, k, seed=k, dtype=dtype), _randn(n, k, seed=n, dtype=dtype)
        ref = kernels.mm_t(x, w)
        for m in CPU_ROW_COUNTS:
            assert torch.equal(kernels.mm_t(x[:m].clone(), w), ref[:m]), (k, n, m)
    keys, q = _randn(9, 64, 256, seed=5, dtype=dtype), _randn(9, 96, 64, seed=6, dtype=dtype)
    ref = kernels.bmm(q, keys)
    for m in [16, 17, 24, 48, 96] + ([1, 3, 6, 9] if dtype == torch.bfloat16 else []):
        assert torch.equal(kernels.bmm(q[:, :m].clone(), keys), ref[:, :m]), m


def test_one_thread_runs_on_one_thread_and_restores_the_count(two_threads) -> None:
    seen = kernels.one_thread(torch.get_num_threads)
    assert (seen, torch.get_num_threads()) == (1, 2)
    with pytest.raises(ZeroDivisionError):
        kernels.one_thread(lambda: 1 / 0)
    assert torch.get_num_threads() == 2


@pytest.mark.cuda
@cuda
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cuda_mm_row_bits_do_not_depend_on_row_count(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    k, n = shape
    x = _randn(max(ROW_COUNTS), k, seed=5, dtype=dtype, device="cuda")
    w = _randn(n, k, seed=6, dtype=dtype, device="cuda")
    full = kernels.mm_t(x, w)
    ref = x.float() @ w.float().t()
    assert torch.allclose(full.float(), ref, rtol=2e-2, atol=2e-2 * k ** 0.5)
    for m in ROW_COUNTS:
        assert torch.equal(kernels.mm_t(x[:m], w), full[:m]), f"M={m}"
        assert torch.equal(kernels.mm_t(x[m - 1:m], w), full[m - 1:m]), f"row {m - 1} alone"


@pytest.mark.cuda
@cuda
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_bmm_batch_bits_do_not_depend_on_batch_count(dtype: torch.dtype) -> None:
    # attention's shapes: (M = rows x group, D) x (D, 256 keys), then (M, 256) x (256, D)
    q = _randn(96, 24, 64, seed=7, dtype=dtype, device="cuda")
    k = _randn(96, 256, 64, seed=8, dtype=dtype, device="cuda")
    s = kernels.bmm(q, k.transpose(1, 2))
    assert torch.allclose(s.float(), torch.bmm(q.float(), k.float().transpose(1, 2)), rtol=2e-2, atol=0.2)
    for b in (1, 2, 3, 9, 40):
        assert torch.equal(kernels.bmm(q[:b], k[:b].transpose(1, 2)), s[:b]), f"batches={b}"
        assert torch.equal(kernels.bmm(q[:b, :3], k[:b].transpose(1, 2)), s[:b, :3]), f"3 rows, batches={b}"
    p = _randn(96, 24, 256, seed=9, dtype=dtype, device="cuda")
    a = kernels.bmm(p, k)
    for b in (1, 5, 33):
        assert torch.equal(kernels.bmm(p[:b], k[:b]), a[:b])


@pytest.mark.cuda
@cuda
@needs_triton
def test_cuda_row_sums_do_not_depend_on_rows_or_trailing_zeros() -> None:
    x = _randn(1000, 576, seed=10, dtype=torch.float32, device="cuda")
    full = kernels.sum_dim(x, -1)
    assert torch.allclose(full, x.sum(-1), rtol=1e-5, atol=1e-4)
    for m in ROW_COUNTS:
        assert torch.equal(kernels.sum_dim(x[:m], -1), full[:m]), f"rows={m}"
    # a lane's block sums beside a longer lane: its trailing blocks are exact zeros
    blocks = _randn(3, 2, 5, 24, seed=11, dtype=torch.float32, device="cuda")
    padded = torch.cat([blocks, blocks.new_zeros(3, 2, 300, 24)], dim=2)
    assert torch.equal(kernels.sum_dim(padded, 2), kernels.sum_dim(blocks, 2))
    # a sum over a middle dim (the step form's k^T S) per batch row
    state = _randn(8, 4, 128, 128, seed=12, dtype=torch.float32, device="cuda")
    many = kernels.sum_dim(state, -2)
    assert torch.equal(kernels.sum_dim(state[:1], -2), many[:1])
    assert torch.equal(kernels.mean_last(x[:7]), kernels.mean_last(x)[:7])


def _run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_cpu_bf16_rows_keep_their_bits_at_every_row_count_even_with_amx() -> None:
    """mm_t on CPU, one thread: every row count against a 700-row call (on an AMX CPU, calls
    of CPU_PRODUCT_ROWS rows; without them oneDNN's AMX kernels differ at 20..32 and 33+)."""
    for k, n in [(576, 3072), (576, 49152)]:
        x, w = _randn(700, k, seed=k, dtype=torch.bfloat16), _randn(n, k, seed=n, dtype=torch.bfloat16)
        ref = kernels.mm_t(x, w)
        for m in [1, 2, 15, 16, 17, 20, 31, 32, 33, 100, 300, 512]:
            assert torch.equal(kernels.mm_t(x[:m].clone(), w), ref[:m]), (k, n, m)
            assert torch.equal(kernels.mm_t(x[700 - m:].clone(), w), ref[700 - m:]), (k, n, m, "tail")


@pytest.mark.skipif(not kernels.cpu_has("amx_bf16"), reason="only a CPU with AMX picks kernels by row count")
def test_amx_cpus_run_bf16_products_in_calls_of_fixed_rows() -> None:
    assert kernels.CPU_PRODUCT_ROWS == kernels.AMX_PRODUCT_ROWS
    kernels.check_cpu_products()


def test_the_start_up_check_refuses_products_whose_rows_follow_the_call(monkeypatch) -> None:
    """A library whose product gives a row other bits when fewer rows share the call (here:
    the last row rounded differently at odd row counts) is refused by name."""
    real = torch.nn.functional.linear

    def varying(x, w, *args):
        out = real(x, w, *args)
        if x.shape[0] % 2:
            out[-1] = out[-1].add(1)
        return out

    monkeypatch.setattr(kernels, "_cpu_products_checked", False)
    monkeypatch.setattr(kernels, "CPU_PRODUCT_ROWS", None)
    monkeypatch.setattr(torch.nn.functional, "linear", varying)
    with pytest.raises(kernels.RowVarianceError, match="mm_t at 3 rows"):
        kernels.check_cpu_products()
