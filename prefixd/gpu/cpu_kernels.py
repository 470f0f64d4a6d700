"""Build, load and feed prefixd's CPU kernels: mode int4's product (csrc/int4_mm.cpp), its
paged attention (csrc/attention.cpp) and a round's decoder layers in one call of both
(csrc/layers.cpp).

They are C++ against torch's own headers and libraries, built into one library the first time
a process needs them with the system's C++ compiler (half a minute or so) and kept in a cache
folder keyed by the sources, torch's version and the compiler: $PREFIXD_KERNEL_DIR, else
$CACHE_DIRECTORY/kernels (systemd's CacheDirectory=), else $XDG_CACHE_HOME/prefixd/kernels,
else ~/.cache/prefixd/kernels. A build is written beside its final name and renamed, so two
processes building at once both end with a whole library.

Mode "int4" needs them; where they cannot be built (no C++ compiler) `available()` says why
and `--mode auto` runs the invariant mode instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("int4_mm.cpp", "attention.cpp", "layers.cpp"))
HEADERS = tuple(Path(__file__).parent / "csrc" / name for name in ("common.h", "kernels.h"))  # in the cache key too
GROUP = 32  # inputs sharing a scale and base; also the activations' quantization group
BLOCK_N = 32  # outputs a block of the packed layout holds
BUILD_TIMEOUT_S = 600  # a compiler that takes longer is given up on: the kernels are then unavailable

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "why": str, "path": Path


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def cache_dir() -> Path:
    if os.environ.get("PREFIXD_KERNEL_DIR"):
        return Path(os.environ["PREFIXD_KERNEL_DIR"])
    if os.environ.get("CACHE_DIRECTORY"):
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0]) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prefixd" / "kernels"


def _command(cxx: str, out: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [cxx, "-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w"]
    for inc in cpp_extension.include_paths():
        cmd += ["-isystem", inc]
    lib = cpp_extension.library_paths()[0]
    cmd += [*map(str, SOURCES), f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-o", str(out)]
    return cmd


def _library_path(cxx: str) -> Path:
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = cxx
    key = hashlib.sha256()
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), torch.__version__.encode(), version.encode(),
                 sys.platform.encode()):
        key.update(part)
    return cache_dir() / f"prefixd_cpu-{key.hexdigest()[:16]}.so"


def _build(cxx: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"prefixd: building the CPU kernels of mode int4 into {target.parent} (once; up to a minute)",
          file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(_command(cxx, Path(tmp)), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> None:
    """Build (if needed) and load the kernels; RuntimeError saying why when they cannot be (the
    reason is kept: a process tries once)."""
    with _lock:
        if _state.get("ok"):
            return
        if "why" in _state:
            raise RuntimeError(str(_state["why"]))
        try:
            cxx = _compiler()
            if cxx is None:
                raise RuntimeError("no C++ compiler found (install g++, or set CXX)")
            path = _library_path(cxx)
            if not path.exists():
                _build(cxx, path)
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _state["why"] = f"the CPU kernels could not be built or loaded: {exc}"
            raise RuntimeError(str(_state["why"])) from exc
        _state.update(ok=True, path=path)


def available() -> tuple[bool, str]:
    """(whether the kernels load, why not)."""
    try:
        load()
    except RuntimeError as exc:
        return False, str(exc)
    return True, ""


def fast() -> bool:
    """Whether the kernels load and take their AVX-512 paths here: what `--mode auto` asks
    before it picks int4 (the portable paths give the same bits, many times slower)."""
    return available()[0] and isa() == "avx512-vnni" and attention_path() in ("avx512-bf16", "avx512")


def isa() -> str:
    """The path the int4 product takes on this CPU: "avx512-vnni" or "portable" (the same bits)."""
    load()
    return torch.ops.prefixd.int4_isa()


def pack(codes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout (csrc/int4_mm.cpp) of codes (N, K) in 0..15 and scale, base (N, K/32).

    Returns (codes uint8 (NB, G, 4, 2, 64), scales (NB, G, 2, 32)); padding outputs get code 0
    and zero scale and base. The scales are fp16 when every scale and base is exact in fp16
    (linear.int4_codes rounds them so), else bf16 when exact in bf16; the kernel widens either
    exactly, so only their values count."""
    n, k = codes.shape
    g = k // GROUP
    nb = -(-n // BLOCK_N)
    q = torch.zeros(nb * BLOCK_N, k, dtype=torch.uint8)
    q[:n] = codes.to(torch.uint8)
    # (nb, h, l, g, i, half, b): output nb*32 + 16h + l, input 32g + 8i + 4*half + b
    q = q.reshape(nb, 2, 16, g, 4, 2, 4)
    packed = q[..., 0, :] | (q[..., 1, :] << 4)  # (nb, h, l, g, i, b)
    packed = packed.permute(0, 3, 4, 1, 2, 5).reshape(nb, g, 4, 2, 64).contiguous()
    sb = torch.zeros(2, nb * BLOCK_N, g)
    sb[0, :n], sb[1, :n] = scale.float(), base.float()
    scales = sb.reshape(2, nb, BLOCK_N, g).permute(1, 3, 0, 2).contiguous()
    for dtype in (torch.float16, torch.bfloat16):
        if torch.equal(scales.to(dtype).float(), scales):
            return packed, scales.to(dtype)
    raise ValueError("pack: scales and bases must be exact in fp16 or in bf16 (linear.int4_codes rounds them)")


def pack8(codes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's 8-bit layout of codes (N, K) in 0..255 and scale, base (N, K/32), as `pack`'s.

    Returns (codes uint8 (NB, G, 8, 2, 64), scales as `pack`'s (NB, G, 2, 32)): byte 4*l + b of
    [nb, g, i, h] is the code of input 32g + 4i + b for output nb*32 + 16h + l."""
    n, k = codes.shape
    g = k // GROUP
    nb = -(-n // BLOCK_N)
    q = torch.zeros(nb * BLOCK_N, k, dtype=torch.uint8)
    q[:n] = codes.to(torch.uint8)
    # (nb, h, l, g, i, b): output nb*32 + 16h + l, input 32g + 4i + b
    q = q.reshape(nb, 2, 16, g, 8, 4).permute(0, 3, 4, 1, 2, 5).reshape(nb, g, 8, 2, 64).contiguous()
    return q, pack(torch.zeros(n, GROUP * g, dtype=torch.int32), scale, base)[1]


def matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int, path: str = "auto",
           norm: tuple[torch.Tensor, float] | None = None, passes: int = 1,
           watch: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """fp32 (M, n) = x (M, Kx) @ W.T, W packed by `pack` or `pack8` (K a multiple of Kx); x bf16 or fp32.

    norm = (weight fp32 (Kx,), eps): x's rows RMS-normalized first, in the call (csrc/int4_mm.cpp).
    passes = 2: x's 8-bit codes and then those of their rounding error, each its own product,
    summed (about 15 bits of each activation; the weights are read once). watch = (finite uint8
    (M,), best int64 (M,), limit): each row's watch as `layers_int4`'s head keeps it (`head_picks`)."""
    extra = {} if watch is None else dict(finite=watch[0], best=watch[1], limit=watch[2])
    if norm is None:
        return torch.ops.prefixd.int4_mm(x, codes, scales, n, path, passes=passes, **extra)
    return torch.ops.prefixd.int4_mm(x, codes, scales, n, path, norm[0], norm[1], passes, **extra)


def attention_path(q8: bool = False) -> str:
    """The path attention takes on this CPU: for bf16 pools "avx512-bf16", "avx512" or "portable",
    for 8-bit pages "avx512-bf16" (VNNI scores, BF16 value sums), "avx512-vnni" or "portable"
    (each pool kind's paths give the same bits)."""
    load()
    return torch.ops.prefixd.attention_q8_isa() if q8 else torch.ops.prefixd.attention_isa()


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, spans: torch.Tensor,
           tables: torch.Tensor, heads: int, q_stride: int, out: torch.Tensor, path: str = "auto") -> None:
    """Paged attention of every row of `spans` into `out` (csrc/attention.cpp has the arithmetic).

    q ((R + 1) * q_stride, D) bf16, pre-scaled, q heads first in each row's q_stride vectors;
    k_pool, v_pool (pages, page_size, kv_heads, D) bf16, K pages in `kv_pool.to_key_pages` order, or
    8-bit pages (`KVPool(codes8=True)`: uint8 (pages, page_size, kv_heads, D + D/8)); spans (S, 3) int64 (first row, first position, rows); tables (S, T) int32 pages; out (R + 1,
    heads * D) fp32. q and k hold no magnitude below 2^-30 but zero (`flush_tiny`)."""
    torch.ops.prefixd.attend(q, k_pool, v_pool, spans, tables, heads, q_stride, out, path)


def flush_tiny(x: torch.Tensor) -> torch.Tensor:
    """x with every magnitude below 2^-30 (zeros too) made +0: what rope_kv writes for q and k."""
    return torch.where(x.abs() < 2.0 ** -30, torch.zeros((), dtype=x.dtype), x)


def rope_kv(qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], qk: torch.Tensor, k_pool: torch.Tensor,
            v_pool: torch.Tensor, slots: torch.Tensor, heads: int) -> None:
    """A layer's rope into `qk` and its K/V rows into the pools, in one call, with the bits of
    `model.rope_qk_into` (scaled tables) then `flush_tiny`, and of `KVPool.write` with K pages in
    `kv_pool.to_key_pages` order or 8-bit pages (csrc/attention.cpp).

    qkv (R, (heads + 2 kv_heads) * D) fp32; tables: q-scaled (cos, sin), (R, heads + kv_heads, D)
    fp32; qk (>= R, heads + kv_heads, D) bf16; pools as `attend`'s; slots
    (n <= R,) int64: rows 0..n-1 go to the pool."""
    torch.ops.prefixd.rope_kv(qkv, tables[0], tables[1], qk, k_pool, v_pool, slots, heads)


def layers_int4(h: torch.Tensor, weights: list[torch.Tensor], outs: list[int], eps: float, qk: torch.Tensor,
                attn: torch.Tensor, act: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor],
                k_pools: list[torch.Tensor], v_pools: list[torch.Tensor], slots: torch.Tensor,
                index: tuple[torch.Tensor, torch.Tensor], heads: int, head: tuple | None = None) -> None:
    """Every decoder layer of a round into `h` (fp32 (R, hidden), updated in place), with the bits
    of model.LlamaModel's loop over `matmul`, `rope_kv` and `attend` (csrc/layers.cpp has the
    order). weights: ten a layer (input norm, then codes and scales of qkv and o, post norm,
    codes and scales of gate_up and down); outs: the four products' widths a layer; qk, attn,
    act: the round's buffers (model._Round); tables: q-scaled rope tables; index:
    `attention_index`'s (spans, tables). head = (final norm, codes, scales, n, passes, normed,
    logits[, finite, best, limit]): then every row's final norm into `normed` and its logits into
    `logits` too, in the same call, with the bits of `rms_norm` and `matmul` on them; with
    `finite` (uint8 (R,)) and `best` (int64 (R,)), the row's flag (1: every logit finite) and its
    greedy pick below `limit` as a key (`head_picks` reads both)."""
    torch.ops.prefixd.layers_int4(h, weights, outs, eps, qk, attn, act, tables[0], tables[1], k_pools, v_pools,
                                  slots, index[0], index[1], heads, *(head or ()))


def head_picks(finite: torch.Tensor, best: torch.Tensor) -> list[int]:
    """`layers_int4`'s watch of the head's rows as each row's greedy pick, the lowest id of its
    largest logit below the call's limit (numpy's argmax on it), or -1 where any logit of the
    row is not finite. A key holds the value's order in its high 32 bits and the id's
    complement in its low 32."""
    return [0xFFFFFFFF - (key & 0xFFFFFFFF) if ok else -1 for ok, key in zip(finite.tolist(), best.tolist())]


def layers_int4_rows(embed: torch.Tensor, tokens: list[int], spans: list[int], pages: list[int], page_size: int,
                     rope: torch.Tensor, weights: list[torch.Tensor], outs: list[int], eps: float,
                     k_pools: list[torch.Tensor], v_pools: list[torch.Tensor], heads: int, kv_heads: int,
                     head_dim: int, qk_dtype: torch.dtype, act_dtype: torch.dtype,
                     head: tuple = ()) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A round's set-up and `layers_int4` in one call, from host lists (csrc/layers.cpp): the
    same values as the Python set-up (the inputs, embedding rows, q-scaled rope tables, buffers
    and attention index), so the same bits. spans: four numbers a lane (first row, first
    position, rows, pages), its pages' ids in `pages`; rope: `RopeTable.scaled_table`'s.
    head = (final norm, codes, scales, n, passes, pick_below) or (). Returns (the final hidden
    rows, normed with a head, else the unnormed residual stream; the logits, or an empty
    tensor without a head; each row's pick as `head_picks` gives it where pick_below > 0,
    else [])."""
    return torch.ops.prefixd.layers_int4_rows(embed, tokens, spans, pages, page_size, rope, weights, outs, eps,
                                              k_pools, v_pools, heads, kv_heads, head_dim, qk_dtype, act_dtype,
                                              *head)


def attention_index(spans) -> tuple[torch.Tensor, torch.Tensor]:
    """(spans (S, 3) int64, tables (S, T) int32) for `attend` from attention.AttentionSpan records.
    Built in numpy, which takes a page table as it is (a tensor per lane took 8 lanes' round ~60 µs)."""
    width = max((len(s.page_table) for s in spans), default=0)
    rows = np.array([(s.row, s.start, s.length) for s in spans], dtype=np.int64).reshape(-1, 3)
    tables = np.zeros((len(spans), max(width, 1)), dtype=np.int32)
    for i, s in enumerate(spans):
        tables[i, : len(s.page_table)] = s.page_table
    return torch.from_numpy(rows), torch.from_numpy(tables)
