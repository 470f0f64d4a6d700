"""Drafting with the model's own MTP head (`--draft mtp`): the device proposes, the engine
verifies.

A device with a draft head (`DeviceInfo.draft_head`) returns, with a lane's round result, up to
`LaneWork.propose` tokens its MTP head predicts after the token just sampled, and the head's
probability of the first one. `MtpDrafter` keeps the latest proposals of its stream and hands
them to the next round as its offer (`draftpolicy.Offer`); the round's `allocate` decides how many
it verifies, as it does for the n-gram drafter. The head's confidence is the proposal's
strength (the n-gram drafter's is its match length).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from prefixd.scheduler.draftpolicy import DraftPolicy, Offer

# The head's probability of its first draft -> strength 1, 2 or 3.
STRENGTH_P = (0.4, 0.8)
IDLE_ROUNDS = 4


class MtpDrafter:
    """A stream's drafts from the device's draft head."""

    def __init__(self, max_k: int) -> None:
        self.policy = DraftPolicy(max_k)
        self._at = -1  # len(generated) the proposals follow
        self._tokens: tuple[int, ...] = ()
        self._p = 0.0
        self._strength = 1  # of the last proposal verified
        self._last_k: int | None = None  # the last draft length the round granted
        self._offer: Offer | None = None
        self._idle = 0  # rounds without proposals since the policy last drafted nothing

    def wants(self) -> int:
        """Proposals to ask the device for this round (called once per round that samples):
        one more than the round granted last time (the most at first); while it grants
        nothing, one every `IDLE_ROUNDS` rounds (the policy's own probes ride on those), so a
        head that is never right costs little more than its rows."""
        if self._last_k is None:
            return self.policy.max_k
        if self._last_k > 0:
            return min(self.policy.max_k, self._last_k + 1)
        self._idle += 1
        if self._idle < IDLE_ROUNDS:
            return 0
        self._idle = 0
        return 1

    def receive(self, at: int, tokens: Sequence[int], p: float) -> None:
        """The device proposed `tokens` after the stream's first `at` output tokens."""
        self._at, self._tokens, self._p = at, tuple(tokens), p

    def offer(self, generated: Sequence[int], limit: int) -> Offer | None:
        """What this lane could draft after `generated`, at most `limit` tokens: the latest
        proposals when they follow exactly these tokens; None otherwise."""
        self._offer = None
        if self._at != len(generated) or not self._tokens or limit <= 0:
            return None
        self._strength = 1 + sum(self._p >= t for t in STRENGTH_P)
        tokens = self._tokens[: min(self.policy.max_k, limit)]
        self._offer = Offer(tokens, tuple(self.policy.chances(self._strength, len(tokens))))
        return self._offer

    def take(self, k: int) -> tuple[int, ...]:
        """The drafts to verify once the round granted this lane `k` of its offer."""
        if self._offer is None:
            return ()
        self._last_k = self.policy.granted(k)
        return self._offer.tokens[: self._last_k]

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Feed back one verify: `num_accepted` of `num_drafted` drafts were accepted."""
        if num_drafted:
            self.policy.record(self._strength, num_drafted, num_accepted)


def ask_proposals(planned: list) -> list:
    """`planned` (rounds.PlannedWork) with `LaneWork.propose` set on every work that samples
    for a stream drafting with the head."""
    out = []
    for p in planned:
        drafter = p.stream.drafter
        if isinstance(drafter, MtpDrafter) and p.work.sample_rows and (n := drafter.wants()):
            p = dataclasses.replace(p, work=dataclasses.replace(p.work, propose=n))
        out.append(p)
    return out


def offer_proposals(stream, res) -> None:
    """Hand a round's proposals (`LaneResult.proposals`) to the stream's drafter."""
    if res is not None and res.proposals and isinstance(stream.drafter, MtpDrafter):
        stream.drafter.receive(len(stream.generated), res.proposals, res.proposal_p)
