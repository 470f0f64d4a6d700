"""Sampling: exact ids from hand-made logits, seeds, lane independence, HF agreement."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixd.gpu.sampling import (
    LaneSampler,
    apply_penalties_and_filters,
    apply_temperature,
    greedy_token,
    min_p_filter,
    pick_token,
    position_uniform,
    repetition_penalty,
    top_k_filter,
    top_p_filter,
)
from prefixd.scheduler.records import SamplingParams

CPU = torch.device("cpu")
VOCAB = 64


def kept(row: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(row)).flatten().tolist()


def sampler(params: SamplingParams, history=(), vocab=VOCAB, tok_vocab=VOCAB) -> LaneSampler:
    return LaneSampler(params, history, vocab_size=vocab, tokenizer_vocab=tok_vocab, device=CPU)


def random_rows(n: int, vocab: int = VOCAB, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(vocab, generator=gen) * 3 for _ in range(n)]


def no_seen(vocab: int = VOCAB) -> torch.Tensor:
    return torch.zeros(vocab, dtype=torch.bool)


# --- hand-made logits, exact ids ------------------------------------------------------


def test_greedy_picks_the_largest_logit():
    row = torch.zeros(VOCAB)
    row[[1, 9, 33]] = torch.tensor([2.0, 1.9, 2.5])
    assert sampler(SamplingParams()).sample(row, 0) == 33


def test_greedy_ties_go_to_the_lowest_id():
    row = torch.full((VOCAB,), -5.0)
    row[[7, 3, 40]] = 4.0
    assert greedy_token(row) == 3
    big = torch.zeros(49152)
    big[[30001, 30000, 49151]] = 1.0
    assert greedy_token(big) == 30000
    big[[100, 200]] = float("inf")
    assert greedy_token(big) == 100
    assert greedy_token(big.bfloat16()) == 100  # the other path: torch's argmax


def test_greedy_refuses_a_row_with_nan():
    row = torch.zeros(VOCAB)
    row[[5, 9]] = torch.tensor([float("inf"), float("nan")])
    with pytest.raises(RuntimeError, match="NaN"):
        greedy_token(row)


def test_greedy_never_picks_a_padded_id():
    row = torch.zeros(VOCAB)
    row[60] = 10.0  # beyond the tokenizer's 50 ids
    row[12] = 1.0
    assert sampler(SamplingParams(), tok_vocab=50).sample(row, 0) == 12


def test_sampling_never_picks_a_padded_id():
    row = torch.zeros(VOCAB)
    row[50:] = 30.0  # padded ids carry almost all the mass
    s = sampler(SamplingParams(temperature=1.0, seed=5), tok_vocab=50)
    assert all(s.sample(row, pos) < 50 for pos in range(200))


def test_top_k_keeps_the_k_largest_ids():
    row = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0, 0.0])
    assert kept(top_k_filter(row, 3)) == [1, 2, 3]


def test_top_k_keeps_ties_at_the_edge():
    row = torch.tensor([1.0, 5.0, 3.0, 3.0, 2.0])
    assert kept(top_k_filter(row, 2)) == [1, 2, 3]


def test_top_p_keeps_ids_until_the_mass_reaches_p():
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])
    row = probs.log()
    assert kept(top_p_filter(row, 0.45)) == [1]  # 0.5 alone reaches 0.45
    assert kept(top_p_filter(row, 0.7)) == [1, 2]
    assert kept(top_p_filter(row, 0.81)) == [1, 2, 3]


def test_top_p_on_a_large_peaked_row_keeps_exactly_the_mass_reaching_p():
    row = torch.full((49152,), -20.0)
    row[[100, 7, 30000]] = torch.tensor([0.5, 0.3, 0.15]).log()  # the rest: ~1e-4 in all
    assert kept(top_p_filter(row, 0.6)) == [7, 100]  # probs .526 .316 .158
    assert kept(top_p_filter(row, 0.85)) == [7, 100, 30000]


def test_top_p_on_a_large_flat_row_searches_past_the_first_candidates():
    row = torch.zeros(4096)
    row[5] = 1.0
    out = top_p_filter(row, 0.5)  # needs about half of the 4096 nearly equal ids
    assert 5 in kept(out)
    assert 1900 < len(kept(out)) < 2100


def test_top_p_always_keeps_the_top_id():
    row = torch.tensor([0.0, 9.0, 1.0])
    assert kept(top_p_filter(row, 1e-9)) == [1]


def test_min_p_drops_ids_below_a_fraction_of_the_top():
    probs = torch.tensor([0.4, 0.15, 0.39, 0.06])
    row = probs.log()
    assert kept(min_p_filter(row, 0.1)) == [0, 1, 2, 3]  # keeps p >= 0.04
    assert kept(min_p_filter(row, 0.3)) == [0, 1, 2]  # keeps p >= 0.12
    assert kept(min_p_filter(row, 0.5)) == [0, 2]  # keeps p >= 0.2
    assert kept(min_p_filter(row, 0.99)) == [0]


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    row = torch.tensor([2.0, -2.0, 3.0, -1.0])
    seen = torch.tensor([True, True, False, False])
    assert torch.equal(repetition_penalty(row, seen, 2.0), torch.tensor([1.0, -4.0, 3.0, -1.0]))


def test_repetition_penalty_changes_the_greedy_choice_over_prompt_and_generated():
    row = torch.zeros(VOCAB)
    row[[4, 5, 6]] = torch.tensor([3.0, 2.0, 1.9])
    s = sampler(SamplingParams(repetition_penalty=2.0), history=[4])
    assert s.sample(row, 1) == 5  # 4 penalised to 1.5 (prompt history)
    assert s.sample(row, 2) == 6  # 5 penalised to 1.0 (its own generated token)
    assert s.sample(row, 3) == 4  # 6 penalised to 0.95
    assert s.sample(row, 4) == 4  # each id is penalised once, however often it occurred


def test_pick_token_walks_the_cdf_in_id_order():
    probs = torch.tensor([0.1, 0.6, 0.3])  # intervals: 0 [0, .1), 1 [.1, .7), 2 [.7, 1)
    row = probs.log()
    assert pick_token(row, 0.0) == 0
    assert pick_token(row, 0.09) == 0
    assert pick_token(row, 0.11) == 1
    assert pick_token(row, 0.69) == 1
    assert pick_token(row, 0.71) == 2
    assert pick_token(row, 0.999999) == 2


def test_pick_token_skips_filtered_ids_at_the_edges():
    row = torch.tensor([float("-inf"), 0.0, float("-inf")])
    assert pick_token(row, 0.0) == 1
    assert pick_token(row, 1.0) == 1  # u * total rounding up to total stays on a live id


def test_pick_token_never_returns_a_filtered_id():
    row = torch.tensor([float("-inf"), 0.0, float("-inf"), 0.0, float("-inf")])
    assert {pick_token(row, u / 100) for u in range(100)} == {1, 3}


def test_temperature_sharpens_the_distribution():
    row = torch.tensor([1.0, 0.0] + [-30.0] * (VOCAB - 2))
    hot = sampler(SamplingParams(temperature=100.0, seed=3))
    cold = sampler(SamplingParams(temperature=0.05, seed=3))
    hot_tokens = [hot.sample(row, pos) for pos in range(300)]
    assert [cold.sample(row, pos) for pos in range(300)] == [0] * 300
    assert len(set(hot_tokens)) > 10


def test_filters_compose_in_order():
    row = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.99, min_p=0.01)
    out = apply_penalties_and_filters(row, params, no_seen(6), 6)
    # temperature doubles the gaps; top-k keeps 0..3 (probs .865 .117 .016 .002);
    # top-p 0.99 drops 3 (mass before it .998); min-p 0.01 keeps 2 (.016 >= .0087)
    assert kept(out) == [0, 1, 2]
    assert kept(apply_penalties_and_filters(row, replace(params, min_p=0.05), no_seen(6), 6)) == [0, 1]
    assert kept(apply_penalties_and_filters(row, replace(params, top_p=1.0, min_p=0.0), no_seen(6), 6)) == [0, 1, 2, 3]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    u=st.floats(0.0, 1.0, exclude_max=True),
    top_k=st.integers(0, 20),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_a_draw_is_always_a_surviving_unpadded_id(seed, u, top_k, top_p, min_p):
    (row,) = random_rows(1, seed=seed)
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p)
    original = row.clone()
    filtered = apply_penalties_and_filters(row, params, no_seen(), 50)
    assert torch.equal(row, original)  # the caller's row is left alone
    token = pick_token(filtered, u)
    assert token < 50 and token in kept(filtered)


# --- seeds and lane independence ------------------------------------------------------

PINNED_UNIFORMS = [0.452325976722, 0.789889752544, 0.705197820285]
PARAMS = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.01, repetition_penalty=1.1)


def run_lane(seed: int, rows: list[torch.Tensor]) -> list[int]:
    s = sampler(replace(PARAMS, seed=seed), history=[1, 2, 3])
    return [s.sample(r, s.first_position + i) for i, r in enumerate(rows)]


def test_same_seed_gives_same_tokens():
    rows = random_rows(40)
    first = run_lane(1234, rows)
    assert run_lane(1234, rows) == first
    assert run_lane(4321, rows) != first


def test_lanes_interleaved_in_any_order_match_each_alone():
    rows = {lane: random_rows(30, seed=lane) for lane in range(3)}
    alone = {lane: run_lane(100 + lane, rows[lane]) for lane in range(3)}
    lanes = {
        lane: sampler(replace(PARAMS, seed=100 + lane), history=[1, 2, 3])
        for lane in range(3)
    }
    got: dict[int, list[int]] = {lane: [] for lane in range(3)}
    order = [lane for lane in range(3) for _ in range(30)]
    random.Random(7).shuffle(order)
    for lane in order:
        i = len(got[lane])
        got[lane].append(lanes[lane].sample(rows[lane][i], 3 + i))
    assert got == alone


def test_position_uniform_is_a_fixed_hash_of_seed_and_position():
    # pinned values: the draw for a (seed, position) never changes between releases
    assert [round(position_uniform(9, p), 12) for p in range(3)] == PINNED_UNIFORMS
    assert position_uniform(9, 5) == position_uniform(9, 5)
    assert position_uniform(9, 5) != position_uniform(10, 5)
    us = [position_uniform(1, p) for p in range(20000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.01
    assert len(set(us)) == len(us)


def test_a_token_depends_on_its_position_not_on_how_many_draws_came_before():
    rows = random_rows(12)
    fresh = [run_lane_at(55, rows[i], 40 + i) for i in range(12)]
    s = sampler(replace(PARAMS, seed=55, repetition_penalty=1.0), history=[1, 2, 3])
    for i in range(12):  # draws for other positions first must not move this one
        s.sample(rows[(i + 5) % 12], 1000 + i)
        assert s.sample(rows[i], 40 + i) == fresh[i]


def run_lane_at(seed: int, row: torch.Tensor, position: int) -> int:
    s = sampler(replace(PARAMS, seed=seed, repetition_penalty=1.0), history=[1, 2, 3])
    return s.sample(row, position)


def verify_groups(seed: int, rows: list[torch.Tensor], drafts: list[int], group: int) -> list[int]:
    """Sample a stream the way drafted rounds do: each round verifies up to `group` - 1
    drafted tokens (the rows after the last accepted token and after each draft), and the
    next round starts after the tokens it accepted."""
    s = sampler(replace(PARAMS, seed=seed), history=[1, 2, 3])
    out: list[int] = []
    while len(out) < len(rows):
        pos = len(out)
        k = min(group, len(rows) - pos) - 1
        out += s.verify(torch.stack(rows[pos : pos + k + 1]), drafts[pos : pos + k], s.first_position + pos)
    return out


@pytest.mark.parametrize("group", [2, 3, 5])
def test_sampling_in_verify_groups_gives_the_one_by_one_stream(group):
    """Drafted equals undrafted for sampling: rows sampled in verify groups of any size,
    with rejections that make a later round sample again, give the undrafted tokens. A
    sampler keyed by call or round count instead of position fails this."""
    rows = random_rows(40, seed=8)
    undrafted = run_lane(321, rows)
    drafts = [t if i % 4 else (t + 1) % VOCAB for i, t in enumerate(undrafted)]  # every 4th wrong
    assert verify_groups(321, rows, drafts, group) == undrafted
    assert verify_groups(321, rows, undrafted, group) == undrafted


def test_verify_stops_at_the_first_rejected_draft_and_keeps_it_out_of_the_history():
    row = torch.zeros(VOCAB)
    row[[4, 5, 6]] = torch.tensor([3.0, 2.0, 1.9])
    s = sampler(SamplingParams(repetition_penalty=2.0), history=[])
    # row 0 picks 4 (draft 4 accepted); row 1 picks 5 (draft 9 rejected): row 2 is not sampled
    assert s.verify(torch.stack([row, row, row]), [4, 9], 0) == [4, 5]
    assert s.sample(row, 2) == 6  # 9 was never seen: 6 (1.9) beats the penalised 4 and 5


def test_no_seed_draws_a_fresh_one():
    a, b = sampler(SamplingParams(temperature=1.0)), sampler(SamplingParams(temperature=1.0))
    assert a.seed != b.seed


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=-1),
        SamplingParams(top_p=0.0),
        SamplingParams(min_p=1.5),
        SamplingParams(repetition_penalty=0.0),
        SamplingParams(seed=-1),
    ],
)
def test_bad_params_raise(params):
    with pytest.raises(ValueError):
        sampler(params)


def test_wrong_logits_shape_raises():
    with pytest.raises(ValueError):
        sampler(SamplingParams()).sample(torch.zeros(VOCAB + 1), 0)


# --- agreement with transformers' processors ------------------------------------------

HF_VOCAB = 1000


def hf(name: str, *args):
    from transformers.generation import logits_process as lp

    return getattr(lp, name)(*args)


@pytest.mark.parametrize("k", [1, 5, 50, 999])
def test_top_k_matches_transformers(k):
    warper = hf("TopKLogitsWarper", k)
    for row in random_rows(10, HF_VOCAB, seed=k):
        ref = warper(None, row[None].clone())[0]
        assert kept(top_k_filter(row, k)) == kept(ref)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.7, 0.9, 0.99])
def test_top_p_matches_transformers(p):
    warper = hf("TopPLogitsWarper", p)
    for row in random_rows(10, HF_VOCAB, seed=int(p * 100)):
        ref = warper(None, row[None].clone())[0]
        assert kept(top_p_filter(row, p)) == kept(ref)


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9])
def test_min_p_matches_transformers(p):
    warper = hf("MinPLogitsWarper", p)
    for row in random_rows(10, HF_VOCAB, seed=int(p * 100) + 1):
        ref = warper(None, row[None].clone())[0]
        assert kept(min_p_filter(row, p)) == kept(ref)


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_transformers_bitwise(penalty):
    proc = hf("RepetitionPenaltyLogitsProcessor", penalty)
    gen = torch.Generator().manual_seed(11)
    for row in random_rows(5, HF_VOCAB, seed=3):
        ids = torch.randint(0, HF_VOCAB, (200,), generator=gen)
        seen = no_seen(HF_VOCAB)
        seen[ids] = True
        ref = proc(ids[None], row[None].clone())[0]
        assert torch.equal(repetition_penalty(row, seen, penalty), ref)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_lane_gives_the_cpu_lane_tokens():
    """The uniform number is an integer hash of (seed, position), so a seed picks the same
    tokens on both devices (rows with well separated probabilities: no draw lands on an edge)."""
    rows = random_rows(30, vocab=HF_VOCAB, seed=21)
    tokens = {}
    for name in ("cpu", "cuda"):
        device = torch.device(name)
        s = LaneSampler(replace(PARAMS, seed=77), [1, 2, 3], vocab_size=HF_VOCAB,
                        tokenizer_vocab=HF_VOCAB - 10, device=device)
        tokens[name] = [s.sample(r.to(device), 3 + i) for i, r in enumerate(rows)]
    assert tokens["cuda"] == tokens["cpu"]


# --- edges of the spec's ranges: each keeps a finite row drawable ----------------------


def edge_row() -> torch.Tensor:
    """Ids 4 and 9 tie at the top, 20 is close behind, 2 and 30 are negative; 60.. padded."""
    row = torch.zeros(VOCAB)
    row[[4, 9, 20, 2, 30]] = torch.tensor([5.0, 5.0, 4.999, -3.0, -1e30])
    return row


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-300, 5e-324])
def test_a_tiny_temperature_draws_only_the_top_logits(temperature):
    row = apply_penalties_and_filters(edge_row(), SamplingParams(temperature=temperature), no_seen(), 60)
    assert not torch.isnan(row).any()
    assert row[4].item() == row[9].item() == 0.0
    assert torch.nonzero(torch.softmax(row, dim=0)).flatten().tolist() == [4, 9]
    draws = {sampler(SamplingParams(temperature=temperature, seed=s), tok_vocab=60).sample(edge_row(), 0)
             for s in range(40)}
    assert draws == {4, 9}


def test_a_temperature_near_float32s_smallest_normal_keeps_the_division_where_it_fits():
    row = torch.tensor([1e-3, -1e-3, 0.0, -2e-3])
    assert torch.equal(apply_temperature(row, 1e-30), row / 1e-30)  # no overflow: the plain division's bits
    assert torch.equal(apply_temperature(edge_row(), 0.7), edge_row() / 0.7)


@pytest.mark.parametrize("temperature", [1e38, 1e39, 1e308])
def test_a_huge_temperature_draws_uniformly_over_the_unpadded_ids(temperature):
    row = apply_penalties_and_filters(edge_row(), SamplingParams(temperature=temperature), no_seen(), 60)
    assert not torch.isnan(row).any() and kept(row) == list(range(60))
    assert row[:60].abs().max().item() < 1e-7  # every kept id all but equal: a uniform draw
    draws = {sampler(SamplingParams(temperature=temperature, seed=s), tok_vocab=60).sample(edge_row(), 0)
             for s in range(300)}
    assert draws <= set(range(60)) and len(draws) > 40


@pytest.mark.parametrize("penalty, want", [
    (1e-300, {4: 3.4028234663852886e38, 9: 5.0, 2: -0.0, 30: -0.0, 0: 0.0}),
    (1e-45, {4: 3.4028234663852886e38, 9: 5.0, 2: -0.0, 30: -0.0, 0: 0.0}),
    (1e300, {4: 0.0, 9: 5.0, 2: -3.4028234663852886e38, 30: -3.4028234663852886e38, 0: 0.0}),
    (1e30, {4: 5e-30, 9: 5.0, 2: -3e30, 30: -3.4028234663852886e38, 0: 0.0}),
])
def test_an_extreme_repetition_penalty_saturates_and_stays_finite(penalty, want):
    seen = no_seen()
    seen[[4, 2, 30, 0]] = True
    out = repetition_penalty(edge_row(), seen, penalty)
    assert bool(torch.isfinite(out).all())
    assert {i: out[i].item() for i in want} == pytest.approx(want, rel=1e-6)
    assert [str(out[i].item())[0] == "-" for i in (2, 30)] == [True, True]


@pytest.mark.parametrize("penalty, top", [(1e-300, 4), (1e300, 9)])
@pytest.mark.parametrize("temperature", [0.0, 1e-38, 1e-300])
def test_extreme_penalties_give_a_finite_draw_at_any_temperature(penalty, top, temperature):
    s = sampler(SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=3),
                history=[4], tok_vocab=60)
    assert s.sample(edge_row(), 0) == top  # a tiny penalty favours the seen id 4, a huge one bans it


def test_a_penalty_in_float32s_range_keeps_transformers_bits_where_nothing_overflows():
    row = edge_row()
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[[4, 2]] = True
    out = repetition_penalty(row, seen, 1.3)
    assert out[4].item() == (row[4] / 1.3).item() and out[2].item() == (row[2] * 1.3).item()


def test_top_k_of_the_largest_int_keeps_every_id():
    row = edge_row()
    assert torch.equal(top_k_filter(row, 2**31 - 1), row)
    assert sampler(SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=1)).sample(row, 0) in range(VOCAB)


def test_min_p_of_one_keeps_only_the_top_ties():
    row = apply_penalties_and_filters(edge_row(), SamplingParams(temperature=1.0, min_p=1.0), no_seen(), 60)
    assert kept(row) == [4, 9]


def test_top_p_of_zero_is_refused_and_a_tiny_one_keeps_the_top_id():
    with pytest.raises(ValueError, match="top_p"):
        sampler(SamplingParams(temperature=1.0, top_p=0.0))
    row = edge_row()
    row[9] = 4.5
    out = apply_penalties_and_filters(row, SamplingParams(temperature=1.0, top_p=1e-300), no_seen(), 60)
    assert kept(out) == [4]
