"""The think-span splitter (prefixd/text/reasoning.py): which templates think, where a reply
starts, and the split of streamed text into reasoning and content whatever the pieces."""

from __future__ import annotations

import pytest

from prefixd.text.reasoning import ReasoningSplitter, opens_thinking, template_switches_thinking, template_thinks

REPLY = "<think>\nThe user greets.\n</think>\n\nHello!"


def split(pieces: list[str], *, inside: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(inside=inside)
    reasoning, content = [], []
    for piece in pieces:
        r, c = splitter.push(piece)
        reasoning.append(r)
        content.append(c)
    r, c = splitter.finish()
    return "".join(reasoning) + r, "".join(content) + c


def test_which_templates_think_and_which_switch_it():
    assert template_thinks("{{ '<think>' }}") and template_thinks("{% if m.reasoning_content %}")
    assert template_thinks("{% if enable_thinking %}") and template_switches_thinking("{% if enable_thinking %}")
    assert not template_switches_thinking("{{ '<think>' }}")
    assert not template_thinks("{% for m in messages %}{{ m.content }}{% endfor %}") and not template_thinks(None)


def test_a_prompt_that_ends_in_an_open_span_starts_the_reply_inside_it():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 100])
def test_the_split_is_the_same_for_every_piece_size(size):
    pieces = [REPLY[i:i + size] for i in range(0, len(REPLY), size)]
    assert split(pieces) == ("The user greets.", "Hello!")


def test_partial_tags_are_held_back_until_decided():
    splitter = ReasoningSplitter()
    assert splitter.push("<thi") == ("", "")
    assert splitter.push("nk>\nstep one \n") == ("step one", "")  # whitespace may end the reasoning: held
    assert splitter.push("and two\n</th") == (" \nand two", "")
    assert splitter.push("ink>\n\nDone") == ("", "Done")
    assert splitter.finish() == ("", "")


def test_a_reply_starting_inside_the_span_needs_no_open_tag():
    assert split(["Let me see.\n</think>\n\n", "Four."], inside=True) == ("Let me see.", "Four.")


def test_a_reply_without_a_span_is_all_content_and_a_later_think_tag_is_text():
    assert split(["Hello ", "<think>x</think>"]) == ("", "Hello <think>x</think>")
    assert split(["  <thin"]) == ("", "  <thin")  # a partial tag at the end is text
    assert split(["\n", "Hi"]) == ("", "\nHi")


def test_a_reply_cut_off_while_thinking_is_all_reasoning():
    assert split(["<think>\nhmm, so", " </thi"]) == ("hmm, so </thi", "")
