"""Device copies for snapshots, restores, rollbacks and copy-on-write pages, with fences.

Every copy goes through a `CopyEngine` and comes back as a `Fence`. Copies run in issue
order (one copy stream). Before touching state a copy may write or read (a lane reset, a
snapshot, the next round over rolled-back rows) the caller waits: `fence.wait()` for one
batch, `engine.wait_all()` for everything in flight.

    compute stream  ──round──┐            ┌── wait_all() ──reset──▶
                             ▼ (event)    │ (event)
    copy stream              └──copy──────┘

On CUDA the copies run on a dedicated stream ordered with events against the caller's
current stream; page copies are one CuPy RawKernel launch for all pools when cupy is
installed, else torch index copies on that stream. On CPU copies run synchronously.

`defer()` holds every copy issued inside it in flight (not started) until something waits
for it or the block ends, so tests can prove that a wait is in the right place: without
the wait, the held copy lands after the caller's own write and the test sees it.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

_BLOCK_THREADS = 256

_KERNEL_SOURCE = r"""
extern "C" __global__ void copy_pages(const unsigned long long table_ptr, const int num_pools,
                                      const int num_pairs, const int vec16) {
    // table: bases[num_pools] | page_units[num_pools] | src[num_pairs] | dst[num_pairs]
    const long long* table = reinterpret_cast<const long long*>(table_ptr);
    const int pair = blockIdx.x;
    const int pool = blockIdx.y;
    const long long units = table[num_pools + pool];
    const long long src = table[2 * num_pools + pair];
    const long long dst = table[2 * num_pools + num_pairs + pair];
    if (vec16) {
        uint4* base = reinterpret_cast<uint4*>(table[pool]);
        const uint4* s = base + src * units;
        uint4* d = base + dst * units;
        for (long long i = threadIdx.x; i < units; i += blockDim.x) d[i] = s[i];
    } else {
        unsigned char* base = reinterpret_cast<unsigned char*>(table[pool]);
        const unsigned char* s = base + src * units;
        unsigned char* d = base + dst * units;
        for (long long i = threadIdx.x; i < units; i += blockDim.x) d[i] = s[i];
    }
}
"""


def _import_cupy() -> Any | None:
    try:
        import cupy  # optional: only the CUDA page-copy kernel needs it
    except ImportError:
        return None
    return cupy


class Fence:
    """One in-flight copy batch."""

    __slots__ = ("_engine", "_ticket", "nbytes")

    def __init__(self, engine: CopyEngine, ticket: int, nbytes: int) -> None:
        self._engine = engine
        self._ticket = ticket
        self.nbytes = nbytes  # bytes this batch copies

    def wait(self) -> None:
        """Return once work issued afterwards (host code on CPU; the caller's current
        stream on CUDA) is ordered after this copy and every copy issued before it."""
        self._engine._wait(self._ticket)

    @property
    def done(self) -> bool:
        """True when the copy has finished (or been waited for)."""
        return self._engine._is_done(self._ticket)


@dataclass
class _Copy:
    ticket: int
    launch: Callable[[], None]
    event: Any = None  # torch.cuda.Event once launched on CUDA
    keep: list[torch.Tensor] = field(default_factory=list)  # alive until done


class CopyEngine:
    """Gathers, scatters and page copies on one device, ordered through fences."""

    def __init__(self, device: torch.device, *, use_cupy: bool | None = None) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        cupy = _import_cupy() if self.is_cuda and use_cupy is not False else None
        if use_cupy and cupy is None:
            raise ValueError(f"use_cupy=True needs cupy and a cuda device (device {self.device})")
        self._cupy = cupy
        self._kernel: Any = None
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._held: deque[_Copy] = deque()  # issued inside defer(), not launched yet
        self._launched: deque[_Copy] = deque()  # launched on the copy stream, not yet waited
        self._next_ticket = 0
        self._deferring = 0
        self.bytes_copied = 0

    @property
    def uses_cupy(self) -> bool:
        return self._cupy is not None

    @property
    def pending(self) -> int:
        """Copies issued and neither finished nor waited for."""
        self._retire_finished()
        return len(self._held) + len(self._launched)

    # --- the copies ------------------------------------------------------------------

    def copy_pages(self, pools: Sequence[torch.Tensor], src: Sequence[int], dst: Sequence[int]) -> Fence:
        """For every pool tensor (num_pages, ...): pool[dst[i]] = pool[src[i]].

        `dst` holds no id twice and shares none with `src`; every id is a valid page of
        every pool. One kernel launch for all pools on CUDA with cupy."""
        _check_pages(pools, src, dst)
        nbytes = sum(_page_bytes(p) for p in pools) * len(src)
        if not src:
            return self._issue(lambda: None, [], 0)
        pools = list(pools)
        if self._cupy is not None and all(p.is_contiguous() for p in pools):
            launch = lambda: self._kernel_copy(pools, src, dst)  # noqa: E731
        else:
            launch = lambda: _torch_copy_pages(pools, src, dst)  # noqa: E731
        return self._issue(launch, [], nbytes)

    def gather(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Fence]:
        """Clones of `tensors` (a snapshot save); read them only after the fence."""
        outs = [torch.empty_like(t) for t in tensors]
        pairs = list(zip(tensors, outs))

        def launch() -> None:
            for t, out in pairs:
                out.copy_(t, non_blocking=True)

        return outs, self._issue(launch, [*tensors, *outs], sum(t.nbytes for t in tensors))

    def scatter(self, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> Fence:
        """dsts[i].copy_(srcs[i]) for every i (a restore, or a rollback of rejected rows)."""
        if len(srcs) != len(dsts):
            raise ValueError(f"scatter: {len(srcs)} sources for {len(dsts)} destinations")
        for s, d in zip(srcs, dsts):
            if s.shape != d.shape or s.dtype != d.dtype:
                raise ValueError(f"scatter: {s.dtype}{tuple(s.shape)} into {d.dtype}{tuple(d.shape)}")
        pairs = list(zip(srcs, dsts))

        def launch() -> None:
            for s, d in pairs:
                d.copy_(s, non_blocking=True)

        return self._issue(launch, [*srcs, *dsts], sum(s.nbytes for s in srcs))

    def wait_all(self) -> None:
        """Order everything after every copy issued so far (reset and snapshot call this)."""
        self._launch_held(until=self._next_ticket)
        if self._launched and self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._launched.clear()

    @contextlib.contextmanager
    def defer(self) -> Iterator[None]:
        """Test hook: copies issued inside stay in flight until waited for; leaving the
        block launches whatever is still held."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            if not self._deferring:
                self._launch_held(until=self._next_ticket)

    # --- ordering ----------------------------------------------------------------------

    def _issue(self, launch: Callable[[], None], keep: list[torch.Tensor], nbytes: int) -> Fence:
        copy = _Copy(self._next_ticket, launch, keep=keep)
        self._next_ticket += 1
        self.bytes_copied += nbytes
        self._held.append(copy)
        if not self._deferring:
            self._launch_held(until=copy.ticket + 1)
        return Fence(self, copy.ticket, nbytes)

    def _launch_held(self, until: int) -> None:
        while self._held and self._held[0].ticket < until:
            copy = self._held.popleft()
            if self._stream is None:
                copy.launch()  # CPU: the copy is complete when launch returns
                continue
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                copy.launch()
                copy.event = torch.cuda.Event()
                copy.event.record(self._stream)
            for t in copy.keep:
                if t.is_cuda:
                    t.record_stream(self._stream)  # the allocator keeps it until the copy ends
            self._launched.append(copy)

    def _wait(self, ticket: int) -> None:
        self._launch_held(until=ticket + 1)
        last = None
        while self._launched and self._launched[0].ticket <= ticket:
            last = self._launched.popleft()
        if last is not None:  # one stream, in order: its event covers every earlier copy
            torch.cuda.current_stream(self.device).wait_event(last.event)

    def _is_done(self, ticket: int) -> bool:
        self._retire_finished()
        if self._held and self._held[0].ticket <= ticket:
            return False
        return not (self._launched and self._launched[0].ticket <= ticket)

    def _retire_finished(self) -> None:
        while self._launched and self._launched[0].event.query():
            self._launched.popleft()

    def _kernel_copy(self, pools: list[torch.Tensor], src: Sequence[int], dst: Sequence[int]) -> None:
        cupy = self._cupy
        if self._kernel is None:
            self._kernel = cupy.RawKernel(_KERNEL_SOURCE, "copy_pages")
        page_bytes = [_page_bytes(p) for p in pools]
        vec16 = all(b % 16 == 0 and p.data_ptr() % 16 == 0 for b, p in zip(page_bytes, pools))
        units = [b // 16 for b in page_bytes] if vec16 else page_bytes
        host = [p.data_ptr() for p in pools] + units + list(src) + list(dst)
        # Allocated and uploaded on the copy stream: freed in order with the kernel.
        table = torch.tensor(host, dtype=torch.int64).to(self.device, non_blocking=True)
        with cupy.cuda.Device(self.device.index or 0), cupy.cuda.ExternalStream(self._stream.cuda_stream):
            self._kernel(
                (len(src), len(pools)),
                (_BLOCK_THREADS,),
                (cupy.uint64(table.data_ptr()), cupy.int32(len(pools)), cupy.int32(len(src)), cupy.int32(vec16)),
            )


def _page_bytes(pool: torch.Tensor) -> int:
    return pool[0].numel() * pool.element_size()


def _check_pages(pools: Sequence[torch.Tensor], src: Sequence[int], dst: Sequence[int]) -> None:
    if len(src) != len(dst):
        raise ValueError(f"copy_pages: {len(src)} sources for {len(dst)} destinations")
    if len(set(dst)) != len(dst):
        raise ValueError(f"copy_pages: a destination page repeats in {list(dst)}")
    if set(src) & set(dst):
        raise ValueError(f"copy_pages: pages {sorted(set(src) & set(dst))} are both source and destination")
    for pool in pools:
        bad = [p for p in (*src, *dst) if not 0 <= p < pool.shape[0]]
        if bad:
            raise ValueError(f"copy_pages: pages {bad} outside a pool of {pool.shape[0]}")


def _torch_copy_pages(pools: list[torch.Tensor], src: Sequence[int], dst: Sequence[int]) -> None:
    device = pools[0].device
    src_t = torch.tensor(list(src), dtype=torch.long, device=device)
    dst_t = torch.tensor(list(dst), dtype=torch.long, device=device)
    for pool in pools:
        pool.index_copy_(0, dst_t, pool.index_select(0, src_t))
