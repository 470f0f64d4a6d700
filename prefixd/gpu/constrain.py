"""The grammar mask of one stream, applied to its fp32 logits row before sampling.

Every row a stream samples from passes through `GrammarMask.apply`, and every token it
takes (sampled or accepted from a draft) through `advance`, so the mask of row i depends
only on the tokens before it: constrained sampling stays deterministic, and exact cold,
resumed and beside other lanes.

Per row and lane the cost is llguidance's walk of the token trie (the GIL dropped) into a
packed int32 buffer, one numpy unpack, and one copy of the row with the forbidden ids at
-inf. On the CPU that copy is numpy's, on the caller's thread: a torch op on a 49k row
would wake the OpenMP pool once per lane, and where a core is busy each wake-up waits for it.

With `background`, the mask of the next row is built on one shared worker thread as soon
as `advance` takes a token, and `apply` waits for it; the matcher is never read or moved
while it runs. That pays where the forward leaves CPU cores free (an accelerator); on the
CPU the forward's OpenMP threads want every core, so the mask is built on the caller's.

    advance(t) ──> [worker:] matcher mask -> packed int32 words -> forbidden (vocab,) bool
    apply(row) ──> [wait for the worker] ──> copy of row, forbidden ids at -inf
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

_NEG_INF = float("-inf")
_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def mask_worker() -> ThreadPoolExecutor:
    """The one thread every stream's next mask is computed on (started on first use)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixd-mask")
        return _worker


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
        self._words = np.zeros((ll_tokenizer.vocab_size + 31) // 32, dtype=np.int32)  # packed, bit i = id i
        self._background = background
        self._forbidden: np.ndarray | None = None  # (vocab_size,) bool of the current state
        self._pending: Future[np.ndarray] | None = None
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
        self._settle()
        if self._forbidden is None:
            self._forbidden = self._compute()
        return self._forbidden

    def apply(self, row: torch.Tensor) -> torch.Tensor:
        """`row` (vocab_size,) with the ids the grammar forbids at -inf (a new tensor)."""
        forbidden = self.forbidden()
        if row.device.type != "cpu" or row.dtype != torch.float32:
            return row.masked_fill(torch.from_numpy(forbidden).to(row.device, non_blocking=True), _NEG_INF)
        out = row.numpy().copy()  # numpy on this thread: no OpenMP wake-up per row
        np.copyto(out, _NEG_INF, where=forbidden)
        return torch.from_numpy(out)

    def advance(self, token: int) -> None:
        """Take `token` (a wrong one puts the matcher in its error state: only the end follows);
        with `background`, start building the next mask."""
        self._settle()
        if not self._matcher.is_error():
            self._matcher.consume_token(token)
        self._forbidden = None
        self._prepare()

    def _prepare(self) -> None:
        if self._background:
            self._pending = mask_worker().submit(self._compute)

    def _settle(self) -> None:
        """Wait for the mask in flight (its matcher is not touched while it runs)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._forbidden = pending.result()

    def _compute(self) -> np.ndarray:
        forbidden = np.ones(self.vocab_size, dtype=np.bool_)
        if not self._matcher.is_error():
            self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)  # drops the GIL
            bits = np.unpackbits(self._words.view(np.uint8), count=self._num_ids, bitorder="little")
            np.equal(bits, 0, out=forbidden[: self._num_ids])
        if forbidden.all():
            forbidden[self._end_id] = False
        return forbidden
