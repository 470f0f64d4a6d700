"""n-gram drafting: exact proposals, the incremental index, adaptive length, greedy accept."""

from __future__ import annotations

import pytest

from prefixd.scheduler.ngram import NgramIndex, accept_greedy


def test_proposes_what_followed_the_longest_earlier_suffix():
    idx = NgramIndex([10, 11, 12, 13, 10, 11, 12])
    assert idx.propose(3) == [13, 10, 11]
    assert idx.propose(1) == [13]


def test_a_proposal_stops_at_the_end_of_the_tokens():
    idx = NgramIndex([5, 6, 5])
    assert idx.propose(8) == [6, 5]


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    # suffix "1 2" occurred at 0..1 (then 3); suffix "2" alone last occurred at 5 (then 9)
    idx = NgramIndex([1, 2, 3, 7, 2, 9, 1, 2])
    assert idx.propose(2) == [3, 7]


def test_the_most_recent_occurrence_of_the_same_suffix_wins():
    idx = NgramIndex([4, 4, 1, 9, 4, 4, 1, 8, 4, 4, 1])
    assert idx.propose(1) == [8]


def test_no_earlier_occurrence_proposes_nothing():
    assert NgramIndex([1, 2, 3, 4]).propose(4) == []
    assert NgramIndex([]).propose(4) == []
    assert NgramIndex([1, 2, 1]).propose(0) == []


def test_min_n_refuses_short_matches():
    idx = NgramIndex([1, 2, 3, 9, 3], min_n=2)
    assert idx.propose(2) == []
    assert NgramIndex([1, 2, 3, 9, 3], min_n=1).propose(2) == [9, 3]


def test_the_suffix_never_matches_itself():
    idx = NgramIndex([7])
    assert idx.propose(3) == []
    idx.extend([7])  # "7" occurred at 0 with a token after it
    assert idx.propose(3) == [7]


def test_extending_one_token_at_a_time_equals_building_at_once():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = NgramIndex()
    for i, t in enumerate(tokens):
        grown.extend([t])
        whole = NgramIndex(tokens[: i + 1])
        assert grown.propose(4) == whole.propose(4) == brute_force(tokens[: i + 1], 4, 4)


def brute_force(tokens: list[int], k: int, max_n: int) -> list[int]:
    """The definition, at O(n * max_n) per call."""
    n_tokens = len(tokens)
    for n in range(min(max_n, n_tokens - 1), 0, -1):
        suffix = tokens[n_tokens - n:]
        for end in range(n_tokens - 2, n - 2, -1):  # most recent occurrence ending before the last
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_truncate_forgets_the_dropped_tokens():
    idx = NgramIndex([1, 2, 3, 1, 2, 5, 1, 2])
    assert idx.propose(1) == [5]
    idx.truncate(5)  # [1 2 3 1 2]
    assert idx.tokens == [1, 2, 3, 1, 2]
    assert idx.propose(2) == [3, 1]
    with pytest.raises(ValueError):
        idx.truncate(6)


def test_an_echoed_line_is_proposed_whole_after_its_first_tokens():
    line = [101, 102, 103, 104, 105, 106, 107, 108]
    idx = NgramIndex([1, 2] + line + [3, 4] + line[:2])
    assert idx.propose(6) == line[2:8]


def test_match_reports_the_length_of_the_suffix_it_matched():
    assert NgramIndex([1, 2, 3, 7, 2, 9, 1, 2]).match(2) == ([3, 7], 2)
    assert NgramIndex([5, 6, 7, 8, 5, 6, 7]).match(1) == ([8], 3)
    assert NgramIndex([1, 2, 3, 9, 3]).match(2) == ([9, 3], 1)
    assert NgramIndex([1, 2, 3]).match(2) == ([], 0)


# --- greedy acceptance -----------------------------------------------------------------


def test_greedy_accepts_the_longest_equal_prefix_and_the_models_next_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, plus a bonus
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # second rejected: the model's 9
    assert accept_greedy([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accept_greedy([], [3]) == [3]
    with pytest.raises(ValueError):
        accept_greedy([1], [1])
