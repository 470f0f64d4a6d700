"""The default model's chat template (which knows no tools) renders tool definitions and
tool-call turns through prefixd.text.tools, with message starts intact."""

from __future__ import annotations


import pytest

from prefixd.front.requests import RequestBuilder
from prefixd.text.tokenizer import Tokenizer
from prefixd.ipc.framing import Limits

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def builder(tok: Tokenizer) -> RequestBuilder:
    return RequestBuilder(tok, {"vocab_size": tok.vocab_size}, Limits())


def test_tools_render_into_the_first_message_of_the_default_template(builder):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"type": "function",
                                               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18C"},
    ]
    built = builder.generate({"type": "generate", "id": 1, "messages": messages, "tools": [WEATHER]}, 1)
    text = builder.tokenizer.decode(built.request.tokens)
    assert text.startswith('<|im_start|>system\nYou may call functions')
    assert '{"name": "get_weather", "parameters": {"type": "object"}}' in text
    assert ('<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
            '<|im_end|>\n<|im_start|>tool\n18C<|im_end|>\n<|im_start|>assistant\n') in text
    assert built.parse_tools
    # a chunk starts at every message after the first: user, assistant, tool, generation prompt
    assert len(built.request.chunk_starts) == 4
    user_at = built.request.chunk_starts[0]
    assert builder.tokenizer.decode(built.request.tokens[user_at:user_at + 3]) == "<|im_start|>user\n"
