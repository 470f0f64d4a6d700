"""Stop strings across streamed pieces."""

from __future__ import annotations

from hypothesis import given, strategies as st

from prefixd.daemon.stops import StopMatcher


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
