"""A stream's drafter: what it proposes each decode round and how long its drafts are.

Drafting never changes a stream's tokens (verification keeps only what the model itself
would have produced); it only changes how many rows a round verifies.
"""

from __future__ import annotations

from typing import Sequence

from prefixd.scheduler.draftpolicy import DraftPolicy, RoundCosts
from prefixd.scheduler.mtp import MtpDrafter
from prefixd.scheduler.ngram import NgramIndex


class StreamDrafter:
    """Prompt-lookup drafts over the stream's prompt and accepted output, as long as the
    lane's acceptance and the round's cost curve make worth it (`DraftPolicy`)."""

    def __init__(self, prompt: Sequence[int], max_k: int, costs: RoundCosts | None = None) -> None:
        self.index = NgramIndex(prompt, max_n=MAX_MATCH)
        self.policy = DraftPolicy(max_k, costs)
        self._num_prompt = len(self.index)
        self._strength = 0  # suffix length behind the last proposal

    def propose(self, generated: Sequence[int], limit: int) -> tuple[int, ...]:
        """Drafts to verify after `generated` (the stream's output so far; the index catches
        up on the tokens it has not seen), at most `limit` of them."""
        seen = len(self.index) - self._num_prompt
        self.index.extend(generated[seen:])
        tokens, strength = self.index.match(min(self.policy.max_k, max(0, limit)))
        if not tokens:
            return ()
        self._strength = strength
        return tuple(tokens[: self.policy.length(strength)])

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Feed back one verify: `num_accepted` of `num_drafted` drafts were accepted."""
        if num_drafted:
            self.policy.record(self._strength, num_drafted, num_accepted)


MAX_MATCH = 4  # longest suffix the index matches


def new_drafter(mode: str, prompt: Sequence[int], max_k: int, costs: RoundCosts | None = None):
    """The drafter for `mode` ("off" or a max of 0: none); `costs` is the engine's shared
    round cost curve (a private one when None). Every drafter has `propose(generated, limit)`
    and `record(num_drafted, num_accepted)`: "ngram" looks up the stream's own tokens, "mtp"
    passes on what the device's draft head proposed (`scheduler.mtp`)."""
    if mode == "off" or max_k == 0:
        return None
    if mode == "ngram":
        return StreamDrafter(prompt, max_k, costs)
    if mode == "mtp":
        return MtpDrafter(max_k, costs)
    raise ValueError(f"unknown draft mode {mode!r}")
