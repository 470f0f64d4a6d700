"""The draft length policy: round costs learned by row count, and k chosen from acceptance
against them. Deterministic: costs are fed as numbers, nothing is timed."""

from __future__ import annotations

import pytest

from prefixd.scheduler.draftpolicy import DraftPolicy, RoundCosts
from prefixd.scheduler.drafting import StreamDrafter
from prefixd.scheduler.records import LaneResult, LaneWork, RoundPlan, RoundResult


def costs_of(table: dict[int, float], *, lanes: int = 1, tokens: int = 1) -> RoundCosts:
    costs = RoundCosts(alpha=1.0)
    for rows, seconds in table.items():
        costs.observe(rows, seconds)
    last = min(table)
    costs.observe(last, table[last], num_lanes=lanes, num_tokens=tokens)
    return costs


# A padded kernel: 1 to 4 rows cost one round, then each row more costs a quarter of it.
PADDED = {1: 1.0, 4: 1.0, 5: 1.25, 8: 2.0}
# Every row costs as much as a round of one.
STEEP = {1: 1.0, 2: 2.0}


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


def test_round_cost_is_a_moving_average_per_row_count():
    costs = RoundCosts(alpha=0.5)
    costs.observe(3, 4.0)
    costs.observe(3, 2.0)
    costs.observe(0, 9.0)  # an empty round teaches nothing
    assert costs.round_s(3) == 3.0


def test_a_lane_that_only_drafted_learns_the_undrafted_round_from_the_slope():
    costs = costs_of({2: 2.0, 3: 3.0})
    assert costs.round_s(1) == 1.0
    assert DraftPolicy(4, costs).best_length(0.5) == 0


def test_rows_the_kernel_pads_anyway_are_drafted_even_at_low_acceptance():
    policy = DraftPolicy(4, costs_of(PADDED))
    assert policy.best_length(0.1) == 1  # even a poor draft rides a free row
    assert policy.best_length(0.5) == 3  # rows 2..4 are free: 1.875 tokens per 1.0
    assert policy.best_length(0.9) == 3  # 1 + .9 + .81 + .729 = 3.44 per 1.0 beats 4.10 per 1.25


def test_costly_rows_are_drafted_only_when_acceptance_pays_for_them():
    policy = DraftPolicy(4, costs_of(STEEP))  # k rows more: 1 + k times the round
    assert policy.best_length(0.1) == 0
    assert policy.best_length(0.5) == 0  # 1.5 tokens for twice the time
    assert policy.best_length(1.0) == 0  # k tokens more for k rounds more gains nothing
    assert DraftPolicy(4, costs_of({1: 1.0, 2: 1.1})).best_length(0.5) == 2  # 1.75 tokens per 1.2


def test_at_eight_lanes_a_draft_must_pay_for_its_rows_against_the_whole_round():
    # 8 lanes of one row emit 8 tokens in 1.0; each row more costs 0.1
    costs = costs_of({8: 1.0, 16: 1.8}, lanes=8, tokens=8)
    assert costs.others() == (7.0, 7.0)
    policy = DraftPolicy(4, costs)
    assert policy.best_length(0.5) == 0  # +0.5 token (6 %) for +10 % time
    # k = 2: 8 + .95 + .9025 tokens per 1.2 = 8.21 a second; k = 3, 4 gain under 2 % more
    assert policy.best_length(0.95) == 2


def test_acceptance_is_kept_per_match_strength_and_decays():
    policy = DraftPolicy(4, decay=0.5, prior=(1.0, 2.0))
    assert policy.acceptance(1) == policy.acceptance(3) == 0.5
    policy.record(3, 4, 4)  # all accepted: 4 hits in 4 trials
    assert policy.acceptance(3) == (0.5 + 4) / (1.0 + 4)
    policy.record(1, 3, 1)  # one accepted, then a miss: 1 hit in 2 trials
    assert policy.acceptance(1) == (0.5 + 1) / (1.0 + 2)
    assert policy.acceptance(7) == policy.acceptance(3)  # 3 and longer share a slot
    with pytest.raises(ValueError):
        policy.record(2, 1, 2)


def test_a_lane_that_stopped_drafting_probes_one_token_every_probe_every_rounds():
    policy = DraftPolicy(4, costs_of(STEEP), probe_every=3)
    for _ in range(6):
        policy.record(1, 1, 0)
    assert [policy.length(1) for _ in range(7)] == [0, 0, 1, 0, 0, 1, 0]


def test_without_costs_measured_the_policy_follows_acceptance_alone():
    policy = DraftPolicy(3)
    assert policy.best_length(0.5) == 3
    assert policy.best_length(0.4) == 0


def test_max_zero_never_drafts():
    policy = DraftPolicy(0, costs_of(PADDED), probe_every=1)
    assert [policy.length(3) for _ in range(3)] == [0, 0, 0]


def test_the_drafter_feeds_back_the_strength_of_the_match_it_proposed_from():
    drafter = StreamDrafter([5, 6, 7, 8, 9, 5, 6, 7], 4, costs_of(PADDED))
    assert drafter.propose([], 10) == (8, 9, 5)  # matched "5 6 7": strength 3, k = 3 (free rows)
    drafter.record(3, 0)
    assert drafter.policy.acceptance(3) < drafter.policy.acceptance(1) == 0.5
    assert drafter.propose([1], 10) == ()  # no earlier "1"


def test_observe_round_counts_decoding_lanes_and_their_tokens():
    costs = RoundCosts()
    plan = RoundPlan((LaneWork(0, 10, (4, 5, 6), (0,), prefill=False, drafts=(5, 6)),
                      LaneWork(1, 20, (7,), (1, 2), prefill=False),
                      LaneWork(2, 0, (1, 2, 3, 4), (3,), prefill=True)))
    result = RoundResult((LaneResult(0, sampled=(5, 9)), LaneResult(1, sampled=(3,)), LaneResult(2)), forward_s=0.1)
    costs.observe_round(plan, result, 0.5)
    assert (costs.last_rows, costs.last_lanes, costs.last_tokens) == (8, 2, 3)
    assert costs.round_s(8) == 0.5
