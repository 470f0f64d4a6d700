"""The draft policy: round costs learned by row count, and each round's draft rows shared
between its lanes by expected accepted tokens against those costs. Deterministic: costs are
fed as numbers, nothing is timed."""

from __future__ import annotations

import pytest

from prefixd.scheduler.draftpolicy import DraftPolicy, RoundCosts, allocate
from prefixd.scheduler.drafting import StreamDrafter
from prefixd.scheduler.records import LaneWork, RoundPlan


def costs_of(table: dict[int, float]) -> RoundCosts:
    costs = RoundCosts(window=1)
    for rows, seconds in table.items():
        costs.observe(rows, seconds)
    return costs


def chances(p: float, n: int = 4) -> list[float]:
    return [p**j for j in range(1, n + 1)]


# A padded kernel: 1 to 4 rows cost one round, then each row more costs a quarter of it.
PADDED = {1: 1.0, 4: 1.0, 5: 1.25, 8: 2.0}
# Every row costs as much as a round of one.
STEEP = {1: 1.0, 2: 2.0}
# 8 lanes, rows dear: each row more costs 6 % of the 8-row round (CPU int4).
DEAR8 = {8: 1.0, 40: 2.92}
# 8 lanes, rows cheap: 32 rows more cost 10 % (a flat GPU kernel).
CHEAP8 = {8: 1.0, 40: 1.1}


def test_round_cost_is_interpolated_between_row_counts_seen():
    costs = costs_of({1: 1.0, 5: 3.0})
    assert [costs.round_s(r) for r in (1, 2, 3, 5)] == [1.0, 1.5, 2.0, 3.0]


def test_round_cost_above_the_largest_seen_grows_by_the_prior_per_row():
    costs = RoundCosts(prior_row_frac=0.25)
    assert costs.round_s(1) is None
    costs.observe(2, 2.0)
    costs.observe(4, 2.2)
    assert costs.round_s(6) == pytest.approx(2.2 + 2 * 0.25 * 2.0)
    assert costs.round_s(1) == 1.5  # below the smallest seen: down by the guess (steeper than 0.1)
    costs.observe(5, 3.2)  # a steeper last segment: 1.0 a row
    assert costs.round_s(7) == pytest.approx(5.2)


def test_round_cost_is_the_median_of_recent_rounds_per_row_count():
    costs = RoundCosts(window=3)
    for seconds in (1.0, 9.0, 1.2):  # a round that lost its core does not move the median
        costs.observe(3, seconds)
    assert costs.round_s(3) == 1.2
    costs.observe(0, 9.0)  # an empty round teaches nothing
    for seconds in (2.0, 2.0):  # the window forgets what the machine no longer does
        costs.observe(3, seconds)
    assert costs.round_s(3) == 2.0


def test_a_row_count_never_costs_more_than_a_larger_one():
    costs = RoundCosts()
    costs.observe(8, 9.0)  # inflated, and once drafting pays never visited again
    costs.observe(9, 1.1)
    costs.observe(10, 1.2)
    assert costs.round_s(8) == 1.1
    assert allocate([[0.1]], costs, base_rows=8) == [0]  # +1 % tokens at 1.1, not 9 times the tokens at 9.0


def test_only_decode_rounds_teach_the_cost_curve():
    costs = RoundCosts()
    decode = LaneWork(0, 10, (4, 5, 6), (0,), prefill=False, drafts=(5, 6))
    prefill = LaneWork(2, 0, (1, 2, 3, 4), (3,), prefill=True)
    costs.observe_round(RoundPlan((decode, prefill)), 9.0)  # a chunk rides along: left out
    assert costs.round_s(7) is None
    costs.observe_round(RoundPlan((decode, LaneWork(1, 20, (7,), (1, 2), prefill=False))), 0.5)
    assert costs.round_s(4) == 0.5


def test_a_lane_that_only_drafted_learns_the_undrafted_round_from_the_slope():
    costs = costs_of({2: 2.0, 3: 3.0})
    assert costs.round_s(1) == 1.0
    assert allocate([chances(0.5)], costs, base_rows=1) == [0]


def test_nothing_drafts_before_a_round_was_measured():
    assert allocate([chances(1.0), chances(0.9)], RoundCosts(), base_rows=2) == [0, 0]


def test_rows_the_kernel_pads_anyway_are_drafted_even_at_low_acceptance():
    costs = costs_of(PADDED)
    assert allocate([chances(0.1)], costs, base_rows=1) == [1]  # a free row; the next gain 1 %
    assert allocate([chances(0.5)], costs, base_rows=1) == [3]  # the 5th row: +.0625 for +25 %
    assert allocate([chances(0.9)], costs, base_rows=1) == [3]  # 3.44 per 1.0 beats 4.10 per 1.25
    assert allocate([chances(1.0)], costs, base_rows=1) == [3]  # 4 per 1.0 ties 5 per 1.25: fewer rows


def test_costly_rows_are_drafted_only_when_acceptance_pays_for_them():
    costs = costs_of(STEEP)  # k rows more: 1 + k times the round
    assert allocate([chances(0.5)], costs, base_rows=1) == [0]  # 1.5 tokens for twice the time
    assert allocate([chances(1.0)], costs, base_rows=1) == [0]  # k tokens more for k rounds more
    assert allocate([chances(0.5)], costs_of({1: 1.0, 2: 1.1}), base_rows=1) == [2]  # 1.75 tokens per 1.2


def test_eight_busy_lanes_with_dear_rows_draft_no_weak_matches():
    costs = costs_of(DEAR8)
    assert allocate([chances(0.35)] * 8, costs, base_rows=8) == [0] * 8
    # strong matches pay: their first drafts and some second ones, never a full draft each
    strong = allocate([chances(0.9)] * 8, costs, base_rows=8)
    assert 8 <= sum(strong) < 24 and min(strong) >= 1


def test_eight_busy_lanes_with_cheap_rows_draft_weak_matches_too():
    lengths = allocate([chances(0.35)] * 8, costs_of(CHEAP8), base_rows=8)
    assert min(lengths) >= 1 and sum(lengths) >= 12


def test_the_round_gives_its_rows_to_the_lanes_most_likely_to_keep_them():
    # alone, a lane at 0.55 pays for one draft (+6.9 % tokens for +6 % time); beside two
    # strong lanes the round already makes 10.2 tokens a unit of time, and a row of 0.55 no
    # longer pays for its share of it
    weak = [chances(0.55)] + [[]] * 7
    assert allocate(weak, costs_of(DEAR8), base_rows=8, min_gain=0.0) == [1] + [0] * 7
    offers = [chances(0.95), chances(0.55), chances(0.55), chances(0.95)] + [[]] * 4
    assert allocate(offers, costs_of(DEAR8), base_rows=8, min_gain=0.0) == [4, 0, 0, 4, 0, 0, 0, 0]


def test_a_gain_within_min_gain_buys_no_rows():
    costs = costs_of({8: 1.0, 9: 1.05})  # one row more: +5 % time
    assert allocate([[0.45]], costs, base_rows=8, min_gain=0.0) == [1]  # +5.6 % tokens: 0.6 % better
    assert allocate([[0.45]], costs, base_rows=8, min_gain=0.02) == [0]


def test_acceptance_is_kept_per_match_strength_and_decays():
    policy = DraftPolicy(4, decay=0.5, prior=(1.0, 2.0))
    assert policy.acceptance(1) == policy.acceptance(3) == 0.5
    policy.record(3, 4, 4)  # all accepted: 4 hits in 4 trials
    assert policy.acceptance(3) == (0.5 + 4) / (1.0 + 4)
    policy.record(1, 3, 1)  # one accepted, then a miss: 1 hit in 2 trials
    assert policy.acceptance(1) == (0.5 + 1) / (1.0 + 2)
    assert policy.acceptance(7) == policy.acceptance(3)  # 3 and longer share a slot
    assert policy.chances(1, 9) == pytest.approx(chances(0.5, 4))  # at most max_k
    with pytest.raises(ValueError):
        policy.record(2, 1, 2)


def test_a_lane_that_sat_out_probes_one_token_every_probe_every_rounds():
    policy = DraftPolicy(4, probe_every=3)
    assert [policy.granted(0) for _ in range(7)] == [0, 0, 1, 0, 0, 1, 0]
    assert [policy.granted(k) for k in (0, 2, 0, 0, 0)] == [0, 2, 0, 0, 1]  # a draft restarts the count


def test_max_zero_never_drafts():
    policy = DraftPolicy(0, probe_every=1)
    assert [policy.granted(0) for _ in range(3)] == [0, 0, 0]
    assert policy.chances(3, 4) == []


def test_the_drafter_offers_its_match_and_feeds_back_its_strength():
    drafter = StreamDrafter([5, 6, 7, 8, 9, 5, 6, 7], 4)
    offer = drafter.offer([], 3)  # matched "5 6 7": strength 3, at most 3 tokens
    assert offer.tokens == (8, 9, 5) and offer.chances == pytest.approx((0.5, 0.25, 0.125))
    assert drafter.take(2) == (8, 9)
    drafter.record(2, 0)
    assert drafter.policy.acceptance(3) < drafter.policy.acceptance(1) == 0.5
    assert drafter.offer([1], 10) is None  # no earlier "1"
    assert drafter.take(4) == ()
