"""A stream's drafter: what it proposes each decode round, and what it is worth.

Drafting never changes a stream's tokens (verification keeps only what the model itself
would have produced); it only changes how many rows a round verifies. A round asks every
drafting lane for its `offer` first, then `draftpolicy.allocate` shares the round's draft rows
between them, and each lane `take`s its share.
"""

from __future__ import annotations

from typing import Sequence

from prefixd.scheduler.draftpolicy import DraftPolicy, Offer
from prefixd.scheduler.mtp import MtpDrafter
from prefixd.scheduler.ngram import NgramIndex
from prefixd.scheduler.records import DraftMode


class StreamDrafter:
    """Prompt-lookup drafts over the stream's prompt and accepted output, with the lane's
    acceptance per match strength (`DraftPolicy`)."""

    def __init__(self, prompt: Sequence[int], max_k: int) -> None:
        self.index = NgramIndex(prompt, max_n=MAX_MATCH)
        self.policy = DraftPolicy(max_k)
        self._num_prompt = len(self.index)
        self._strength = 0  # suffix length behind the last proposal
        self._offer: Offer | None = None

    def offer(self, generated: Sequence[int], limit: int) -> Offer | None:
        """What this lane could draft after `generated` (the stream's output so far; the index
        catches up on the tokens it has not seen), at most `limit` tokens; None without a match."""
        seen = len(self.index) - self._num_prompt
        self.index.extend(generated[seen:])
        tokens, strength = self.index.match(min(self.policy.max_k, max(0, limit)))
        self._offer = None
        if tokens:
            self._strength = strength
            self._offer = Offer(tuple(tokens), tuple(self.policy.chances(strength, len(tokens))))
        return self._offer

    def take(self, k: int) -> tuple[int, ...]:
        """The drafts to verify once the round granted this lane `k` of its offer (a probe of
        one when the lane sat out long enough); () without an offer this round."""
        if self._offer is None:
            return ()
        return self._offer.tokens[: self.policy.granted(k)]

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Feed back one verify: `num_accepted` of `num_drafted` drafts were accepted."""
        if num_drafted:
            self.policy.record(self._strength, num_drafted, num_accepted)


MAX_MATCH = 4  # longest suffix the index matches


def new_drafter(mode: DraftMode, prompt: Sequence[int], max_k: int) -> StreamDrafter | MtpDrafter | None:
    """The drafter for `mode` ("off" or a max of 0: none). Every drafter has `offer`, `take`
    and `record`: "ngram" looks up the stream's own tokens, "mtp" passes on what the device's
    draft head proposed (`scheduler.mtp`)."""
    if mode == "off" or max_k == 0:
        return None
    if mode == "ngram":
        return StreamDrafter(prompt, max_k)
    if mode == "mtp":
        return MtpDrafter(max_k)
    raise ValueError(f"unknown draft mode {mode!r}")
