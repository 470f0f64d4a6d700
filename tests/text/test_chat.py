"""Chat templates: rendered ids match transformers' apply_chat_template, message starts land
on each message, the sandbox holds, template sources are found in the usual places."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from prefixd.text.chat import ChatTemplate, ChatTemplateError, load_hf_templates
from prefixd.text.tokenizer import Tokenizer

IM_START = 1

CONVERSATIONS: list[list[dict]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You speak French."},
        {"role": "user", "content": "Bonjour 😀"},
        {"role": "assistant", "content": "Salut ! Ça va ?"},
        {"role": "user", "content": "Oui.\n\n  Et toi ?"},
    ],
    [
        {"role": "user", "content": "code:\n```py\nprint(1)\n```"},
        {"role": "assistant", "content": "It prints 1."},
        {"role": "user", "content": "   spaces   "},
    ],
    [{"role": "user", "content": "<|im_end|> inside text"}, {"role": "assistant", "content": ""}],
]


@pytest.mark.slow
def test_ids_equal_transformers_apply_chat_template(tok: Tokenizer, default_gguf: Path) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            rendered = tok.render_chat(messages, add_generation_prompt=gen)
            expected = ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            expected_ids = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
            assert list(rendered.ids) == list(expected_ids)
            assert rendered.text == ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)


def test_ids_equal_encoding_of_text(tok: Tokenizer) -> None:
    for messages in CONVERSATIONS:
        rendered = tok.render_chat(messages)
        assert list(rendered.ids) == tok.encode(rendered.text)


def test_message_starts_point_at_each_message_header(tok: Tokenizer) -> None:
    messages = CONVERSATIONS[2]
    rendered = tok.render_chat(messages, add_generation_prompt=True)
    assert len(rendered.message_starts) == len(messages) + 1
    assert [rendered.ids[s] for s in rendered.message_starts] == [IM_START] * 5
    assert rendered.message_starts == tuple(i for i, t in enumerate(rendered.ids) if t == IM_START)
    no_gen = tok.render_chat(messages, add_generation_prompt=False)
    assert no_gen.message_starts == rendered.message_starts[:-1]


def test_generation_prompt_start_is_next_turns_assistant_start(tok: Tokenizer) -> None:
    """The assistant header this turn starts where the next turn's assistant message starts."""
    turn1 = CONVERSATIONS[2][:2]
    first = tok.render_chat(turn1, add_generation_prompt=True)
    second = tok.render_chat([*turn1, {"role": "assistant", "content": "Salut"}], add_generation_prompt=False)
    assert first.message_starts[-1] == second.message_starts[-1]
    assert first.ids[: first.message_starts[-1]] == second.ids[: second.message_starts[-1]]


def test_injected_default_system_prompt_stays_with_first_message(tok: Tokenizer) -> None:
    rendered = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert rendered.text.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    starts = rendered.message_starts
    assert starts[0] == 0
    assert rendered.ids[starts[1]] == IM_START and starts[1] > starts[0]


def test_template_that_renders_last_message_differently(tok: Tokenizer) -> None:
    """A prefix render that is not a prefix of the full render still gives starts on text
    both renders share, at token boundaries, in order."""
    source = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if loop.last %} [last]{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                {"role": "user", "content": "three"}]
    from prefixd.text.chat import render_conversation

    rendered = render_conversation(ChatTemplate(source), messages, tok, add_generation_prompt=True)
    starts = rendered.message_starts
    assert list(starts) == sorted(starts) and len(starts) == 4
    # Each start lies within the text shared with the prefix render: just after "\n<role>\n<content>".
    prefix_ids = tok.encode("<|im_start|>user\none")
    assert starts[1] == len(prefix_ids)
    assert rendered.ids[: starts[1]] == tuple(prefix_ids)
    assert rendered.ids[starts[3]] == IM_START  # the generation prompt: prefix render == full text


def test_raise_exception_and_prefix_refusal(tok: Tokenizer) -> None:
    source = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    from prefixd.text.chat import render_conversation

    with pytest.raises(ChatTemplateError, match="first must be user"):
        render_conversation(ChatTemplate(source), [{"role": "system", "content": "x"}], tok)
    # Rendering messages[:0] touches messages[0] and fails: the start falls back to 0.
    rendered = render_conversation(ChatTemplate(source), [{"role": "user", "content": "a"},
                                                          {"role": "assistant", "content": "b"}], tok,
                                   add_generation_prompt=False)
    assert rendered.message_starts == (0, len(tok.encode("<|im_start|>user\na<|im_end|>\n")))


def test_sandbox_blocks_attribute_escape() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        template.render([], add_generation_prompt=False)


def test_tojson_does_not_html_escape_and_strftime_now_exists() -> None:
    template = ChatTemplate("{{ tools | tojson }}|{{ strftime_now('%Y') | length }}")
    text = template.render([], add_generation_prompt=False, tools=[{"name": "<a&b>", "x": "é"}])
    assert text == '[{"name": "<a&b>", "x": "é"}]|4'


def test_syntax_error_and_missing_template_raise(gguf_fields: dict[str, Any]) -> None:
    with pytest.raises(ChatTemplateError, match="syntax"):
        ChatTemplate("{% for %}")
    bare = Tokenizer.from_gguf_fields({**gguf_fields, "tokenizer.chat_template": None})
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.render_chat([{"role": "user", "content": "x"}])


def test_template_sources_in_hf_dirs(tmp_path: Path, tiny_llama_dir: Path) -> None:
    root = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, root)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    assert load_hf_templates(root, cfg)[0] == cfg["chat_template"]
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T{{ tools | length }}"}]
    cfg["chat_template"] = named
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_hf_dir(root)
    assert tok.render_chat([], add_generation_prompt=False).text == "D"
    assert tok.render_chat([], add_generation_prompt=False, tools=[{"a": 1}]).text == "T1"
    (root / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_hf_dir(root).render_chat([], add_generation_prompt=False).text == "J"

