"""usage.prefixd and the `prefixd` request field, the same on Chat Completions, Messages and
Responses (prefixd/front/http/extension.py): the cache report with where a prompt left the
cache, the generated ids with their logits digests (equal to the socket's), the draft switch
reaching the engine, and a clear 400 in each API's shape for a field that is not known."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from prefixd.ipc.client import AsyncClient
from tests.daemon.fakes import ByteTokenizer
from tests.daemon.harness import running_server, wait_idle

TOK = ByteTokenizer()
A = "the quick brown fox jumps over the lazy dog"
B = A[:21] + "X" + A[22:]  # differs from A at its 22nd character


def root(server) -> str:
    return f"http://127.0.0.1:{server.http.port}"


def chat_body(text: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 4, **fields}


def messages_body(text: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/messages", {"messages": [{"role": "user", "content": text}], "max_tokens": 4, **fields}


def responses_body(text: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/responses", {"input": [{"role": "user", "content": text}], "max_output_tokens": 4,
                             "store": False, **fields}


def cached_of(answer: dict[str, Any]) -> int:
    usage = answer["usage"]
    for path in (("prompt_tokens_details", "cached_tokens"), ("cache_read_input_tokens",),
                 ("input_tokens_details", "cached_tokens")):
        value: Any = usage
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            return value
    raise AssertionError(f"no cached count in {usage}")


BODIES = [chat_body, messages_body, responses_body]
IDS = ["chat", "messages", "responses"]


async def post(http: httpx.AsyncClient, server, route_body: tuple[str, dict[str, Any]], namespace: str) -> httpx.Response:
    route, body = route_body
    return await http.post(f"{root(server)}{route}", json=body, headers={"x-prefixd-namespace": namespace})


@pytest.mark.parametrize("body", BODIES, ids=IDS)
async def test_usage_reports_the_cache_and_where_the_prompt_diverged(tmp_path, body):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        async with httpx.AsyncClient() as http:
            first = (await post(http, server, body(A), "ns")).json()
            second = (await post(http, server, body(B), "ns")).json()
        cold = first["usage"]["prefixd"]["cache"]
        assert (cold["result"], cold["cached_tokens"], cold["reason"]) == ("miss", 0, "namespace_empty")
        report = second["usage"]["prefixd"]["cache"]
        assert (report["result"], report["reason"]) == ("hit", "diverged")
        assert report["cached_tokens"] == cached_of(second) > 0
        div = report["divergence"]
        rendered_a = TOK.render_chat([{"role": "user", "content": A}]).ids
        rendered_b = TOK.render_chat([{"role": "user", "content": B}]).ids
        at = next(i for i, (a, b) in enumerate(zip(rendered_a, rendered_b)) if a != b)
        assert (div["at"], div["new_id"], div["cached_id"]) == (at, TOK.encode("X")[0], TOK.encode("u")[0])
        assert (div["excerpt"]["new_token"], div["excerpt"]["cached_token"]) == ("X", "u")
        assert div["excerpt"]["before"].endswith("fox j")
        await wait_idle(server)


@pytest.mark.parametrize("body", BODIES, ids=IDS)
async def test_the_logits_switch_returns_the_socket_s_ids_and_digests(tmp_path, body):
    messages = [{"role": "user", "content": A}]
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            solo = await client.generate(messages=messages, max_tokens=4, logits=True, namespace="socket").collect()
        async with httpx.AsyncClient() as http:
            plain = (await post(http, server, body(A), "plain")).json()
            asked = (await post(http, server, body(A, prefixd={"logits": True}), "asked")).json()
        assert "ids" not in plain["usage"]["prefixd"] and "logits_sha256" not in plain["usage"]["prefixd"]
        ext = asked["usage"]["prefixd"]
        assert (ext["ids"], ext["logits_sha256"]) == (list(solo.ids), list(solo.logits_sha256))
        assert len(ext["ids"]) == 4
        await wait_idle(server)


@pytest.mark.parametrize("body", BODIES, ids=IDS)
async def test_the_draft_switch_reaches_the_engine(tmp_path, body):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        seen = []
        submit = server.gate.link.submit

        async def spy(request, **kw):
            seen.append(request)
            return await submit(request, **kw)

        server.gate.link.submit = spy
        async with httpx.AsyncClient() as http:
            for draft in ("off", "auto"):
                (await post(http, server, body(A, prefixd={"draft": draft}), draft)).raise_for_status()
        assert [r.draft for r in seen] == [False, True]
        await wait_idle(server)


@pytest.mark.parametrize("field, needle", [
    ("yes", "prefixd: must be an object"),
    ({"logit": True}, "prefixd.logit: unknown (known: logits, draft)"),
    ({"logits": "yes"}, "prefixd.logits: must be true or false"),
    ({"draft": "never"}, "prefixd.draft: must be one of auto, off"),
])
@pytest.mark.parametrize("body", BODIES, ids=IDS)
async def test_a_bad_prefixd_field_is_a_400_in_the_api_s_shape(tmp_path, body, field, needle):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        async with httpx.AsyncClient() as http:
            answer = await post(http, server, body(A, prefixd=field), "bad")
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert needle in error["message"]
        assert error["type"] == "invalid_request_error"
        await wait_idle(server)
