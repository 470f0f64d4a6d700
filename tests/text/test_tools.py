"""Tool definitions in prompts and tool calls parsed out of replies (no model, no torch)."""

from __future__ import annotations

import json

import pytest

from prefixd.text.tools import ToolCallSplitter, parse_tool_calls, prepare_chat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PLAIN_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
TOOLS_TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_json_array_of_calls_parses_with_arguments_as_json_text():
    content, calls = parse_tool_calls('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                      '{"name": "now", "arguments": {}}]</tool_call>')
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    assert calls[0].to_wire() == {"id": calls[0].id, "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert calls[0].id != calls[1].id


def test_qwen_json_object_and_xml_forms_parse():
    _, calls = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    text = ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome", "days": 3})]


@pytest.mark.parametrize("text", [
    "no call here",
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>[{"name": "f", "arguments": 3}]</tool_call>',
])
def test_replies_without_a_well_formed_call_are_plain_text(text):
    assert parse_tool_calls(text) is None


def test_splitter_holds_the_call_back_across_pieces_and_parses_it():
    splitter = ToolCallSplitter()
    pieces = ["Sure", ". <tool", '_call>[{"name": "get_weather", ', '"arguments": {"city": "Paris"}}]</tool_call>']
    shown = [splitter.push(p) for p in pieces]
    assert shown == ["Sure", ". ", "", ""]
    rest, calls = splitter.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"]


def test_splitter_shows_held_text_that_is_not_a_call():
    splitter = ToolCallSplitter()
    assert splitter.push("a <tool") == "a "
    assert splitter.push("box>") == "<toolbox>"
    assert splitter.push(" <tool_call>oops") == " "
    assert splitter.finish() == ("<tool_call>oops", ())


def test_plain_template_gets_tools_in_a_system_message_and_calls_spelled_in_content():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
    ]
    chat, tools = prepare_chat(messages, [WEATHER], PLAIN_TEMPLATE)
    assert tools is None
    assert chat[0]["role"] == "system" and json.dumps(WEATHER["function"]) in chat[0]["content"]
    assert chat[1] == messages[0]
    assert chat[2] == {"role": "assistant",
                       "content": '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'}
    assert chat[3] == messages[2]
    assert messages[1]["content"] is None  # the caller's messages are not changed


def test_plain_template_appends_tools_to_an_existing_system_message():
    chat, _ = prepare_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                           [WEATHER], PLAIN_TEMPLATE)
    assert len(chat) == 2 and chat[0]["content"].startswith("Be brief.\n\nYou may call functions")


def test_template_that_knows_tools_gets_them_and_argument_maps():
    messages = [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    chat, tools = prepare_chat(messages, [WEATHER], TOOLS_TEMPLATE)
    assert tools == [WEATHER]
    assert chat == [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
