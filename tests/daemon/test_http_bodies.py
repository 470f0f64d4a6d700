"""Bodies the HTTP front refuses, on every route that takes one: JSON nested too deep is 400,
a body over 8 MiB is 413 with or without a content-length (never a reset), and the daemon
then serves an honest request; over the letters device."""

from __future__ import annotations

import json
from typing import AsyncIterator

import httpx
import pytest
from starlette.routing import Route

from prefixd.front.http.app import MAX_BODY_BYTES, MAX_JSON_DEPTH, _json_object
from prefixd.front.http.openai_map import HttpError
from tests.daemon.harness import running_server, wait_idle
from tests.daemon.test_http import base_url, reply_of

DEEP = b'{"model": "letters", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
OVER = b'{"model": "letters", "pad": "' + b" " * MAX_BODY_BYTES + b'"}'


def _nested(depth: int) -> bytes:
    """An object whose arrays inside it reach `depth` in all (the object is 1)."""
    return b'{"x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_the_nesting_bound_is_64_arrays_and_objects():
    assert MAX_JSON_DEPTH == 64
    assert _json_object(_nested(64)) == {"x": json.loads(b"[" * 63 + b"]" * 63)}
    for raw in (_nested(65), DEEP):
        with pytest.raises(HttpError) as refused:
            _json_object(raw)
        assert (refused.value.status, refused.value.body()["error"]["message"]) == (
            400, "body nests arrays and objects deeper than 64")


def _post_routes(server) -> list[str]:
    """Every POST route the front serves without a path parameter (routes added later too)."""
    routes = [r for r in server.http.front.app().routes if isinstance(r, Route)]
    return [r.path for r in routes if "POST" in (r.methods or ()) and "{" not in r.path]


async def _chunks(body: bytes, size: int = 64 << 10) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


async def _honest(http: httpx.AsyncClient, server, turn: int = 0) -> None:
    messages = [{"role": "user", "content": f"hi {turn}"}]  # a new prompt each time: the letters device's hits differ
    answer = await http.post(f"{base_url(server)}/chat/completions",
                             json={"model": "letters", "messages": messages, "max_tokens": 3})
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == reply_of(messages, 3)


async def test_json_nested_too_deep_is_a_400_on_every_route_and_the_daemon_serves_on(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        routes = _post_routes(server)
        assert {"/v1/chat/completions", "/v1/completions"} <= set(routes)
        root = f"http://127.0.0.1:{server.http.port}"
        async with httpx.AsyncClient(timeout=60) as http:
            for turn, path in enumerate(routes):
                deep = await http.post(root + path, content=DEEP, headers={"content-type": "application/json"})
                assert deep.status_code == 400, path
                assert deep.json()["error"]["message"] == "body nests arrays and objects deeper than 64", path
                await _honest(http, server, turn)
        await wait_idle(server)


# `connection: close` (urllib's default) closes the connection once the answer is sent: a body
# still unread then would reset it under the client before it reads the 413.
@pytest.mark.parametrize("connection", ["keep-alive", "close"])
async def test_a_body_over_8_mib_is_a_413_with_or_without_a_content_length_on_every_route(tmp_path, connection):
    headers = {"connection": connection}
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        root = f"http://127.0.0.1:{server.http.port}"
        async with httpx.AsyncClient(timeout=60) as http:
            for turn, path in enumerate(_post_routes(server)):
                sized = await http.post(root + path, content=OVER, headers=headers)
                assert sized.status_code == 413, path
                assert sized.json()["error"]["message"] == (
                    f"body of {len(OVER)} bytes is over the {MAX_BODY_BYTES}-byte limit"), path
                chunked = await http.post(root + path, content=_chunks(OVER), headers=headers)
                assert "content-length" not in chunked.request.headers
                assert chunked.status_code == 413, path
                assert chunked.json()["error"]["message"] == f"body is over the {MAX_BODY_BYTES}-byte limit", path
                await _honest(http, server, turn)
        await wait_idle(server)


async def test_a_body_far_past_the_limit_still_gets_its_413(tmp_path):
    """60 MiB in chunks, the connection to close after the answer: read and dropped to its
    end, then answered."""
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        async with httpx.AsyncClient(timeout=60) as http:
            answer = await http.post(f"{base_url(server)}/chat/completions", content=_chunks(b" " * (60 << 20)),
                                     headers={"connection": "close"})
            assert answer.status_code == 413
            await _honest(http, server)
        await wait_idle(server)


async def test_a_large_body_is_parsed_and_mapped_off_the_event_loop_and_a_small_one_on_it(tmp_path, monkeypatch):
    """Past OFF_LOOP_BYTES a chat body's parse and mapping run on a worker thread, so the
    event loop serves other clients meanwhile; a small body's stay on the loop. Both answer
    as before."""
    import threading

    from prefixd.front.http import app as app_module

    mapped_on = []
    real = app_module.map_chat
    monkeypatch.setattr(app_module, "map_chat",
                        lambda *a, **k: (mapped_on.append(threading.get_ident()), real(*a, **k))[1])
    loop_thread = threading.get_ident()  # the harness serves on the test's own event loop
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        async with httpx.AsyncClient(timeout=60) as http:
            pad = "x" * app_module.OFF_LOOP_BYTES  # a field the chat route ignores
            for turn, extra in enumerate(({}, {"metadata": {"pad": pad}})):
                # a new prompt each time: the letters device's hits differ
                messages = [{"role": "user", "content": f"hi {turn}"}]
                body = {"model": "letters", "messages": messages, "max_tokens": 3, **extra}
                answer = await http.post(f"{base_url(server)}/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["message"]["content"] == reply_of(messages, 3)
        await wait_idle(server)
    assert len(mapped_on) == 2
    assert mapped_on[0] == loop_thread and mapped_on[1] != loop_thread
