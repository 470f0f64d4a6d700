"""Stop strings across streamed pieces."""

from __future__ import annotations

from hypothesis import given, strategies as st

import pytest

from prefixd.front.stops import StopMatcher, StopSet


def test_stop_inside_one_piece_truncates_before_it():
    m = StopMatcher(["END"])
    assert m.push("hello END world") == ("hello ", True)
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_stop_split_across_pieces_is_held_then_dropped():
    m = StopMatcher(["</s>"])
    assert m.push("ab<") == ("ab", False)
    assert m.push("/") == ("", False)
    assert m.push("s>tail") == ("", True)


def test_held_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    m = StopMatcher(["</s>"])
    assert m.push("a</") == ("a", False)
    assert m.push("x") == ("</x", False)


def test_flush_releases_held_text_at_the_end():
    m = StopMatcher(["STOP"])
    assert m.push("abcST") == ("abc", False)
    assert m.flush() == "ST"


def test_earliest_of_several_stops_wins():
    m = StopMatcher(["world", "lo w"])
    assert m.push("hello world") == ("hel", True)


def test_no_stops_passes_text_through():
    m = StopMatcher([])
    assert m.push("abc") == ("abc", False)
    assert m.flush() == ""


@given(st.text(alphabet="ab</s>", max_size=40), st.lists(st.integers(1, 5), max_size=20))
def test_pieces_concatenate_to_the_text_before_the_first_stop(text, cuts):
    stop = "</s>"
    m = StopMatcher([stop])
    out, pos = [], 0
    for c in cuts + [len(text)]:
        piece, _ = m.push(text[pos:pos + c])
        out.append(piece)
        pos += c
    out.append(m.flush())
    i = text.find(stop)
    assert "".join(out) == (text if i < 0 else text[:i])


def naive_held(text: str, stops: list[str]) -> int:
    """The longest end of `text` that is a proper beginning of some stop (the definition)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@given(st.lists(st.text(alphabet="ab<>", min_size=1, max_size=5), min_size=1, max_size=6),
       st.text(alphabet="ab<>x", max_size=60), st.lists(st.integers(0, 7), max_size=30))
def test_matcher_equals_the_naive_definition_piece_by_piece(stops, text, cuts):
    """Sent text is the text before the stop that completes first; after each piece, exactly the part that
    could still begin a stop is held back; the match is reported on the piece that completes it."""
    m = StopMatcher(stops)
    sent, pos = "", 0
    # The stop that completes first wins (the longest where several complete together).
    ends = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    first = min(ends)[0] + min(ends)[1] if ends else -1
    for c in cuts + [len(text)]:
        piece = text[pos:pos + c]
        pos += c
        out, hit = m.push(piece)
        sent += out
        seen = text[:pos]
        seen_first = min((i for i in (seen.find(s) for s in stops) if i >= 0), default=-1)
        assert hit == (seen_first >= 0)
        if hit:
            assert sent == text[:first]
            break
        assert sent == seen[:len(seen) - naive_held(seen, stops)]
    else:
        sent += m.flush()
        assert sent == text
        assert first < 0


def test_stop_set_prepared_once_drops_duplicates_and_empties():
    stops = StopSet(["ab", "", "ab", "c"])
    assert stops.stops == ("ab", "c")
    assert StopMatcher(stops).push("xxcab") == ("xx", True)


def test_stop_count_and_length_limits_are_bad_requests():
    from prefixd.ipc.errors import ProtocolError
    from prefixd.ipc.messages import MAX_STOP_CHARS, MAX_STOP_STRINGS, parse_request

    base = {"type": "generate", "id": 3, "prompt": "x"}
    parse_request({**base, "stop": ["s"] * MAX_STOP_STRINGS})
    with pytest.raises(ProtocolError) as err:
        parse_request({**base, "stop": ["s"] * (MAX_STOP_STRINGS + 1)})
    assert (err.value.code, err.value.message) == (
        "bad_request", f"stop: {MAX_STOP_STRINGS + 1} stop strings; at most {MAX_STOP_STRINGS}")
    parse_request({**base, "stop": ["s" * MAX_STOP_CHARS]})
    with pytest.raises(ProtocolError) as err:
        parse_request({**base, "stop": ["a", "s" * (MAX_STOP_CHARS + 1)]})
    assert err.value.message == f"stop: a stop string of {MAX_STOP_CHARS + 1} characters; at most {MAX_STOP_CHARS} each"


def test_the_stop_that_completes_first_wins_however_the_text_is_cut():
    # '>' completes at 2, '<><' (which began earlier) only at 3: the stream stops at '>'.
    assert StopMatcher(["<><", ">"]).push("<><") == ("<", True)
    m = StopMatcher(["<><", ">"])
    assert m.push("<") == ("", False)
    assert m.push("><") == ("<", True)
