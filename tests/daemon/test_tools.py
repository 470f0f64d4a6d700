"""Tool calling through the daemon's socket: tools in the prompt, calls parsed into `done`,
protocol version 2 for the new fields, and tool definitions inside the cached prefix."""

from __future__ import annotations

import json

import pytest

from prefixd.ipc.client import AsyncClient
from prefixd.ipc.errors import ClientError
from prefixd.ipc.transport import FramedStream
from prefixd.text.tools import prepare_chat
from tests.daemon.fakes import EOS, ByteTokenizer, LetterDevice
from tests.daemon.harness import running_server, wait_idle

TOK = ByteTokenizer()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'


class ScriptDevice(LetterDevice):
    """Spells `script` after the prompt of `num_prompt` rows, then the end-of-text id."""

    def __init__(self, script: str, num_prompt: int) -> None:
        super().__init__(num_pages=2048, max_context=1024)  # byte tokens: the tools' prompt is long
        self.script = script.encode()
        self.num_prompt = num_prompt

    def _next(self, position: int, token: int) -> int:
        i = position - (self.num_prompt - 1)
        return self.script[i] + 3 if 0 <= i < len(self.script) else EOS


def prompt_len(messages: list[dict], tools: list[dict] | None) -> int:
    chat, _ = prepare_chat(messages, tools, TOK.chat_template)
    return len(TOK.render_chat(chat).ids)


async def test_a_reply_with_a_tool_call_ends_with_structured_tool_calls(tmp_path):
    device = ScriptDevice("Sure. " + CALL, prompt_len(USER, [WEATHER]))
    async with running_server(tmp_path, device) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            result = await client.generate(messages=USER, tools=[WEATHER], max_tokens=200).collect()
        assert result.text == "Sure. "
        assert TOK.decode(result.ids) == "Sure. " + CALL
        assert result.finish_reason == "tool_calls"
        assert len(result.tool_calls) == 1
        call = result.tool_calls[0]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}
        assert result.usage.prompt_tokens == device.num_prompt
        await wait_idle(server)


async def test_tool_choice_none_streams_the_call_as_text(tmp_path):
    device = ScriptDevice(CALL, prompt_len(USER, [WEATHER]))
    async with running_server(tmp_path, device) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            result = await client.generate(messages=USER, tools=[WEATHER], tool_choice="none", max_tokens=200).collect()
        assert (result.text, result.finish_reason, result.tool_calls) == (CALL, "stop", None)


async def test_a_malformed_call_is_shown_as_text(tmp_path):
    bad = "<tool_call>[{\"name\": 1}]</tool_call>"
    device = ScriptDevice(bad, prompt_len(USER, [WEATHER]))
    async with running_server(tmp_path, device) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            result = await client.generate(messages=USER, tools=[WEATHER], max_tokens=200).collect()
        assert (result.text, result.finish_reason, result.tool_calls) == (bad, "stop", None)


async def test_tools_need_protocol_version_2(tmp_path):
    async with running_server(tmp_path, ScriptDevice("ab", prompt_len(USER, [WEATHER]))) as server:
        async with await FramedStream.connect(server.socket_path) as framed:
            await framed.send({"type": "generate", "id": 1, "messages": USER, "tools": [WEATHER]})
            reply = await framed.receive()
            assert (reply["type"], reply["code"]) == ("error", "bad_request")
            assert reply["message"].startswith("tools: needs protocol version 2")
            await framed.send({"type": "hello", "id": 2, "versions": [1, 2]})
            assert (await framed.receive())["version"] == 2
            await framed.send({"type": "generate", "id": 3, "messages": USER, "tools": [WEATHER], "max_tokens": 2})
            kinds = [(await framed.receive())["type"] for _ in range(3)]
        assert kinds == ["token", "token", "done"]


@pytest.mark.parametrize("fields, needle", [
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format: cannot be combined with a tool_choice that forces a call"),
    ({"tool_choice": "required"}, "tool_choice: needs tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name: must not be empty"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type: 'retrieval' is not one of function"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice: names 'nope', which is not in tools"),
])
async def test_bad_tool_fields_are_refused_with_the_field(tmp_path, fields, needle):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            with pytest.raises(ClientError) as info:
                await client.generate(messages=USER, max_tokens=2, **fields).collect()
        assert info.value.code == "bad_request" and info.value.message.startswith(needle)


async def test_unknown_generate_options_raise_client_error(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            with pytest.raises(ClientError) as info:
                client.generate(prompt="x", temprature=0.5)
        assert info.value.code == "bad_request"


async def test_the_tool_definitions_are_part_of_the_cached_prefix(tmp_path):
    n = prompt_len(USER, [WEATHER])
    device = ScriptDevice(CALL, n)
    async with running_server(tmp_path, device) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            first = await client.generate(messages=USER, tools=[WEATHER], max_tokens=200).collect()
            history = USER + [{"role": "assistant", "content": None, "tool_calls": list(first.tool_calls)},
                              {"role": "tool", "content": "18C", "tool_call_id": first.tool_calls[0]["id"]}]
            second = await client.generate(messages=history, tools=[WEATHER], max_tokens=1).collect()
        assert second.usage.cache in ("resident", "hit")
        assert second.usage.cached_tokens >= n  # the system message with the tools was not computed again
