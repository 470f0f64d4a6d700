"""How long a lane's draft is: its expected accepted tokens against what the extra rows cost.

A round's time grows with its rows, but not in proportion: a padded kernel may run 1 to 4
rows in the time of one, and a round of 8 lanes pays for rows in steps. `RoundCosts` learns
that curve from the rounds the engine runs (row count -> round seconds, a moving average
per row count, interpolated between counts seen). `DraftPolicy` keeps a lane's acceptance
rate per match strength and picks the draft length k that maximizes the round's expected
tokens per second:

    score(k) = (tokens of the other lanes + 1 + p + p^2 + ... + p^k) / round_s(rows + k)

where p is the chance that a drafted token is accepted once the ones before it were (drafts
stop at the first miss, so the j-th is kept with chance p^j). k = 0 when no k > 0 beats it:
text that does not repeat stops drafting, and drafting resumes through a one-token probe
every `probe_every` rounds it sat out.

Torch-free and clock-free: the engine feeds `RoundCosts.observe_round` each round's plan,
result and seconds on its clock (from the start of the step to the device's answer); tests
feed it numbers.
"""

from __future__ import annotations

import bisect

from prefixd.scheduler.records import RoundPlan, RoundResult

# Match strengths: the suffix that matched was 1, 2, or 3+ tokens long.
NUM_STRENGTHS = 3


class RoundCosts:
    """A round's time as a function of its row count, learned online.

    Before a row count has been seen its time is interpolated between the nearest counts seen
    on either side; beyond them it is extrapolated by the outer segment's slope or by
    `prior_row_frac` of the smallest round's time per row, the larger (a guess, corrected once
    such a round runs). So a lane that has only drafted still learns what its undrafted round
    would cost."""

    def __init__(self, *, alpha: float = 0.25, prior_row_frac: float = 0.05) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.prior_row_frac = prior_row_frac
        self._round_s: dict[int, float] = {}  # row count -> moving average of round seconds
        self._rows: list[int] = []  # sorted keys of _round_s
        self.last_rows = 0  # rows of the last decode round
        self.last_lanes = 0  # decoding lanes in it
        self.last_tokens = 0  # tokens its decoding lanes emitted

    def observe_round(self, plan: RoundPlan, result: RoundResult, round_s: float) -> None:
        """`observe` one round the device ran in `round_s` seconds (planning, forward and
        sampling: all that grows with rows): its rows, decoding lanes and their tokens."""
        decoding = {w.lane for w in plan.lanes if not w.prefill}
        tokens = sum(len(r.sampled) for r in result.lanes if r.lane in decoding)
        self.observe(plan.num_rows, round_s, num_lanes=len(decoding), num_tokens=tokens)

    def observe(self, num_rows: int, round_s: float, *, num_lanes: int = 0, num_tokens: int = 0) -> None:
        """One round ran `num_rows` rows in `round_s` seconds; `num_lanes` of its lanes
        decoded (or verified) and emitted `num_tokens` tokens between them."""
        if num_rows <= 0 or round_s <= 0.0:
            return
        old = self._round_s.get(num_rows)
        if old is None:
            bisect.insort(self._rows, num_rows)
            self._round_s[num_rows] = round_s
        else:
            self._round_s[num_rows] = old + self.alpha * (round_s - old)
        if num_lanes:
            self.last_rows, self.last_lanes, self.last_tokens = num_rows, num_lanes, num_tokens

    def round_s(self, num_rows: int) -> float | None:
        """Estimated forward seconds of a round of `num_rows` rows; None before any round."""
        if not self._rows:
            return None
        known = self._round_s.get(num_rows)
        if known is not None:
            return known
        i = bisect.bisect_left(self._rows, num_rows)
        if i == len(self._rows):
            top = self._rows[-1]
            per_row = self.prior_row_frac * self._round_s[self._rows[0]]
            if len(self._rows) > 1:  # the last segment's slope, when steeper than the guess
                below = self._rows[-2]
                per_row = max(per_row, (self._round_s[top] - self._round_s[below]) / (top - below))
            return self._round_s[top] + per_row * (num_rows - top)
        if i == 0:  # below the smallest seen: the first segment's slope, or the guess
            bottom = self._rows[0]
            per_row = self.prior_row_frac * self._round_s[bottom]
            if len(self._rows) > 1:
                above = self._rows[1]
                per_row = max(per_row, (self._round_s[above] - self._round_s[bottom]) / (above - bottom))
            return max(self._round_s[bottom] - per_row * (bottom - num_rows), self.prior_row_frac * self._round_s[bottom])
        lo, hi = self._rows[i - 1], self._rows[i]
        return self._round_s[lo] + (self._round_s[hi] - self._round_s[lo]) * (num_rows - lo) / (hi - lo)

    def others(self) -> tuple[float, float]:
        """(rows, tokens) the other decoding lanes bring to a round, from the last one."""
        if self.last_lanes <= 1:
            return 0.0, 0.0
        share = (self.last_lanes - 1) / self.last_lanes
        return self.last_rows * share, self.last_tokens * share


class DraftPolicy:
    """One lane's draft length from its acceptance and the round's cost curve.

    Acceptance is counted per match strength (how long the matched suffix was) as decayed
    successes over trials: a verify that accepted a of k drafts adds a successes and
    a + 1 trials, or k trials when all were accepted."""

    def __init__(self, max_k: int, costs: RoundCosts | None = None, *, decay: float = 0.9,
                 prior: tuple[float, float] = (1.0, 2.0), probe_every: int = 16, min_gain: float = 0.02) -> None:
        if max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {max_k}")
        self.max_k = max_k
        self.costs = costs if costs is not None else RoundCosts()
        self.decay = decay
        self.probe_every = probe_every
        self.min_gain = min_gain  # a longer draft must beat a shorter one by this fraction
        self._hits = [prior[0]] * NUM_STRENGTHS
        self._trials = [prior[1]] * NUM_STRENGTHS
        self._sat_out = 0  # rounds in a row with a proposal but k = 0

    def acceptance(self, strength: int) -> float:
        """Estimated chance that a draft token is accepted, given the ones before it were."""
        s = self._slot(strength)
        return self._hits[s] / self._trials[s]

    def length(self, strength: int) -> int:
        """The draft length for a proposal whose suffix match was `strength` tokens long;
        counts a round sat out, so that every `probe_every`-th such round probes one token."""
        k = self.best_length(self.acceptance(strength))
        if k > 0 or self.max_k == 0:
            self._sat_out = 0
            return k
        self._sat_out += 1
        if self._sat_out >= self.probe_every:
            self._sat_out = 0
            return 1
        return 0

    def best_length(self, p: float) -> int:
        """The k in [0, max_k] with the most expected tokens per second of round (ties and
        gains under `min_gain` go to the shorter draft)."""
        other_rows, other_tokens = self.costs.others()
        base_s = self.costs.round_s(round(other_rows) + 1)
        if base_s is None:  # nothing measured yet: draft what acceptance alone suggests
            return self.max_k if p >= 0.5 else 0
        best_k, best = 0, (other_tokens + 1.0) / base_s
        gain = 0.0
        for k in range(1, self.max_k + 1):
            gain += p**k
            round_s = self.costs.round_s(round(other_rows) + 1 + k)
            score = (other_tokens + 1.0 + gain) / round_s
            if score > best * (1.0 + self.min_gain):
                best_k, best = k, score
        return best_k

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
