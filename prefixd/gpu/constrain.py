"""The grammar mask of one stream, applied to its fp32 logits row before sampling.

Every row a stream samples from passes through `GrammarMask.apply`, and every token it
takes (sampled or accepted from a draft) through `advance`, so the mask of row i depends
only on the tokens before it: constrained sampling stays deterministic, and exact cold,
resumed and beside other lanes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_NEG_INF = float("-inf")


class GrammarMask:
    """llguidance matcher state for one stream. A grammar that allows no token (an error,
    or nothing left to say) allows only the end token, so the stream ends instead of hanging."""

    def __init__(self, ll_tokenizer: Any, grammar: str, *, vocab_size: int) -> None:
        import llguidance

        self._matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        self._ll_vocab = ll_tokenizer.vocab_size
        self._end_id = ll_tokenizer.eos_token
        self.vocab_size = vocab_size

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def allowed(self) -> np.ndarray:
        """(vocab_size,) bool: the ids the grammar allows next."""
        out = np.zeros(self.vocab_size, dtype=np.bool_)
        if not self._matcher.is_error():
            bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            n = min(self._ll_vocab, self.vocab_size)
            out[:n] = bits[:n]
        if not out.any():
            out[self._end_id] = True
        return out

    def apply(self, row: torch.Tensor) -> torch.Tensor:
        """`row` with the ids the grammar forbids at -inf (a new tensor; one torch op)."""
        forbidden = torch.from_numpy(~self.allowed())
        return row.masked_fill(forbidden.to(row.device, non_blocking=True), _NEG_INF)

    def advance(self, token: int) -> None:
        """Take `token` (a wrong one puts the matcher in its error state: only the end follows)."""
        if not self._matcher.is_error():
            self._matcher.consume_token(token)
