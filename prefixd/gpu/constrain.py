"""The grammar mask of one stream, applied to its fp32 logits row before sampling.

Every row a stream samples from passes through `GrammarMask.apply`, and every token it
takes (sampled or accepted from a draft) through `advance`, so the mask of row i depends
only on the tokens before it: constrained sampling stays deterministic, and exact cold,
resumed and beside other lanes.

Per row and lane the cost is llguidance's walk of the token trie (the GIL dropped) into a
packed int32 buffer, then, once per grammar state, one numpy unpack into an int32 word per
id: `keep` (all ones where allowed, 0 where forbidden) and `fill` (-inf's bits where
forbidden, 0 where allowed). Applying it to a float32 row is then two branch-free integer
ops on the row's bits, `(row & keep) | fill`: the row's own bits where allowed (NaN and inf
included), -inf where forbidden, the bits masked_fill gives, in ~10 us for 49k ids instead of
~100 us for a masked copy. On the CPU that runs in numpy, on the caller's thread: a torch op
on a 49k row would wake the OpenMP pool once per lane, and where a core is busy each wake-up
waits for it. Off the CPU the mask is one masked_fill on the device.

With `background`, the mask of the next row is built on one shared worker thread as soon
as `advance` takes a token, and `apply` waits for it; the matcher is never read or moved
while it runs. The runner asks for it off the CPU, where the forward leaves the host's cores
free. On the CPU it builds masks in a batch instead: while it samples a round's lanes it holds
every next mask back (`held_masks`), and when the loop ends `build_masks` has llguidance walk
all of them at once on its own threads (one per core, the GIL dropped), then unpacks each.
On 2 cores a worker beside the forward cost more than the masks: each of its wake-ups stalled
the int4 products' thread team, and its GIL hand-offs slowed every later lane's `apply`
(bench/constrain.py: 8 lanes, constrained / unconstrained decode round 1.09-1.12 with the
worker, 1.08 batched; llguidance's batched walk is ~4 ms of a ~100 ms round). Off the CPU the
held masks go to the worker when the loop ends, for the same GIL reason.

    advance(t) ──> [held, or worker:] matcher mask -> packed int32 words -> keep, fill (vocab,) int32
    end of held_masks ──> build_masks: every held matcher's mask in one llguidance batch
    apply(row) ──> [wait for the worker] ──> (row bits & keep) | fill, a new row
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch

_NEG_INF = float("-inf")
_NEG_INF_BITS = np.array(_NEG_INF, dtype=np.float32).view(np.int32)
_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()
_holding = threading.local()  # .masks: the masks whose next build waits for held_masks to end


def mask_worker() -> ThreadPoolExecutor:
    """The one thread every stream's next mask is computed on (started on first use)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixd-mask")
        return _worker


@contextmanager
def held_masks() -> Iterator[None]:
    """The next masks of masks advanced inside this block are built when it ends: inline ones
    together (build_masks), background ones on the worker. The calling thread's masks only; a
    mask needed inside the block (a draft's verify rows) is built on the spot."""
    if getattr(_holding, "masks", None) is not None:  # nested: the outer block starts them
        yield
        return
    _holding.masks = held = []
    try:
        yield
    finally:
        _holding.masks = None
        build_masks([m for m in held if not m._background])  # now, together, on every core
        for mask in dict.fromkeys(m for m in held if m._background):  # on the worker, in order
            mask._prepare()


class GrammarMask:
    """llguidance matcher state for one stream. A grammar that allows no token (an error,
    or nothing left to say) allows only the end token, so the stream ends instead of hanging.

    `background` builds each next mask on the shared worker thread (the same bits, sooner)."""

    def __init__(self, ll_tokenizer: Any, grammar: str, *, vocab_size: int, background: bool = False) -> None:
        import llguidance

        self._matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        self._end_id = ll_tokenizer.eos_token
        self.vocab_size = vocab_size
        self._num_ids = min(ll_tokenizer.vocab_size, vocab_size)  # ids the grammar speaks of
        self._packed = np.zeros((ll_tokenizer.vocab_size + 31) // 32, dtype=np.int32)  # packed, bit i = id i
        self._background = background
        self._state: tuple[np.ndarray, np.ndarray] | None = None  # (keep, fill) of the current state
        self._forbidden: np.ndarray | None = None  # (vocab_size,) bool, built from keep when asked
        self._pending: Future[tuple[np.ndarray, np.ndarray]] | None = None
        self._failure: Exception | None = None  # a batched build's error, raised by the next apply
        self._prepare()

    @property
    def error(self) -> str | None:
        self._settle()
        return self._matcher.get_error() if self._matcher.is_error() else None

    def allowed(self) -> np.ndarray:
        """(vocab_size,) bool: the ids the grammar allows next."""
        return ~self.forbidden()

    def forbidden(self) -> np.ndarray:
        """(vocab_size,) bool: the ids the grammar forbids next (built once per state; not to be written)."""
        if self._forbidden is None:
            self._forbidden = self._keep_fill()[0] == 0
        return self._forbidden

    def apply(self, row: torch.Tensor) -> torch.Tensor:
        """`row` (vocab_size,) with the ids the grammar forbids at -inf (a new tensor)."""
        if row.device.type != "cpu" or row.dtype != torch.float32:
            return row.masked_fill(torch.from_numpy(self.forbidden()).to(row.device, non_blocking=True), _NEG_INF)
        keep, fill = self._keep_fill()  # numpy on this thread: no OpenMP wake-up per row
        out = np.bitwise_and(row.numpy().view(np.int32), keep)
        np.bitwise_or(out, fill, out=out)
        return torch.from_numpy(out.view(np.float32))

    def advance(self, token: int) -> None:
        """Take `token` (a wrong one puts the matcher in its error state: only the end follows);
        with `background`, start building the next mask."""
        self._settle()
        if not self._matcher.is_error():
            self._matcher.consume_token(token)
        self._state = self._forbidden = None
        self._failure = None
        self._prepare()

    def _prepare(self) -> None:
        if self._state is not None or self._pending is not None:
            return
        held = getattr(_holding, "masks", None)
        if held is not None:
            held.append(self)  # built when the block ends (build_masks, or on the worker)
        elif self._background:
            self._pending = mask_worker().submit(self._compute)

    def _settle(self) -> None:
        """Wait for the mask in flight (its matcher is not touched while it runs)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._state = pending.result()

    def _keep_fill(self) -> tuple[np.ndarray, np.ndarray]:
        """(keep, fill) of the current state, built once."""
        self._settle()
        if self._failure is not None:  # raised here, in the lane's own sampling: it fails alone
            failure, self._failure = self._failure, None
            raise failure
        if self._state is None:
            self._state = self._compute()
        return self._state

    def _compute(self) -> tuple[np.ndarray, np.ndarray]:
        """keep: -1 (all bits) where allowed, 0 where forbidden; fill: -inf's bits where forbidden, else 0."""
        live = not self._matcher.is_error()
        if live:
            self._matcher.unsafe_compute_mask_ptr(self._packed.ctypes.data, self._packed.nbytes)  # drops the GIL
        return self._unpack(live)

    def _unpack(self, live: bool) -> tuple[np.ndarray, np.ndarray]:
        """(keep, fill) from the packed mask (`live`: the matcher wrote it; else nothing is allowed)."""
        keep = np.zeros(self.vocab_size, dtype=np.int32)
        if live:
            bits = np.unpackbits(self._packed.view(np.uint8), count=self._num_ids, bitorder="little")
            np.subtract(0, bits, out=keep[: self._num_ids], dtype=np.int32)
        if not keep.any():
            keep[self._end_id] = -1
        return keep, np.bitwise_and(np.invert(keep), _NEG_INF_BITS)


def build_masks(masks: list[GrammarMask]) -> None:
    """Build the next mask of every mask in `masks` that has none: llguidance walks the token
    trie for all of them at once on its own threads (the GIL dropped), then each unpacks.
    The bits are those each would build alone."""
    todo = [m for m in dict.fromkeys(masks) if m._state is None and m._pending is None]
    live = [m for m in todo if not m._matcher.is_error()]
    by_size: dict[int, list[GrammarMask]] = {}
    for m in live:
        by_size.setdefault(m._packed.size, []).append(m)
    walked: set[int] = set()
    for words, group in by_size.items():
        batch = np.zeros((len(group), words), dtype=np.int32)
        try:
            _mask_executor().unsafe_compute_mask_ptr([(m._matcher, k) for k, m in enumerate(group)],
                                                     batch.ctypes.data, batch.strides[0], len(group))
        except Exception:  # noqa: BLE001 - each mask is built alone below, and fails alone
            continue
        for k, m in enumerate(group):
            m._packed[:] = batch[k]
            walked.add(id(m))
    for m in todo:
        try:  # an error belongs to its own stream: the next apply raises it (_keep_fill)
            m._state = m._unpack(True) if id(m) in walked else m._compute()
        except Exception as e:  # noqa: BLE001
            m._failure = e


_executor: Any = None


def _mask_executor() -> Any:
    """llguidance's thread pool for batched masks, one thread per usable core (made on first use)."""
    global _executor
    with _worker_lock:
        if _executor is None:
            import llguidance

            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            _executor = llguidance.LLExecutor(num_threads=max(1, cores or 1))
        return _executor
