"""Message starts in linear time: the same ids and starts as the prefix-render definition on
the SmolLM2 template and Qwen-style templates, a bounded number of messages rendered, limits
checked before rendering, and a render that stops when its caller says so."""

from __future__ import annotations

import random

import pytest

from prefixd.text import chat_starts
from prefixd.text.chat import (
    MAX_CHAT_CHARS,
    MAX_CHAT_MESSAGES,
    ChatTemplate,
    ChatTooLarge,
    RenderCancelled,
    render_conversation,
)
from prefixd.text.chat_starts import defined_char_starts
from prefixd.text.tokenizer import Tokenizer

QWEN25_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3_LIKE = (
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{%- set content = message.content %}"
    "{%- if loop.index0 > ns.last_query_index and message.reasoning_content is defined %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LAST_DIFFERENT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if loop.last %} [last]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SYSTEM_OUTSIDE_LOOP = (
    "{% if messages[0].role == 'system' %}{% set rest = messages[1:] %}<<{{ messages[0].content }}>>\n"
    "{% else %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)

WORDS = ["Hello", "é😀", "  spaced  ", "code:\n```py\nx=1\n```", "<|im_end|> inside", "", "\n\n", "Oui ?"]


def conversation(rng: random.Random, num: int, *, tools: bool = False, reasoning: bool = False) -> list[dict]:
    roles = ["user", "assistant"] + (["tool", "tool"] if tools else [])
    messages = [{"role": "system", "content": rng.choice(WORDS)}] if rng.random() < 0.5 else []
    while len(messages) < num:
        m = {"role": rng.choice(roles), "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 3)))}
        if reasoning and m["role"] == "assistant" and rng.random() < 0.5:
            m["reasoning_content"] = rng.choice(WORDS)
        messages.append(m)
    return messages


def defined(template: ChatTemplate, messages: list[dict], tok: Tokenizer, gen: bool) -> tuple[tuple, tuple]:
    """The definition, computed the quadratic way (prefix renders, per-offset encodes)."""
    text = template.render(messages, add_generation_prompt=gen)
    ids = tok.encode(text)
    chars = defined_char_starts(template, messages, text, add_generation_prompt=gen)
    bounds = tok.offsets_bytes(ids)
    positions, k = [], 0
    for target in [len(text[:c].encode("utf-8")) for c in chars]:
        while k + 1 < len(bounds) and bounds[k + 1] <= target:
            k += 1
        positions.append(min(k, len(ids)))
    return tuple(ids), tuple(positions)


@pytest.mark.parametrize("name", ["smollm2", "qwen25", "qwen3", "last_different", "system_outside_loop"])
def test_starts_equal_the_prefix_render_definition(tok: Tokenizer, name: str) -> None:
    sources = {"smollm2": tok.chat_template, "qwen25": QWEN25_LIKE, "qwen3": QWEN3_LIKE,
               "last_different": LAST_DIFFERENT, "system_outside_loop": SYSTEM_OUTSIDE_LOOP}
    template = ChatTemplate(sources[name])
    rng = random.Random(name)
    sizes = [1, 2, 3, 5, 8, 13, 40, chat_starts.MAX_PREFIX_RENDERS + 30]
    for num in sizes:
        for gen in (True, False):
            messages = conversation(rng, num, tools=name == "qwen25", reasoning=name == "qwen3")
            rendered = render_conversation(template, messages, tok, add_generation_prompt=gen)
            ids, starts = defined(template, messages, tok, gen)
            # The instrumented twin renders the same text while its marks are empty.
            assert template.render(messages, add_generation_prompt=gen, mark=lambda item: "") == rendered.text
            assert rendered.ids == ids
            if name in ("last_different", "qwen3") and num > chat_starts.MAX_PREFIX_RENDERS:
                # These render earlier messages differently once later ones exist; past the
                # prefix-render bound each start is the message's header instead.
                headers = tuple(i for i, t in enumerate(ids) if t == 1)
                assert rendered.message_starts[1:] == headers[-len(rendered.message_starts[1:]):]
                continue
            assert rendered.message_starts == starts, (name, num, gen)


def test_rendered_messages_grow_linearly(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """2,000 messages render in a bounded number of whole-conversation renders, not one per prefix."""
    template = ChatTemplate(tok.chat_template)
    rendered_messages: list[int] = []
    real = ChatTemplate.render

    def counting(self: ChatTemplate, messages: list[dict], **kwargs):
        rendered_messages.append(len(messages))
        return real(self, messages, **kwargs)

    monkeypatch.setattr(ChatTemplate, "render", counting)
    messages = conversation(random.Random(7), 2000)
    result = render_conversation(template, messages, tok)
    assert sum(rendered_messages) <= 16 * len(messages)
    assert len(result.message_starts) == 2001
    assert [result.ids[s] for s in result.message_starts[1:]] == [1] * 2000


def test_limits_are_checked_before_rendering(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    template = ChatTemplate(tok.chat_template)
    monkeypatch.setattr(ChatTemplate, "render", lambda *a, **k: pytest.fail("rendered past a limit"))
    too_many = [{"role": "user", "content": "x"}] * (MAX_CHAT_MESSAGES + 1)
    with pytest.raises(ChatTooLarge, match=f"{MAX_CHAT_MESSAGES + 1} messages"):
        render_conversation(template, too_many, tok)
    too_long = [{"role": "user", "content": "x" * (MAX_CHAT_CHARS // 2)}, {"role": "user", "content": "y" * (MAX_CHAT_CHARS // 2 + 1)}]
    with pytest.raises(ChatTooLarge, match="characters"):
        render_conversation(template, too_long, tok)


def test_should_stop_ends_the_render_between_messages(tok: Tokenizer) -> None:
    template = ChatTemplate(tok.chat_template)
    polls = []

    def should_stop() -> bool:
        polls.append(1)
        return len(polls) > 50

    with pytest.raises(RenderCancelled):
        render_conversation(template, conversation(random.Random(3), 5000), tok, should_stop=should_stop)
    assert len(polls) == 51  # stopped at the first poll that said so, not after the render
