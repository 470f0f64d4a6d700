"""Prompt hygiene (prefixd/text/hygiene.py): each rule by name, the --prompt-hygiene switch,
and tool_order on the three HTTP fronts: a tools list reordered between turns is a cache hit
with the rule on and a shorter one with it off, and usage.prefixd.normalised says when a rule
changed the request."""

from __future__ import annotations

import argparse

import httpx
import pytest

from prefixd.daemon.config import config_from_args
from prefixd.text.hygiene import (
    DEFAULT_NORMALISERS,
    NORMALISERS,
    hygiene_names,
    normalise_system,
    normalise_tools,
    sort_tools,
)
from tests.daemon.fakes import LetterDevice
from tests.daemon.harness import running_server, wait_idle


def function(name: str, what: str = "") -> dict:
    return {"type": "function", "function": {"name": name, "description": what,
                                             "parameters": {"type": "object", "properties": {}}}}


WEATHER, TIME = function("get_weather", "the weather"), function("find_time", "the time")


def test_the_rules_and_their_default():
    assert NORMALISERS == DEFAULT_NORMALISERS == ("billing_header", "tool_order")


def test_tool_order_sorts_by_name_and_keeps_equal_names_in_order():
    first, second = function("same", "first"), function("same", "second")
    assert sort_tools([second, WEATHER, first, TIME]) == [TIME, WEATHER, second, first]
    assert normalise_tools([WEATHER, TIME], ("tool_order",)) == ([TIME, WEATHER], ("tool_order",))
    assert normalise_tools([TIME, WEATHER], ("tool_order",)) == ([TIME, WEATHER], ())  # nothing changed
    assert normalise_tools([WEATHER, TIME], ("billing_header",)) == ([WEATHER, TIME], ())  # not a tool rule


def test_billing_header_is_a_system_rule_only():
    blocks = ["x-anthropic-billing-header: cch=1;\nYou are careful."]
    assert normalise_system(blocks, ("tool_order",)) == (blocks, ())
    assert normalise_system(blocks, ("billing_header",)) == (["You are careful."], ("billing_header",))


def test_prompt_hygiene_names_parse():
    assert hygiene_names("none") == ()
    assert hygiene_names("tool_order, billing_header") == ("tool_order", "billing_header")
    for bad in ("", "tool_order,nonce", "none,tool_order"):
        with pytest.raises(ValueError, match="billing_header, tool_order"):
            hygiene_names(bad)
    assert config_from_args(argparse.Namespace(), env={}).prompt_hygiene == DEFAULT_NORMALISERS
    assert config_from_args(argparse.Namespace(), env={"PREFIXD_PROMPT_HYGIENE": "none"}).prompt_hygiene == ()
    assert config_from_args(argparse.Namespace(prompt_hygiene="none"), env={}).prompt_hygiene == ()


# -- tool_order on the fronts ----------------------------------------------------------------


def root(server) -> str:
    return f"http://127.0.0.1:{server.http.port}"


async def _chat(http, server, messages, tools) -> tuple[dict, dict]:
    body = (await http.post(f"{root(server)}/v1/chat/completions",
                            json={"messages": messages, "tools": tools, "max_tokens": 3})).json()
    usage = body["usage"]
    return {**usage, "normalised": usage["prefixd"].get("normalised")}, \
        {"role": "assistant", "content": body["choices"][0]["message"]["content"]}


async def _messages(http, server, messages, tools) -> tuple[dict, dict]:
    anthropic_tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                        "input_schema": t["function"]["parameters"]} for t in tools]
    body = (await http.post(f"{root(server)}/v1/messages",
                            json={"messages": messages, "tools": anthropic_tools, "max_tokens": 3})).json()
    usage = body["usage"]
    usage = {"prompt_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"],
             "cached": usage["cache_read_input_tokens"], "normalised": usage["prefixd"].get("normalised")}
    return usage, {"role": "assistant", "content": body["content"][0]["text"]}


async def _responses(http, server, messages, tools) -> tuple[dict, dict]:
    response_tools = [{"type": "function", **t["function"]} for t in tools]
    body = (await http.post(f"{root(server)}/v1/responses",
                            json={"input": messages, "tools": response_tools, "max_output_tokens": 3})).json()
    usage = body["usage"]
    usage = {"prompt_tokens": usage["input_tokens"], "cached": usage["input_tokens_details"]["cached_tokens"],
             "normalised": usage["prefixd"].get("normalised")}
    return usage, {"role": "assistant", "content": body["output"][0]["content"][0]["text"]}


def _cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"] if "prompt_tokens_details" in usage else usage["cached"]


async def _two_turns(server, ask) -> list[dict]:
    """Two turns of a conversation whose tools come in another order on the second."""
    messages = [{"role": "user", "content": "what now?"}]
    async with httpx.AsyncClient() as http:
        first, reply = await ask(http, server, messages, [WEATHER, TIME])
        messages = messages + [reply, {"role": "user", "content": "and then?"}]
        second, _ = await ask(http, server, messages, [TIME, WEATHER])
    return [first, second]


@pytest.mark.parametrize("ask", [_chat, _messages, _responses], ids=["chat", "messages", "responses"])
async def test_reordered_tools_keep_the_prefix_with_tool_order_on(tmp_path, ask):
    device = LetterDevice(num_pages=2048, max_context=1024)  # byte tokens: the tools' prompt is long
    async with running_server(tmp_path, device, http_addr="127.0.0.1:0") as server:
        first, second = await _two_turns(server, ask)
        assert first["normalised"] == ["tool_order"]  # listed unsorted: sorted
        assert second["normalised"] is None  # already sorted: nothing changed
        assert _cached(second) >= first["prompt_tokens"]  # the whole first prompt is reused
        await wait_idle(server)


@pytest.mark.parametrize("ask", [_chat, _messages, _responses], ids=["chat", "messages", "responses"])
async def test_reordered_tools_lose_the_prefix_with_prompt_hygiene_none(tmp_path, ask):
    device = LetterDevice(num_pages=2048, max_context=1024)
    async with running_server(tmp_path, device, http_addr="127.0.0.1:0", prompt_hygiene=()) as server:
        assert server.http.front.normalisers == ()
        first, second = await _two_turns(server, ask)
        assert first["normalised"] is None and second["normalised"] is None
        # the tools are listed in the system prompt, where the two turns now differ
        assert _cached(second) < first["prompt_tokens"] // 2
        await wait_idle(server)
