"""A stream's drafter: what it proposes each decode round and how long its drafts are.

Drafting never changes a stream's tokens (verification keeps only what the model itself
would have produced); it only changes how many rows a round verifies.
"""

from __future__ import annotations

from typing import Sequence

from prefixd.scheduler.ngram import DraftLength, NgramIndex


class StreamDrafter:
    """Prompt-lookup drafts over the stream's prompt and accepted output."""

    def __init__(self, prompt: Sequence[int], max_k: int) -> None:
        self.index = NgramIndex(prompt)
        self.length = DraftLength(max_k)
        self._num_prompt = len(self.index)

    def propose(self, generated: Sequence[int], limit: int) -> tuple[int, ...]:
        """Drafts to verify after `generated` (the stream's output so far; the index catches
        up on the tokens it has not seen), at most `limit` of them."""
        seen = len(self.index) - self._num_prompt
        self.index.extend(generated[seen:])
        k = min(self.length.next_length(), max(0, limit))
        return tuple(self.index.propose(k))

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Feed back one verify: `num_accepted` of `num_drafted` drafts were accepted."""
        self.length.record(num_drafted, num_accepted)


def new_drafter(mode: str, prompt: Sequence[int], max_k: int) -> StreamDrafter | None:
    """The drafter for `mode` ("off" or a max of 0: none)."""
    if mode == "off" or max_k == 0:
        return None
    if mode == "ngram":
        return StreamDrafter(prompt, max_k)
    raise ValueError(f"unknown draft mode {mode!r}")
