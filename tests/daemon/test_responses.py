"""OpenAI's Responses API on the HTTP front, with the official `openai` package: answers,
streamed events, function calls, stored conversations (previous_response_id, GET, DELETE,
the store's bounds), ignored tool types, text.format, and the same StreamRequest as the
equivalent chat request; over the letters device."""

from __future__ import annotations

import dataclasses
import json

import httpx
import llguidance
import openai
import pytest

from prefixd.front.http.responses_store import ResponseStore
from prefixd.text.grammar import ll_tokenizer
from tests.daemon.fakes import EOS, VOCAB, ByteTokenizer, LetterDevice
from tests.daemon.harness import running_server, wait_idle
from tests.daemon.test_http import HI, base_url, reply_of
from tests.daemon.test_tools import CALL, USER, WEATHER, ScriptDevice, prompt_len

TOK = ByteTokenizer()
RESP_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses spelling of the same tool


def sdk(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(server), api_key="unused", max_retries=0)


def record_requests(server) -> list:
    """The StreamRequests the HTTP front submits to the engine, in order."""
    gate = server.http.front.gate
    seen, submit = [], gate.submit

    async def recording(request, client=None, *, on_end=None):
        seen.append(request)
        return await submit(request, client, on_end=on_end)

    gate.submit = recording
    return seen


def same_request(a, b) -> bool:
    return dataclasses.replace(a, stream_id=0) == dataclasses.replace(b, stream_id=0)


async def test_create_answers_text_and_usage_then_get_and_delete(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        client = sdk(server)
        made = await client.responses.create(model="letters", input="hi", max_output_tokens=4)
        assert made.id.startswith("resp_") and made.object == "response"
        assert (made.status, made.incomplete_details.reason) == ("incomplete", "max_output_tokens")
        assert made.output_text == reply_of(HI, 4)
        message = made.output[0]
        assert ([o.type for o in made.output], message.role, message.content[0].annotations) == (
            ["message"], "assistant", [])
        n = len(TOK.render_chat(HI).ids)
        assert made.usage.to_dict() == {
            "input_tokens": n, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 4,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n + 4,
            "prefixd": {"cache": {"result": "miss", "cached_tokens": 0, "prompt_tokens": n, "reason": "namespace_empty"}}}
        got = await client.responses.retrieve(made.id)
        assert got.model_dump() == made.model_dump()
        async with httpx.AsyncClient() as http:
            deleted = await http.delete(f"{base_url(server)}/responses/{made.id}")
        assert deleted.json() == {"id": made.id, "object": "response", "deleted": True}
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(made.id)
        await client.close()
        await wait_idle(server)


async def test_streaming_gives_the_event_sequence_and_the_same_text(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        client = sdk(server)
        stream = await client.responses.create(model="letters", input="hi", max_output_tokens=5, stream=True)
        events = [event async for event in stream]
        types = [e.type for e in events]
        deltas = types.count("response.output_text.delta")  # the first token's, then the rest as they came
        assert types == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.incomplete"] and 2 <= deltas <= 5
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = reply_of(HI, 5)
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
        assert events[-4].text == text and events[-1].response.output_text == text
        assert events[0].response.status == "in_progress" and events[0].response.output == []
        assert events[-1].response.usage.output_tokens == 5
        stored = await client.responses.retrieve(events[-1].response.id)
        assert stored.output_text == text
        await client.close()
        await wait_idle(server)


async def test_a_function_call_then_its_output_through_previous_response_id(tmp_path):
    device = ScriptDevice("Sure. " + CALL, prompt_len(USER, [WEATHER]))
    async with running_server(tmp_path, device, http_addr="127.0.0.1:0") as server:
        seen = record_requests(server)
        client = sdk(server)
        first = await client.responses.create(model="letters", input=USER, tools=[RESP_WEATHER],
                                              max_output_tokens=200)
        assert (first.status, [o.type for o in first.output], first.output_text) == (
            "completed", ["message", "function_call"], "Sure. ")
        call = first.output[1]
        assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Paris"}, "completed")
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"}
        second = await client.responses.create(model="letters", previous_response_id=first.id, input=[output],
                                               tools=[RESP_WEATHER], max_output_tokens=200)
        history = USER + [
            {"role": "assistant", "content": "Sure. ", "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "18C and sunny"}]
        assert second.usage.input_tokens == prompt_len(history, [WEATHER])
        assert second.usage.input_tokens_details.cached_tokens == prompt_len(USER, [WEATHER])  # the call renders back as spelled, not as sampled
        assert (second.status, second.output_text) == ("completed", "")
        chat = await client.chat.completions.create(model="letters", messages=history, tools=[WEATHER],
                                                    max_tokens=200)
        assert chat.choices[0].message.content == ""
        assert len(seen) == 3 and same_request(seen[1], seen[2])
        stream = await client.responses.create(model="letters", input=USER, tools=[RESP_WEATHER],
                                               max_output_tokens=200, stream=True)
        events = [event async for event in stream]
        assert [e.type for e in events if "function_call" in e.type or "output_item" in e.type] == [
            "response.output_item.added", "response.output_item.done", "response.output_item.added",
            "response.function_call_arguments.delta", "response.function_call_arguments.done",
            "response.output_item.done"]
        assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["message", "function_call"]
        assert events[-1].type == "response.completed" and events[-1].response.output[1].arguments == call.arguments
        await client.close()
        await wait_idle(server)


async def two_turns_through_chat(tmp_path) -> tuple[int, str]:
    """The cached tokens and text of the second turn of HI + "more" through chat completions."""
    async with running_server(tmp_path / "chat", http_addr="127.0.0.1:0") as server:
        client = sdk(server)
        first = await client.chat.completions.create(model="letters", messages=HI, max_tokens=4)
        history = HI + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "more"}]
        second = await client.chat.completions.create(model="letters", messages=history, max_tokens=3)
        await client.close()
        return second.usage.prompt_tokens_details.cached_tokens, second.choices[0].message.content


async def test_previous_response_id_continues_the_conversation_from_the_cache(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        client = sdk(server)
        first = await client.responses.create(model="letters", input="hi", max_output_tokens=4)
        second = await client.responses.create(model="letters", previous_response_id=first.id, input="more",
                                               max_output_tokens=3)
        history = HI + [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "more"}]
        assert second.usage.input_tokens == len(TOK.render_chat(history).ids)
        assert second.output_text == reply_of(history, 3) and second.previous_response_id == first.id
        cached = second.usage.input_tokens_details.cached_tokens
        assert cached > len(TOK.render_chat(HI).ids)
        assert (cached, second.output_text) == await two_turns_through_chat(tmp_path)
        with pytest.raises(openai.NotFoundError) as info:
            await client.responses.create(model="letters", previous_response_id="resp_nope", input="more")
        assert info.value.body["code"] == "previous_response_not_found"
        assert info.value.body["param"] == "previous_response_id"
        await client.close()
        await wait_idle(server)


async def test_store_false_and_other_namespaces_are_not_found(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        client = sdk(server)
        unstored = await client.responses.create(model="letters", input="hi", max_output_tokens=2, store=False)
        assert unstored.store is False and unstored.output_text == reply_of(HI, 2)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="letters", previous_response_id=unstored.id, input="more")
        theirs = {"x-prefixd-namespace": "alice"}
        kept = await client.responses.create(model="letters", input="hi", max_output_tokens=2, extra_headers=theirs)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(kept.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="letters", previous_response_id=kept.id, input="more")
        assert (await client.responses.retrieve(kept.id, extra_headers=theirs)).id == kept.id
        assert server.http.front.responses_api.store.num_responses == 1
        await client.close()
        await wait_idle(server)


def test_the_store_evicts_the_least_recently_used_past_its_count_and_bytes():
    def body(i: int) -> dict:
        return {"id": f"resp_{i}", "output": []}

    item = ({"type": "message", "role": "user", "content": "x" * 10},)
    one = len(json.dumps([body(0), item]).encode())
    store = ResponseStore(max_responses=2, max_bytes=1 << 20)
    assert store.put("", body(1), item) == [] and store.put("", body(2), item) == []
    assert store.get("", "resp_1") is not None  # resp_1 is now the most recent
    assert store.put("", body(3), item) == ["resp_2"]
    assert [store.get("", f"resp_{i}") is not None for i in (1, 2, 3)] == [True, False, True]
    assert store.num_bytes == 2 * one
    by_bytes = ResponseStore(max_responses=100, max_bytes=3 * one)
    for i in range(4):
        by_bytes.put("ns", body(i), item)
    assert [by_bytes.get("ns", f"resp_{i}") is not None for i in range(4)] == [False, True, True, True]
    assert (by_bytes.num_responses, by_bytes.num_bytes) == (3, 3 * one)
    assert by_bytes.put("ns", body(9), item * 100) == ["resp_9"] and by_bytes.num_responses == 3
    assert by_bytes.get("other", "resp_3") is None and by_bytes.delete("ns", "resp_3")
    assert (by_bytes.num_responses, by_bytes.num_bytes) == (2, 2 * one)


async def test_the_store_bounds_hold_through_the_routes(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        store = server.http.front.responses_api.store = ResponseStore(max_responses=2)
        client = sdk(server)
        made = [await client.responses.create(model="letters", input="hi", max_output_tokens=2) for _ in range(3)]
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(made[0].id)
        assert [(await client.responses.retrieve(r.id)).id for r in made[1:]] == [r.id for r in made[1:]]
        store.max_bytes = store.num_bytes  # room for these two and no more
        await client.responses.create(model="letters", input="hi", max_output_tokens=2)
        assert store.num_responses <= 2 and store.num_bytes <= store.max_bytes
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(made[1].id)
        await client.close()
        await wait_idle(server)


async def test_other_tool_types_are_ignored_and_reported(tmp_path):
    device = ScriptDevice("Sure. " + CALL, prompt_len(USER, [WEATHER]))
    async with running_server(tmp_path, device, http_addr="127.0.0.1:0") as server:
        client = sdk(server)
        tools = [{"type": "web_search"}, RESP_WEATHER, {"type": "file_search", "vector_store_ids": ["vs_1"]},
                 {"type": "custom", "name": "apply_patch"}]
        made = await client.responses.create(model="letters", input=USER, tools=tools, max_output_tokens=200)
        assert made.to_dict()["prefixd"] == {"ignored_tools": ["web_search", "file_search", "custom"]}
        assert made.usage.input_tokens == prompt_len(USER, [WEATHER])
        assert [o.type for o in made.output] == ["message", "function_call"]
        plain = await client.responses.create(model="letters", input="hi", max_output_tokens=1)
        assert "prefixd" not in plain.to_dict()
        await client.close()
        await wait_idle(server)


class GrammarDevice(LetterDevice):
    """Letters where free; under a grammar, the letter when the grammar allows it, else the
    end of text when it allows that (or is complete), else the highest id it allows."""

    def __init__(self) -> None:
        super().__init__()
        self.ll = ll_tokenizer(TOK)
        self.matchers: dict[int, llguidance.LLMatcher | None] = {}

    def run_round(self, plan):
        for setup in plan.samplers:
            grammar = setup.sampling.grammar
            self.matchers[setup.lane] = None if grammar is None else llguidance.LLMatcher(self.ll, grammar, log_level=0)
        result = super().run_round(plan)
        return dataclasses.replace(result, lanes=tuple(map(self._constrain, result.lanes)),
                                   stored=tuple(map(self._constrain, result.stored)))

    def _constrain(self, result):
        matcher = self.matchers.get(result.lane)
        if matcher is None or not result.sampled:
            return result
        picked = []
        for token in result.sampled:
            if matcher.is_stopped():  # the grammar is complete: only the end of text is left
                picked.append(EOS)
                continue
            choice = next(c for c in (token, EOS, *range(VOCAB - 1, 2, -1)) if matcher.validate_tokens([c]) == 1)
            matcher.consume_token(choice)
            picked.append(choice)
        return dataclasses.replace(result, sampled=tuple(picked))


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


async def test_text_format_json_schema_constrains_the_output_as_chat_does(tmp_path):
    async with running_server(tmp_path, GrammarDevice(), http_addr="127.0.0.1:0") as server:
        seen = record_requests(server)
        client = sdk(server)
        text = {"format": {"type": "json_schema", "name": "count", "schema": SCHEMA, "strict": True}}
        made = await client.responses.create(model="letters", input="count", text=text, max_output_tokens=50)
        assert made.status == "completed" and set(json.loads(made.output_text)) == {"n"}
        chat = await client.chat.completions.create(
            model="letters", messages=[{"role": "user", "content": "count"}], max_tokens=50,
            response_format={"type": "json_schema", "json_schema": {"name": "count", "schema": SCHEMA, "strict": True}})
        assert chat.choices[0].message.content == made.output_text
        assert seen[0].sampling.grammar is not None and same_request(seen[0], seen[1])
        as_object = await client.responses.create(model="letters", input="any", max_output_tokens=50,
                                                  text={"format": {"type": "json_object"}})
        assert isinstance(json.loads(as_object.output_text), dict)
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(model="letters", input="x", text={"format": {
                "type": "json_schema", "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}})
        assert info.value.body["param"] == "text.format"
        await client.close()
        await wait_idle(server)


EQUIVALENT_INPUT = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
    {"role": "user", "content": [{"type": "input_text", "text": "Say "}, {"type": "input_text", "text": "it."}]},
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It.", "annotations": []}]},
    {"role": "user", "content": "Again."}]
EQUIVALENT_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Rules."},
                       {"role": "user", "content": "Say it."}, {"role": "assistant", "content": "It."},
                       {"role": "user", "content": "Again."}]


async def test_a_responses_request_reaches_the_engine_as_the_equivalent_chat_request(tmp_path):
    # Two servers, so neither request is a cache hit of the other.
    async with running_server(tmp_path / "responses", http_addr="127.0.0.1:0") as one, \
            running_server(tmp_path / "chat", http_addr="127.0.0.1:0") as other:
        seen, seen_chat = record_requests(one), record_requests(other)
        client, chat_client = sdk(one), sdk(other)
        made = await client.responses.create(model="letters", instructions="Be brief.", input=EQUIVALENT_INPUT,
                                             max_output_tokens=6, temperature=0.0, top_p=0.5)
        chat = await chat_client.chat.completions.create(model="letters", messages=EQUIVALENT_MESSAGES,
                                                         max_tokens=6, temperature=0.0, top_p=0.5)
        assert len(seen) == len(seen_chat) == 1 and same_request(seen[0], seen_chat[0])
        assert seen[0].tokens == TOK.render_chat(EQUIVALENT_MESSAGES).ids and seen[0].chunk_starts
        assert made.output_text == chat.choices[0].message.content == reply_of(EQUIVALENT_MESSAGES, 6)
        await client.close()
        await chat_client.close()
        await wait_idle(one)
        await wait_idle(other)


@pytest.mark.parametrize("body, status, param", [
    ({"model": "letters", "input": []}, 400, "input"),
    ({"model": "letters", "input": [{"type": "input_image", "image_url": "x"}]}, 400, "input"),
    ({"model": "letters", "input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input"),
    ({"model": "letters", "input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"model": "letters", "input": "hi", "background": True}, 400, "background"),
    ({"model": "letters", "input": "hi", "tool_choice": {"type": "web_search"}}, 400, "tool_choice"),
    ({"model": "gpt-5", "input": "hi"}, 404, "model"),
])
async def test_bad_requests_get_an_openai_shaped_error(tmp_path, body, status, param):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        async with httpx.AsyncClient() as http:
            answer = await http.post(f"{base_url(server)}/responses", json=body)
        assert (answer.status_code, answer.json()["error"]["param"]) == (status, param)
        await wait_idle(server)
