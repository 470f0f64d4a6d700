"""The OpenAI-compatible HTTP front, with the official `openai` package (sync, async,
streaming), curl for server-sent events, and bad input; over the letters device."""

from __future__ import annotations

import json
import shutil

import anyio
import httpx
import openai
import pytest

from tests.daemon.fakes import ByteTokenizer, letter_after
from tests.daemon.harness import running_server, wait_idle
from tests.daemon.test_tools import CALL, USER, WEATHER, ScriptDevice, prompt_len

TOK = ByteTokenizer()
HI = [{"role": "user", "content": "hi"}]


def base_url(server) -> str:
    return f"http://127.0.0.1:{server.http.port}/v1"


def reply_of(messages: list[dict], count: int) -> str:
    n = len(TOK.render_chat(messages).ids)
    return "".join(letter_after(n - 1 + i) for i in range(count))


async def test_sync_client_chat_reports_text_usage_and_cached_tokens(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        client = openai.OpenAI(base_url=base_url(server), api_key="unused")
        ask = lambda: client.chat.completions.create(model="letters", messages=HI, max_tokens=4)  # noqa: E731
        first = await anyio.to_thread.run_sync(ask)
        second = await anyio.to_thread.run_sync(ask)
        assert first.choices[0].message.content == reply_of(HI, 4)
        assert (first.choices[0].finish_reason, first.usage.completion_tokens) == ("length", 4)
        assert first.usage.prompt_tokens == len(TOK.render_chat(HI).ids)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
        models = await anyio.to_thread.run_sync(client.models.list)
        assert [m.id for m in models.data] == ["letters"]
        await wait_idle(server)


async def test_async_client_streams_the_same_text_and_usage(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        client = openai.AsyncOpenAI(base_url=base_url(server), api_key="unused")
        stream = await client.chat.completions.create(model="letters", messages=HI, max_tokens=5, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reply_of(HI, 5)
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        assert chunks[-1].usage.completion_tokens == 5
        completion = await client.completions.create(model="letters", prompt="abc", max_tokens=3)
        assert completion.choices[0].text == "cde"
        other = [{"role": "user", "content": "other"}]  # a new prompt: the letters device's full hits differ
        letters = reply_of(other, 6)
        stopped = await client.chat.completions.create(model="letters", messages=other, max_tokens=20,
                                                       stop=letters[3:5])
        assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == (letters[:3], "stop")
        await client.close()
        await wait_idle(server)


async def test_tool_calls_and_stop_through_http(tmp_path):
    device = ScriptDevice("Sure. " + CALL, prompt_len(USER, [WEATHER]))
    async with running_server(tmp_path, device, http_addr="127.0.0.1:0") as server:
        client = openai.AsyncOpenAI(base_url=base_url(server), api_key="unused")
        reply = await client.chat.completions.create(model="letters", messages=USER, tools=[WEATHER], max_tokens=200)
        message = reply.choices[0].message
        assert (message.content, reply.choices[0].finish_reason) == ("Sure. ", "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
        stream = await client.chat.completions.create(model="letters", messages=USER, tools=[WEATHER], max_tokens=200,
                                                      stream=True)
        chunks = [chunk async for chunk in stream]
        calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])]
        assert [c.function.name for c in calls] == ["get_weather"]
        await client.close()
        await wait_idle(server)


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
async def test_curl_reads_server_sent_events(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        body = json.dumps({"model": "letters", "messages": HI, "max_tokens": 3, "stream": True})
        cmd = ["curl", "-sN", "-H", "content-type: application/json", "-d", body, f"{base_url(server)}/chat/completions"]
        done = await anyio.run_process(cmd)
        events = [line[len("data: "):] for line in done.stdout.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == reply_of(HI, 3)
        await wait_idle(server)


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "body is not valid JSON"),
    (json.dumps({"model": "gpt-4o", "messages": HI}).encode(), 404, "model 'gpt-4o' is not served here"),
    (json.dumps({"model": "letters", "messages": HI, "n": 2}).encode(), 400, "n: only n=1 is supported"),
    (json.dumps({"model": "letters", "messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}).encode(), 400, "response_format:"),
    (json.dumps({"model": "letters", "messages": HI, "max_tokens": 0}).encode(), 400, "max_tokens:"),
    (b"{" + b" " * (9 << 20) + b"}", 413, "over the"),
])
async def test_bad_input_gets_an_openai_shaped_error(tmp_path, body, status, needle):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        async with httpx.AsyncClient() as http:
            answer = await http.post(f"{base_url(server)}/chat/completions", content=body,
                                     headers={"content-type": "application/json"})
        assert answer.status_code == status
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and needle in error["message"]
        await wait_idle(server)


async def test_a_client_that_leaves_mid_stream_cancels_its_generate(tmp_path):
    device = LetterDeviceSlow()
    async with running_server(tmp_path, device, http_addr="127.0.0.1:0") as server:
        body = {"model": "letters", "messages": HI, "max_tokens": 200, "stream": True}
        async with httpx.AsyncClient() as http:
            async with http.stream("POST", f"{base_url(server)}/chat/completions", json=body) as answer:
                async for line in answer.aiter_lines():
                    if '"content": "' in line and '"content": ""' not in line:
                        break  # one token arrived: leave
        status = await wait_idle(server)
        assert status["waiting"] == 0 and server.http.front.num_streams == 0


async def test_a_bearer_token_is_required_when_configured(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    async with running_server(tmp_path, http_addr="127.0.0.1:0", http_token_file=token_file) as server:
        async with httpx.AsyncClient() as http:
            refused = await http.get(f"{base_url(server)}/models")
            allowed = await http.get(f"{base_url(server)}/models", headers={"authorization": "Bearer s3cret"})
            health = await http.get(f"http://127.0.0.1:{server.http.port}/health")
        assert (refused.status_code, refused.json()["error"]["code"]) == (401, "invalid_api_key")
        assert allowed.status_code == 200 and health.json() == {"status": "ok"}


def LetterDeviceSlow():  # noqa: N802 - a paced device so a client can leave mid-stream
    from tests.daemon.fakes import LetterDevice

    return LetterDevice(round_delay_s=0.01)


def test_http_flags_need_a_token_beyond_loopback(tmp_path):
    from types import SimpleNamespace

    from prefixd.daemon.config import ConfigError, config_from_args

    assert config_from_args(SimpleNamespace(http="127.0.0.1:8000"), env={}).http_addr == "127.0.0.1:8000"
    with pytest.raises(ConfigError, match="beyond loopback needs --http-token-file"):
        config_from_args(SimpleNamespace(http="0.0.0.0:8000"), env={})
    token = tmp_path / "token"
    token.write_text("t")
    cfg = config_from_args(SimpleNamespace(http="0.0.0.0:8000", http_token_file=str(token)), env={})
    assert cfg.http_token_file == token
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        config_from_args(SimpleNamespace(http="8000"), env={})
