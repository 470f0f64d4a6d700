"""How many drafts a round verifies: expected accepted tokens against what the rows cost.

A round's time grows with its rows, but not in proportion: a padded kernel may run 1 to 4
rows in the time of one, and at 8 lanes every row more slows the whole round (CPU int4: about
5 % of an 8-row round a row). `RoundCosts` learns that curve from the decode rounds the
engine runs (row count -> round seconds, a moving average per row count, interpolated
between counts seen). Each lane's `DraftPolicy` keeps its acceptance rate per match strength.

The decision is per round, not per lane: a lane's drafts slow every other lane of the round.
`allocate` takes every lane's offer (how many drafts it could verify and p, the chance each
is accepted once the ones before it were; drafts stop at the first miss, so the j-th is kept
with chance p^j) and picks the round's draft rows: the m offered rows with the highest
chance of being kept, m maximizing the round's expected tokens per second

    score(m) = (decoding lanes + sum of the m best p_i^j) / round_s(decoding lanes + m)

(the nearest-to-best m wins when it is within `min_gain` of the best, so noise in the curve
does not buy rows). Text that does not repeat stops drafting; a lane that sat out
`probe_every` rounds with a proposal probes one token, so it can learn that it repeats again.

Torch-free and clock-free: the engine feeds `RoundCosts.observe_round` each round's plan and
its seconds on the engine's clock (from the start of the step to the device's answer); tests
feed it numbers.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from prefixd.scheduler.records import RoundPlan

# Match strengths: the suffix that matched was 1, 2, or 3+ tokens long.
NUM_STRENGTHS = 3


@dataclass(frozen=True, slots=True)
class Offer:
    """Drafts a lane could verify this round: `tokens`, and for each the chance that it is
    kept (accepted along with every draft before it)."""

    tokens: tuple[int, ...]
    chances: tuple[float, ...]


class RoundCosts:
    """A decode round's time as a function of its row count, learned online.

    Per row count it keeps the median of the last `window` rounds: on a shared machine a round
    now and then takes many times its due (the engine thread lost its core), and a mean would
    price drafts on those. A curve point is never above a larger count's (more rows never run
    faster; a count inflated by such a round, then no longer visited, is held down by the
    counts past it). Before a row count has been seen its time is interpolated between the
    nearest counts seen on either side; beyond them it is extrapolated by the outer segment's
    slope or by `prior_row_frac` of the smallest round's time per row, the larger (a guess,
    corrected once such a round runs). So a lane that has only drafted still learns what its
    undrafted round would cost."""

    def __init__(self, *, window: int = 9, prior_row_frac: float = 0.05) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.prior_row_frac = prior_row_frac
        self._samples: dict[int, deque[float]] = {}  # row count -> its last rounds' seconds
        self._round_s: dict[int, float] = {}  # row count -> curve point
        self._rows: list[int] = []  # sorted keys of _round_s

    def observe_round(self, plan: RoundPlan, round_s: float) -> None:
        """`observe` one round the device ran in `round_s` seconds (planning, forward and
        sampling: all that grows with rows). Rounds with a prefill chunk are left out: drafts
        are priced against decode rounds, and a chunk's rows cost what a decode row does not
        (attention over the chunk, its snapshot captures)."""
        if plan.lanes and not any(w.prefill for w in plan.lanes):
            self.observe(plan.num_rows, round_s)

    def observe(self, num_rows: int, round_s: float) -> None:
        """One decode round ran `num_rows` rows in `round_s` seconds."""
        if num_rows <= 0 or round_s <= 0.0:
            return
        samples = self._samples.get(num_rows)
        if samples is None:
            bisect.insort(self._rows, num_rows)
            samples = self._samples[num_rows] = deque(maxlen=self.window)
        samples.append(round_s)
        cap = float("inf")
        for rows in reversed(self._rows):
            cap = min(cap, statistics.median(self._samples[rows]))
            self._round_s[rows] = cap

    def round_s(self, num_rows: int) -> float | None:
        """Estimated seconds of a round of `num_rows` rows; None before any round."""
        if not self._rows:
            return None
        known = self._round_s.get(num_rows)
        if known is not None:
            return known
        i = bisect.bisect_left(self._rows, num_rows)
        if i == len(self._rows):
            top = self._rows[-1]
            return self._round_s[top] + self._outer_slope(-1, -2) * (num_rows - top)
        if i == 0:  # below the smallest seen: down by the first segment's slope, or the guess
            bottom = self._rows[0]
            low = self._round_s[bottom] - self._outer_slope(0, 1) * (bottom - num_rows)
            return max(low, self.prior_row_frac * self._round_s[bottom])
        lo, hi = self._rows[i - 1], self._rows[i]
        return self._round_s[lo] + (self._round_s[hi] - self._round_s[lo]) * (num_rows - lo) / (hi - lo)

    def _outer_slope(self, edge: int, inner: int) -> float:
        """Seconds a row past the curve's `edge` count: the outer segment's slope when it is
        steeper than the guess, else the guess."""
        per_row = self.prior_row_frac * self._round_s[self._rows[0]]
        if len(self._rows) > 1:
            a, b = self._rows[edge], self._rows[inner]
            per_row = max(per_row, (self._round_s[a] - self._round_s[b]) / (a - b))
        return per_row


def allocate(offers: Sequence[Sequence[float]], costs: RoundCosts, *, base_rows: int,
             base_tokens: float | None = None, min_gain: float = 0.02) -> list[int]:
    """Draft lengths for one round. `offers[i][j]` is the chance that lane i's (j+1)-th draft
    is kept (non-increasing in j; one entry per draft the lane could verify); the round
    already runs `base_rows` rows that emit `base_tokens` tokens (default: one per row).

    The m offered rows kept with the highest chances are drafted, m maximizing expected
    tokens per second of round, the smallest m within `min_gain` of the best. Nothing is
    drafted before a decode round was measured (it costs one undrafted round)."""
    tokens = float(base_rows if base_tokens is None else base_tokens)
    if costs.round_s(max(base_rows, 1)) is None:
        return [0] * len(offers)
    # Rows in the order they are worth drafting; a lane's j-th row never before its (j-1)-th.
    rows = sorted(((-gain, i, j) for i, offer in enumerate(offers) for j, gain in enumerate(offer)))
    scores = [tokens / costs.round_s(max(base_rows, 1))]
    for m, (neg_gain, _, _) in enumerate(rows, start=1):
        tokens -= neg_gain
        scores.append(tokens / costs.round_s(base_rows + m))
    best = max(scores)
    m = next(m for m, score in enumerate(scores) if score * (1.0 + min_gain) >= best)
    lengths = [0] * len(offers)
    for _, i, _ in rows[:m]:
        lengths[i] += 1
    return lengths


class DraftPolicy:
    """One lane's acceptance per match strength, and its probes.

    Acceptance is counted per match strength (how long the matched suffix was) as decayed
    successes over trials: a verify that accepted a of k drafts adds a successes and
    a + 1 trials, or k trials when all were accepted."""

    def __init__(self, max_k: int, *, decay: float = 0.9, prior: tuple[float, float] = (1.0, 2.0),
                 probe_every: int = 16) -> None:
        if max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {max_k}")
        self.max_k = max_k
        self.decay = decay
        self.probe_every = probe_every
        self._hits = [prior[0]] * NUM_STRENGTHS
        self._trials = [prior[1]] * NUM_STRENGTHS
        self._sat_out = 0  # rounds in a row with a proposal but no draft

    def acceptance(self, strength: int) -> float:
        """Estimated chance that a draft token is accepted, given the ones before it were."""
        s = self._slot(strength)
        return self._hits[s] / self._trials[s]

    def chances(self, strength: int, n: int) -> list[float]:
        """The chance that each of n drafts proposed at `strength` is kept: p, p^2, ..."""
        p = self.acceptance(strength)
        return [p ** j for j in range(1, min(n, self.max_k) + 1)]

    def granted(self, k: int) -> int:
        """The draft length after the round gave this lane `k` rows: k, or a one-token probe
        when it is the `probe_every`-th round in a row that the lane sat out."""
        if k > 0 or self.max_k == 0:
            self._sat_out = 0
            return k
        self._sat_out += 1
        if self._sat_out >= self.probe_every:
            self._sat_out = 0
            return 1
        return 0

    def record(self, strength: int, num_drafted: int, num_accepted: int) -> None:
        """Feed back one verify of `num_drafted` drafts proposed at `strength`."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"accepted {num_accepted} of {num_drafted} drafted")
        if num_drafted == 0:
            return
        s = self._slot(strength)
        trials = num_accepted + (0 if num_accepted == num_drafted else 1)
        self._hits[s] = self.decay * self._hits[s] + num_accepted
        self._trials[s] = self.decay * self._trials[s] + trials

    @staticmethod
    def _slot(strength: int) -> int:
        if strength < 1:
            raise ValueError(f"match strength must be >= 1, got {strength}")
        return min(strength, NUM_STRENGTHS) - 1
