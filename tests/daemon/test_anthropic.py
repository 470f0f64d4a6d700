"""Anthropic's Messages API on the HTTP front, with the official `anthropic` package (sync,
async, streaming, a tool_use loop, count_tokens), error shapes and bad input, x-api-key,
the billing-header hygiene, and a Messages request reaching the engine as the same
StreamRequest as the Chat Completions request that says the same; over the letters device."""

from __future__ import annotations

import dataclasses
import json

import anthropic
import anyio
import httpx
import openai
import pytest

from prefixd.front.http.anthropic_map import chat_messages, map_messages
from prefixd.text.hygiene import normalise_system, strip_billing_header
from tests.daemon.fakes import ByteTokenizer, letter_after
from tests.daemon.harness import running_server, wait_idle
from tests.daemon.test_tools import CALL, USER, WEATHER, ScriptDevice, prompt_len

TOK = ByteTokenizer()
HI = [{"role": "user", "content": "hi"}]
TOOL = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}  # WEATHER, Anthropic's way


def root(server) -> str:
    return f"http://127.0.0.1:{server.http.port}"


def sdk(server, cls=anthropic.Anthropic, **kw):
    return cls(base_url=root(server), api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def reply_of(messages: list[dict], count: int) -> str:
    n = len(TOK.render_chat(messages).ids)
    return "".join(letter_after(n - 1 + i) for i in range(count))


def billing(nonce: str) -> dict:
    line = f"x-anthropic-billing-header: cc_version=2.0.14.abc; cc_entrypoint=cli; cch={nonce};"
    return {"type": "text", "text": line}


async def test_sync_client_reports_text_stop_reason_and_cache_reads(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        client = sdk(server)
        ask = lambda: client.messages.create(model="letters", max_tokens=4, messages=HI)  # noqa: E731
        first = await anyio.to_thread.run_sync(ask)
        second = await anyio.to_thread.run_sync(ask)
        n = len(TOK.render_chat(HI).ids)
        assert (first.type, first.role, first.model) == ("message", "assistant", "letters")
        assert first.id.startswith("msg_")
        assert [(b.type, b.text) for b in first.content] == [("text", reply_of(HI, 4))]
        assert (first.stop_reason, first.stop_sequence) == ("max_tokens", None)
        u1, u2 = first.usage, second.usage
        assert (u1.input_tokens, u1.output_tokens) == (n, 4)
        assert (u1.cache_read_input_tokens, u1.cache_creation_input_tokens) == (0, 0)
        assert (u2.input_tokens, u2.cache_read_input_tokens) == (0, n)
        await wait_idle(server)


async def test_async_stream_events_text_and_stop_sequence(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        client = sdk(server, anthropic.AsyncAnthropic)
        async with client.messages.stream(model="letters", max_tokens=5, messages=HI) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        assert text == reply_of(HI, 5) and final.content[0].text == text
        assert (final.stop_reason, final.usage.output_tokens, final.usage.input_tokens) == ("max_tokens", 5,
                                                                                          len(TOK.render_chat(HI).ids))
        other = [{"role": "user", "content": "other"}]  # a new prompt: not a full hit of the first
        letters = reply_of(other, 6)
        stopped = await client.messages.create(model="letters", max_tokens=20, messages=other,
                                               stop_sequences=["zzz", letters[3:5]])
        assert [b.text for b in stopped.content] == [letters[:3]]
        assert (stopped.stop_reason, stopped.stop_sequence, stopped.usage.output_tokens) == (
            "stop_sequence", letters[3:5], 5)
        async with httpx.AsyncClient() as http:
            raw = await http.post(f"{root(server)}/v1/messages", json={
                "model": "letters", "max_tokens": 2, "messages": [{"role": "user", "content": "raw"}], "stream": True})
        names = [line[len("event: "):] for line in raw.text.splitlines() if line.startswith("event: ")]
        assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                         "content_block_stop", "message_delta", "message_stop"]
        await client.close()
        await wait_idle(server)


async def test_a_tool_use_loop(tmp_path):
    n = prompt_len(USER, [WEATHER])
    device = ScriptDevice("Sure. " + CALL, n)
    async with running_server(tmp_path, device, http_addr="127.0.0.1:0") as server:
        client = sdk(server, anthropic.AsyncAnthropic)
        reply = await client.messages.create(model="letters", max_tokens=200, messages=USER, tools=[TOOL])
        assert reply.stop_reason == "tool_use"
        text, use = reply.content
        assert (text.type, text.text) == ("text", "Sure. ")
        assert (use.type, use.name, use.input, use.id.startswith("toolu_")) == ("tool_use", "get_weather",
                                                                               {"city": "Paris"}, True)
        assert reply.usage.input_tokens == n
        async with client.messages.stream(model="letters", max_tokens=200, messages=USER, tools=[TOOL]) as stream:
            streamed = await stream.get_final_message()
        assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == [
            ("text", None), ("tool_use", {"city": "Paris"})]
        result = {"type": "tool_result", "tool_use_id": use.id, "content": "18C"}
        history = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                          {"role": "user", "content": [result]}]
        second = await client.messages.create(model="letters", max_tokens=1, messages=history, tools=[TOOL])
        assert second.usage.cache_read_input_tokens >= n  # the tools' system message was not computed again
        counted = await client.messages.count_tokens(model="letters", messages=history, tools=[TOOL])
        assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens
        await client.close()
        await wait_idle(server)


async def test_count_tokens_is_the_rendering_of_system_messages_and_tools(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        client = sdk(server, anthropic.AsyncAnthropic)
        counted = await client.messages.count_tokens(model="letters", messages=USER, tools=[TOOL])
        assert counted.input_tokens == prompt_len(USER, [WEATHER])
        system = [billing("n1"), {"type": "text", "text": "Be brief."}]
        counted = await client.messages.count_tokens(model="letters", system=system, messages=HI)
        assert counted.input_tokens == len(TOK.render_chat([{"role": "system", "content": "Be brief."}, *HI]).ids)
        await client.close()
        assert (await wait_idle(server))["waiting"] == 0


def _body(**fields) -> bytes:
    return json.dumps({"model": "letters", "max_tokens": 4, "messages": HI, **fields}).encode()


@pytest.mark.parametrize("body, status, kind, needle", [
    (b"{not json", 400, "invalid_request_error", "body is not valid JSON"),
    (json.dumps({"model": "letters", "messages": HI}).encode(), 400, "invalid_request_error", "max_tokens: required"),
    (_body(model="claude-sonnet-4-5"), 404, "not_found_error", "model 'claude-sonnet-4-5' is not served here"),
    (_body(messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}]), 400, "invalid_request_error",
     "messages[0].content[0].type: unknown content block type 'video'"),
    (_body(messages=[{"role": "user", "content": [{"text": "no type"}]}]), 400, "invalid_request_error",
     "messages[0].content[0]: must be a content block"),
    (_body(messages=[{"role": "user", "content": [{"type": "text", "text": 7}]}]), 400, "invalid_request_error",
     "messages[0].content[0].text: must be a string"),
    (_body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]),
     400, "invalid_request_error", "'toolu_x' is not the id of a tool_use in an earlier assistant message"),
    (_body(messages=HI + [{"role": "assistant", "content": "pre"}]), 400, "invalid_request_error", "prefill"),
    (_body(max_tokens=0), 400, "invalid_request_error", "max_tokens:"),
    (_body(messages=HI + [{"role": "tool", "content": "x"}]), 400, "invalid_request_error",
     "messages[1].role: must be user, assistant or system"),
    (_body(messages=[{"role": "system", "content": "only"}]), 400, "invalid_request_error",
     "messages: must hold a user message"),
    (_body(messages=HI + [{"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     400, "invalid_request_error", "messages[1].content[0]: only text blocks may be here"),
    (_body(tool_choice={"type": "any"}), 400, "invalid_request_error", "tool_choice: needs tools"),
])
async def test_bad_input_gets_an_anthropic_shaped_error(tmp_path, body, status, kind, needle):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        async with httpx.AsyncClient() as http:
            answer = await http.post(f"{root(server)}/v1/messages", content=body,
                                     headers={"content-type": "application/json"})
        assert answer.status_code == status
        reply = answer.json()
        assert set(reply) == {"type", "error"} and reply["type"] == "error"
        assert (set(reply["error"]), reply["error"]["type"]) == ({"type", "message"}, kind)
        assert needle in reply["error"]["message"], reply
        await wait_idle(server)


async def test_the_sdk_raises_its_typed_errors(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        client = sdk(server, anthropic.AsyncAnthropic)
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(model="letters", max_tokens=4,
                                         messages=[{"role": "user", "content": [{"type": "video"}]}])
        assert info.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="claude-opus-4", max_tokens=4, messages=HI)
        await client.close()


async def test_x_api_key_or_bearer_when_a_token_is_configured(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    async with running_server(tmp_path, http_addr="127.0.0.1:0", http_token_file=token_file) as server:
        ask = dict(model="letters", max_tokens=2, messages=HI)
        key = sdk(server, anthropic.AsyncAnthropic, api_key="s3cret")
        with_key = await key.messages.create(**ask, metadata={"user_id": "a"})
        bearer = anthropic.AsyncAnthropic(base_url=root(server), auth_token="s3cret", max_retries=0)
        with_bearer = await bearer.messages.create(**ask, metadata={"user_id": "b"})  # b: not a hit of a's
        assert with_key.content[0].text == with_bearer.content[0].text == reply_of(HI, 2)
        with pytest.raises(anthropic.AuthenticationError) as info:
            await sdk(server, anthropic.AsyncAnthropic, api_key="wrong").messages.create(**ask)
        assert info.value.status_code == 401 and info.value.body["error"]["type"] == "authentication_error"
        chat = openai.AsyncOpenAI(base_url=f"{root(server)}/v1", api_key="s3cret", max_retries=0)
        assert (await chat.chat.completions.create(model="letters", messages=HI, max_tokens=2)).choices
        await wait_idle(server)


async def _two_turns(server, system: str) -> list[dict]:
    """Two turns of one conversation whose system prompt starts with a new billing nonce each turn."""
    system_rest = {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}
    turn = [{"role": "user", "content": "hello there"}]
    usages = []
    async with httpx.AsyncClient() as http:
        for nonce in ("3f9a1", "c07e2"):
            body = {"model": "letters", "max_tokens": 3, "system": [billing(nonce), system_rest], "messages": turn}
            answer = (await http.post(f"{root(server)}/v1/messages", json=body,
                                      headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x"})).json()
            usages.append(answer["usage"])
            turn = turn + [{"role": "assistant", "content": answer["content"]},
                           {"role": "user", "content": "and then?"}]
    return usages


async def test_the_billing_header_hygiene_keeps_the_next_turn_a_cache_hit(tmp_path):
    first_prompt = len(TOK.render_chat([{"role": "system", "content": "You are careful."},
                                        {"role": "user", "content": "hello there"}]).ids)
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        first, second = await _two_turns(server, "You are careful.")
        assert first["prefixd"]["normalised"] == second["prefixd"]["normalised"] == ["billing_header"]
        assert first["cache_read_input_tokens"] == 0
        assert second["cache_read_input_tokens"] >= first_prompt
        server.http.front.normalisers = ()
        first, second = await _two_turns(server, "You are thorough.")  # nothing in common with the above
        assert "normalised" not in first["prefixd"] and "normalised" not in second["prefixd"]
        # the letters device is row-invariant, so a grid point (8 rows) may be a resume point too:
        # what is reused is the whole grid chunks before the nonce, not the system prompt after it
        before_nonce = len("<system>" + billing("")["text"].removesuffix(";"))
        assert second["cache_read_input_tokens"] == before_nonce // 8 * 8 == 80
        await wait_idle(server)


async def test_messages_and_chat_reach_the_engine_as_the_same_request(tmp_path):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "three"}]},
        {"role": "user", "content": "four"},
    ]
    chat = [{"role": "system", "content": "sys a\n\nsys b"}, {"role": "user", "content": "one\n\ntwo"},
            {"role": "assistant", "content": "three"}, {"role": "user", "content": "four"}]
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        seen = []
        submit = server.gate.link.submit

        async def spy(request, **kw):
            seen.append(request)
            return await submit(request, **kw)

        server.gate.link.submit = spy
        client = sdk(server, anthropic.AsyncAnthropic)
        reply = await client.messages.create(
            model="letters", max_tokens=6, messages=messages, stop_sequences=["zz"],
            extra_body={"temperature": 0.5, "top_k": 3},  # this SDK's create() names neither
            system=[{"type": "text", "text": "sys a"}, {"type": "text", "text": "sys b"}], metadata={"user_id": "u1"})
        other = openai.AsyncOpenAI(base_url=f"{root(server)}/v1", api_key="unused", max_retries=0)
        same = await other.chat.completions.create(model="letters", max_tokens=6, messages=chat, stop=["zz"],
                                                   temperature=0.5, extra_body={"top_k": 3}, user="u2")
        # u2: its own namespace, so the chat request is computed afresh, not a hit of the first
        assert reply.content[0].text == same.choices[0].message.content == reply_of(chat, 6)
        assert len(seen) == 2 and seen[1].namespace == "u2"
        as_first = dataclasses.replace(seen[1], stream_id=seen[0].stream_id, namespace="u1", client=seen[0].client)
        assert as_first == seen[0]
        assert seen[0].tokens == TOK.render_chat(chat).ids
        assert (seen[0].namespace, seen[0].sampling.top_k) == ("u1", 3)
        await client.close()
        await other.close()
        await wait_idle(server)


def test_thinking_goes_where_the_template_reasons_else_nowhere():
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "let me see", "signature": "x"},
                                                  {"type": "redacted_thinking", "data": "zz"},
                                                  {"type": "tool_use", "id": "toolu_1", "name": "f",
                                                   "input": {"a": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                              "content": [{"type": "text", "text": "boom"}]},
                                             {"type": "text", "text": "go on",
                                              "cache_control": {"type": "ephemeral"}}]}]
    call = {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    tail = [{"role": "tool", "tool_call_id": "toolu_1", "content": "Error: boom"}, {"role": "user", "content": "go on"}]
    assert chat_messages([], messages, reasoning=True) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "let me see"}, *tail]
    assert chat_messages(["s"], messages, reasoning=False) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call]}, *tail]


def test_system_messages_among_the_turns_join_the_system_prompt():
    """Claude Code sends its environment block as a system-role message after the first user
    message: it renders as the system prompt's last part (after the billing header is gone),
    where it stays as the conversation grows."""
    env = {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /tmp"}]}
    late = {"model": "letters", "max_tokens": 4, "system": [billing("n1"), {"type": "text", "text": "sys"}],
            "messages": [*HI, env]}
    turn2 = {**late, "messages": [*HI, env, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]}
    plain = {"model": "letters", "max_tokens": 4, "system": "sys\n\n# Environment\ncwd: /tmp", "messages": HI}

    def generate(body):
        return map_messages(body, "", reasoning=False, normalisers=("billing_header",)).chat.generate

    assert generate(late) == generate(plain)
    assert generate(late)["messages"] == [{"role": "system", "content": "sys\n\n# Environment\ncwd: /tmp"}, *HI]
    assert generate(turn2)["messages"][:2] == generate(late)["messages"]  # the first turn's prompt, unmoved


def test_the_billing_header_normaliser_removes_only_the_header():
    header = billing("ab12")["text"]
    assert strip_billing_header([header, "You are Claude Code."]) == ["You are Claude Code."]
    assert strip_billing_header([header + "\nYou are Claude Code.\nx-anthropic-billing-header: kept"]) == [
        "You are Claude Code.\nx-anthropic-billing-header: kept"]
    assert strip_billing_header(["Plain.", ""]) == ["Plain.", ""]
    assert normalise_system([header, "a"], ("billing_header",)) == (["a"], ("billing_header",))
    assert normalise_system(["a"], ("billing_header",)) == (["a"], ())
    assert normalise_system([header, "a"], ()) == ([header, "a"], ())
