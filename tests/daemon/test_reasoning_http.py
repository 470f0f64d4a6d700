"""Reasoning on the HTTP fronts, over a small Qwen3-like thinking template (fakes.py) and a
device that spells a scripted reply: the think span parsed out of the content on Chat
Completions (reasoning_content and reasoning), Messages (thinking blocks) and Responses
(reasoning items), streamed and whole, through the official SDKs; the thinking switches; tool
calls parsed from the content only; a model without a thinking template unchanged; and a
three-turn conversation whose replayed reasoning (sent back, or dropped) keeps its prefix."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import anthropic
import anyio
import httpx
import openai

from prefixd.front.http.anthropic import signature
from tests.daemon.fakes import OPENS_THINK, THINKING_TEMPLATE, TemplateTokenizer, fake_runtime_factory
from tests.daemon.harness import running_server, wait_idle
from tests.daemon.test_tools import CALL, WEATHER, ScriptDevice

HI = [{"role": "user", "content": "hi"}]
THOUGHT = "The user greets me.\nI greet back."
SCRIPT = f"<think>\n{THOUGHT}\n</think>\n\nHello!"


@asynccontextmanager
async def thinking_server(tmp_path, script: str, template: str | None = THINKING_TEMPLATE):
    """A server whose model thinks (with `template`; None: the ByteTokenizer, no template),
    with its device (spelling `script` after each prompt) and tokenizer as .device, .tok."""
    device = ScriptDevice(script, 0)
    tok = TemplateTokenizer(template) if template is not None else None
    factory = fake_runtime_factory(device, tokenizer=tok)
    async with running_server(tmp_path, device, http_addr="127.0.0.1:0", runtime_factory=factory) as server:
        server.tok = factory.runtime.tokenizer if tok is None else tok  # type: ignore[attr-defined]
        yield server


def expect(server, messages: list[dict], **kwargs) -> int:
    """Point the scripted reply at the end of `messages`' prompt; the prompt's length."""
    n = len(server.tok.render_chat(messages, **kwargs).ids)
    server.device.num_prompt = n
    return n


def root(server) -> str:
    return f"http://127.0.0.1:{server.http.port}"


def chat_sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=root(server) + "/v1", api_key="unused", max_retries=0)


# -- Chat Completions ------------------------------------------------------------------------


async def test_chat_reply_carries_reasoning_by_both_names_and_content_without_the_span(tmp_path):
    async with thinking_server(tmp_path, SCRIPT) as server:
        n = expect(server, HI)
        reply = await anyio.to_thread.run_sync(lambda: chat_sdk(server).chat.completions.create(
            model="letters", messages=HI, max_tokens=200))
        message = reply.choices[0].message
        assert message.content == "Hello!"
        assert message.reasoning_content == message.reasoning == THOUGHT
        assert (reply.choices[0].finish_reason, reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
            "stop", n, len(SCRIPT) + 1)
        await wait_idle(server)


async def test_chat_stream_sends_reasoning_deltas_before_content(tmp_path):
    async with thinking_server(tmp_path, SCRIPT) as server:
        expect(server, HI)

        def stream() -> list[tuple[str, str]]:
            chunks = chat_sdk(server).chat.completions.create(model="letters", messages=HI, max_tokens=200,
                                                              stream=True)
            out = []
            for chunk in chunks:
                delta = chunk.choices[0].delta
                extra = delta.model_extra or {}
                if extra.get("reasoning_content"):
                    assert extra["reasoning"] == extra["reasoning_content"]
                    out.append(("reasoning", extra["reasoning_content"]))
                if delta.content:
                    out.append(("content", delta.content))
            return out

        pieces = await anyio.to_thread.run_sync(stream)
        kinds = [kind for kind, _ in pieces]
        assert kinds == sorted(kinds, reverse=True)  # every reasoning delta before the first content one
        assert "".join(t for k, t in pieces if k == "reasoning") == THOUGHT
        assert "".join(t for k, t in pieces if k == "content") == "Hello!"
        await wait_idle(server)


async def test_a_prompt_that_opens_the_span_starts_the_reply_inside_it(tmp_path):
    async with thinking_server(tmp_path, f"{THOUGHT}\n</think>\n\nHello!", OPENS_THINK) as server:
        expect(server, HI)
        async with httpx.AsyncClient() as http:
            body = (await http.post(f"{root(server)}/v1/chat/completions",
                                    json={"messages": HI, "max_tokens": 200})).json()
        message = body["choices"][0]["message"]
        assert (message["content"], message["reasoning_content"]) == ("Hello!", THOUGHT)
        await wait_idle(server)


async def test_each_chat_switch_turns_thinking_off_in_the_template(tmp_path):
    async with thinking_server(tmp_path, "Hello!") as server:
        assert len(server.tok.render_chat(HI, enable_thinking=False).ids) == len(server.tok.render_chat(HI).ids) + len(
            "<think>\n\n</think>\n\n")
        switches = [{"reasoning_effort": "none"}, {"enable_thinking": False},
                    {"chat_template_kwargs": {"enable_thinking": False}, "enable_thinking": True}]
        async with httpx.AsyncClient() as http:
            for k, switch in enumerate(switches):
                ask = [{"role": "user", "content": f"hi {k}"}]  # a new prompt each time: no full hit
                off = expect(server, ask, enable_thinking=False)
                body = (await http.post(f"{root(server)}/v1/chat/completions",
                                        json={"messages": ask, "max_tokens": 200, **switch})).json()
                assert body["usage"]["prompt_tokens"] == off, switch
                assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello!"}, switch
            on = (await http.post(f"{root(server)}/v1/chat/completions",
                                  json={"messages": HI, "max_tokens": 1, "reasoning_effort": "high"})).json()
            assert on["usage"]["prompt_tokens"] == len(server.tok.render_chat(HI).ids)
            bad = await http.post(f"{root(server)}/v1/chat/completions",
                                  json={"messages": HI, "reasoning_effort": "lots"})
            assert (bad.status_code, bad.json()["error"]["param"]) == (400, "reasoning_effort")
        await wait_idle(server)


async def test_tool_calls_are_parsed_from_the_content_and_not_the_reasoning(tmp_path):
    thought = "I could answer <tool_call>directly</tool_call>, but I will ask the tool."
    async with thinking_server(tmp_path, f"<think>\n{thought}\n</think>\n\n{CALL}") as server:
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        from prefixd.text.tools import prepare_chat

        chat, _ = prepare_chat(ask, [WEATHER], server.tok.chat_template)
        expect(server, chat)
        async with httpx.AsyncClient() as http:
            body = (await http.post(f"{root(server)}/v1/chat/completions",
                                    json={"messages": ask, "tools": [WEATHER], "max_tokens": 300})).json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["reasoning_content"] == thought
        assert [c["function"] for c in choice["message"]["tool_calls"]] == [
            {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}]
        await wait_idle(server)


async def test_a_model_without_a_thinking_template_keeps_a_think_tag_as_text(tmp_path):
    async with thinking_server(tmp_path, SCRIPT, template=None) as server:
        expect(server, HI)
        async with httpx.AsyncClient() as http:
            body = (await http.post(f"{root(server)}/v1/chat/completions",
                                    json={"messages": HI, "max_tokens": 200})).json()
            streamed = (await http.post(f"{root(server)}/v1/chat/completions",
                                        json={"messages": HI, "max_tokens": 200, "stream": True})).text
        assert body["choices"][0]["message"] == {"role": "assistant", "content": SCRIPT}
        assert "reasoning" not in streamed
        await wait_idle(server)


# -- Messages --------------------------------------------------------------------------------


def messages_sdk(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=root(server), api_key="unused", max_retries=0)


async def test_messages_reply_opens_with_a_signed_thinking_block(tmp_path):
    async with thinking_server(tmp_path, SCRIPT) as server:
        expect(server, HI)
        client = messages_sdk(server)
        whole = await anyio.to_thread.run_sync(lambda: client.messages.create(
            model="letters", max_tokens=200, messages=HI, thinking={"type": "enabled", "budget_tokens": 1024}))
        assert [b.type for b in whole.content] == ["thinking", "text"]
        assert (whole.content[0].thinking, whole.content[0].signature) == (THOUGHT, signature(THOUGHT))
        assert whole.content[1].text == "Hello!"

        def streamed():
            # another namespace: a whole-prompt hit would answer from the first turn's last row
            with client.messages.stream(model="letters", max_tokens=200, messages=HI,
                                        metadata={"user_id": "other"}) as stream:
                kinds = [(e.type, getattr(e, "content_block", None) and e.content_block.type) for e in stream]
                return kinds, stream.get_final_message()

        kinds, final = await anyio.to_thread.run_sync(streamed)
        assert [(b.type, b.model_dump(exclude={"type", "parsed_output", "citations"})) for b in final.content] == [
            (b.type, b.model_dump(exclude={"type", "citations"})) for b in whole.content]
        starts = [block for kind, block in kinds if kind == "content_block_start"]
        assert starts == ["thinking", "text"]
        assert ("signature", None) in kinds  # the SDK's event for signature_delta
        await wait_idle(server)


async def test_messages_thinking_disabled_turns_it_off_in_the_template(tmp_path):
    async with thinking_server(tmp_path, "Hello!") as server:
        off = expect(server, HI, enable_thinking=False)
        reply = await anyio.to_thread.run_sync(lambda: messages_sdk(server).messages.create(
            model="letters", max_tokens=200, messages=HI, thinking={"type": "disabled"}))
        assert (reply.usage.input_tokens, [b.type for b in reply.content]) == (off, ["text"])
        await wait_idle(server)


# -- Responses -------------------------------------------------------------------------------


async def test_responses_output_a_reasoning_item_before_the_message(tmp_path):
    async with thinking_server(tmp_path, SCRIPT) as server:
        expect(server, HI)
        client = chat_sdk(server)
        whole = await anyio.to_thread.run_sync(lambda: client.responses.create(model="letters", input="hi"))
        assert [item.type for item in whole.output] == ["reasoning", "message"]
        reasoning = whole.output[0]
        assert (reasoning.summary, [(c.type, c.text) for c in reasoning.content]) == (
            [], [("reasoning_text", THOUGHT)])
        assert whole.output_text == "Hello!"

        def streamed() -> list:
            return list(client.responses.create(model="letters", input="hi", stream=True, user="other"))

        events = await anyio.to_thread.run_sync(streamed)
        kinds = [e.type for e in events]
        first_text = kinds.index("response.output_text.delta")
        assert kinds[2] == "response.output_item.added" and events[2].item.type == "reasoning"
        assert "response.reasoning_text.done" in kinds[:first_text]
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
        done = [e.item.type for e in events if e.type == "response.output_item.done"]
        assert done == ["reasoning", "message"]
        assert events[-1].response.output[0].content[0].text == THOUGHT
        await wait_idle(server)


async def test_responses_reasoning_effort_none_turns_thinking_off(tmp_path):
    async with thinking_server(tmp_path, "Hello!") as server:
        off = expect(server, HI, enable_thinking=False)
        async with httpx.AsyncClient() as http:
            body = (await http.post(f"{root(server)}/v1/responses",
                                    json={"input": "hi", "reasoning": {"effort": "none"}})).json()
        assert (body["usage"]["input_tokens"], [i["type"] for i in body["output"]]) == (off, ["message"])
        await wait_idle(server)


# -- replayed reasoning keeps the prefix -----------------------------------------------------


def turn_script(k: int) -> str:
    return f"<think>\nthinking about turn {k}\n</think>\n\nanswer {k}"


async def _three_chat_turns(server, http: httpx.AsyncClient, *, send_back: bool) -> list[dict]:
    """Three turns of one conversation (its own namespace), each reply's reasoning sent back
    in the next turn's history (`send_back`) or dropped; the usage of each turn."""
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "first question"}]
    usages = []
    for k in range(3):
        server.device.script = turn_script(k).encode()
        expect(server, messages)
        body = (await http.post(f"{root(server)}/v1/chat/completions", json={"messages": messages, "max_tokens": 200},
                                headers={"x-prefixd-namespace": f"back-{send_back}"})).json()
        usages.append(body["usage"])
        message = body["choices"][0]["message"]
        assert (message["content"], message["reasoning_content"]) == (f"answer {k}", f"thinking about turn {k}")
        reply = {"role": "assistant", "content": message["content"]}
        if send_back:
            reply["reasoning_content"] = message["reasoning_content"]
        messages = messages + [reply, {"role": "user", "content": f"question {k + 2}"}]
    return usages


async def test_chat_history_with_or_without_reasoning_keeps_its_prefix(tmp_path):
    async with thinking_server(tmp_path, "") as server:
        async with httpx.AsyncClient() as http:
            back = await _three_chat_turns(server, http, send_back=True)
            dropped = await _three_chat_turns(server, http, send_back=False)
        # The template drops the reasoning of replies before the last user message, so both
        # ways render the same prompt; each later turn reuses the whole of the last turn's
        # prompt (the last reply diverges where its think span began): 108 of 187 tokens on
        # turn 2 (58%), 187 of 266 on turn 3 (70%).
        assert back == dropped
        prompts = [u["prompt_tokens"] for u in back]
        cached = [u["prompt_tokens_details"]["cached_tokens"] for u in back]
        assert (prompts, cached) == ([108, 187, 266], [0, 108, 187])
        await wait_idle(server)


async def _three_message_turns(server, http: httpx.AsyncClient, *, send_back: bool) -> list[dict]:
    """As _three_chat_turns, on /v1/messages: the thinking block sent back, or left out."""
    messages = [{"role": "user", "content": "first question"}]
    usages = []
    for k in range(3):
        server.device.script = turn_script(k).encode()
        expect(server, [{"role": "system", "content": "You are brief."}, *[
            {"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else m["content"][-1]["text"]}
            for m in messages]])
        body = (await http.post(f"{root(server)}/v1/messages", json={
            "system": "You are brief.", "messages": messages, "max_tokens": 200,
            "metadata": {"user_id": f"back-{send_back}"}})).json()
        usages.append(body["usage"])
        assert [b["type"] for b in body["content"]] == ["thinking", "text"]
        content = body["content"] if send_back else body["content"][1:]
        messages = messages + [{"role": "assistant", "content": content},
                               {"role": "user", "content": f"question {k + 2}"}]
    return usages


async def test_messages_history_with_or_without_thinking_blocks_keeps_its_prefix(tmp_path):
    async with thinking_server(tmp_path, "") as server:
        async with httpx.AsyncClient() as http:
            back = await _three_message_turns(server, http, send_back=True)
            dropped = await _three_message_turns(server, http, send_back=False)
        # the same conversation as the chat test's: the same prompts, the same share reused
        assert back == dropped
        assert [(u["input_tokens"], u["cache_read_input_tokens"]) for u in back] == [
            (108, 0), (187 - 108, 108), (266 - 187, 187)]
        await wait_idle(server)


async def _three_response_turns(server, http: httpx.AsyncClient, *, how: str) -> list[dict]:
    """As _three_chat_turns, on /v1/responses: each turn's output items sent back in the next
    input (`how` = "items"), sent back without the reasoning item ("dropped"), or continued
    by previous_response_id ("previous")."""
    history: list[dict] = [{"role": "user", "content": "first question"}]
    previous = None
    usages = []
    for k in range(3):
        server.device.script = turn_script(k).encode()
        chat = [{"role": "system", "content": "You are brief."}] + [
            {"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
            for m in history if m.get("type") != "reasoning"]
        expect(server, chat)
        new = history if how != "previous" or previous is None else history[-1:]
        body = {"instructions": "You are brief.", "input": new, "user": how}
        if how == "previous" and previous is not None:
            body["previous_response_id"] = previous
        answer = (await http.post(f"{root(server)}/v1/responses", json=body)).json()
        usages.append(answer["usage"])
        assert [item["type"] for item in answer["output"]] == ["reasoning", "message"]
        previous = answer["id"]
        output = answer["output"] if how != "dropped" else answer["output"][1:]
        history = history + output + [{"role": "user", "content": f"question {k + 2}"}]
    return usages


async def test_responses_history_as_items_without_them_or_stored_keeps_its_prefix(tmp_path):
    async with thinking_server(tmp_path, "") as server:
        async with httpx.AsyncClient() as http:
            ways = [await _three_response_turns(server, http, how=how) for how in ("items", "dropped", "previous")]
        assert ways[0] == ways[1] == ways[2]
        assert [(u["input_tokens"], u["input_tokens_details"]["cached_tokens"]) for u in ways[0]] == [
            (108, 0), (187, 108), (266, 187)]
        await wait_idle(server)


def test_replayed_reasoning_becomes_the_next_assistant_messages_reasoning_content():
    from prefixd.front.http.anthropic_map import chat_messages
    from prefixd.front.http.openai_map import map_chat
    from prefixd.front.http.responses_map import normalize_items, to_messages

    items = normalize_items([
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "ask"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "say it"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
    ])
    messages = to_messages(tuple(items))
    assert [(m["role"], m.get("reasoning_content")) for m in messages] == [
        ("user", None), ("assistant", "ask"), ("tool", None), ("assistant", "say it")]
    thinking = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                                  {"type": "text", "text": "a"}]},
                {"role": "user", "content": "r"}]
    assert chat_messages([], thinking, reasoning=True)[1] == {"role": "assistant", "content": "a",
                                                               "reasoning_content": "hm"}
    chat = map_chat({"messages": [{"role": "user", "content": "q"},
                                  {"role": "assistant", "content": "a", "reasoning": "hm"}]}, "")
    assert chat.generate["messages"][1] == {"role": "assistant", "content": "a", "reasoning_content": "hm"}
