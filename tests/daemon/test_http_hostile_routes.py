"""Hostile callers on the routes a router probes (POST /tokenize, GET /kv_event_sources) and
on /v1/messages/count_tokens, beside an honest socket client: every bad body gets its 4xx
and message, an abandoned request leaves nothing behind, and the honest client's ids,
logits digests and tokens equal those it gets alone; over the letters device."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Awaitable, Callable

import anyio
import httpx
import pytest

from prefixd.front.gate import HEAVY_CHARS
from prefixd.front.http.app import MAX_BODY_BYTES
from prefixd.ipc.client import AsyncClient
from tests.daemon.fakes import ByteTokenizer
from tests.daemon.harness import running_server, wait_idle
from tests.daemon.test_http_bodies import DEEP, OVER, _chunks

TOK = ByteTokenizer()
HI = [{"role": "user", "content": "hi"}]
MALFORMED = b"{not json"
HUGE = "x" * (HEAVY_CHARS * 8)  # a heavy render, well inside the body limit
MIN_ROUNDS = 2  # each hostile caller's rounds before it may stop (it goes on until the honest one is done)


def _malformed_message() -> str:
    """The 400's message for MALFORMED: the json module's own words after the front's."""
    try:
        json.loads(MALFORMED)
    except ValueError as e:
        return f"body is not valid JSON: {e}"
    raise AssertionError("MALFORMED parses")


MALFORMED_MESSAGE = _malformed_message()
DEEP_MESSAGE = "body nests arrays and objects deeper than 64"
OVER_SIZED_MESSAGE = f"body of {len(OVER)} bytes is over the {MAX_BODY_BYTES}-byte limit"
OVER_CHUNKED_MESSAGE = f"body is over the {MAX_BODY_BYTES}-byte limit"
UNSUPPORTED_MESSAGE = ("continue_final_message and add_generation_prompt: false are not supported; "
                       "prefixd renders a chat prompt for a new reply")


def openai_error(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["message"]


def anthropic_error(r: httpx.Response) -> tuple[int, str]:
    assert r.json()["type"] == "error", r.text
    return r.status_code, r.json()["error"]["message"]


async def abandon_mid_body(server, path: str) -> None:
    """Headers promising 1000 bytes, 14 sent, then the connection closed."""
    head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            "content-length: 1000\r\n\r\n").encode()
    async with await anyio.connect_tcp("127.0.0.1", server.http.port) as raw:
        await raw.send(head + b'{"prompt": "ab')


async def abandon_unread(http: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> None:
    """The answer's head read, its body left unread and the connection closed."""
    async with http.stream(method, url, **kwargs) as r:
        assert r.status_code == 200


async def tokenize_round(http: httpx.AsyncClient, server, n: int, alone: dict) -> None:
    url = f"http://127.0.0.1:{server.http.port}/tokenize"
    refusals = [
        ((400, MALFORMED_MESSAGE), await http.post(url, content=MALFORMED)),
        ((400, "body must be a JSON object"), await http.post(url, json=[1, 2])),
        ((400, "prompt: must be one non-empty string"), await http.post(url, json={"prompt": 5})),
        ((400, "prompt: must be one non-empty string"), await http.post(url, json={"prompt": ["a", 1]})),
        ((400, "messages: must be a non-empty array"), await http.post(url, json={"messages": "no"})),
        ((400, "messages[0]: must be a map with a role"), await http.post(url, json={"messages": [{"role": 3}]})),
        ((400, UNSUPPORTED_MESSAGE), await http.post(url, json={"messages": HI, "continue_final_message": True})),
        ((404, "model 7 is not served here; this daemon serves 'letters'"),
         await http.post(url, json={"model": 7, "prompt": "a"})),
        ((400, DEEP_MESSAGE), await http.post(url, content=DEEP)),
        ((413, OVER_SIZED_MESSAGE), await http.post(url, content=OVER)),
        ((413, OVER_CHUNKED_MESSAGE), await http.post(url, content=_chunks(OVER))),
    ]
    for expected, r in refusals:
        assert openai_error(r) == expected, r.text
    huge = await http.post(url, json={"prompt": HUGE})
    assert huge.status_code == 200 and huge.json()["tokens"] == TOK.encode(HUGE)  # vLLM's: no length check
    for i in range(10):
        prompt = f"hostile {n} {i}"
        r = await http.post(url, json={"model": "letters", "prompt": prompt})
        assert r.json() == {"count": len(prompt), "max_model_len": server.device.info.max_context,
                            "tokens": TOK.encode(prompt)}
        assert (await http.post(url, json={"messages": HI})).json() == alone["tokenize"]
    await abandon_mid_body(server, "/tokenize")
    await abandon_unread(http, "POST", url, json={"prompt": HUGE})


async def kv_sources_round(http: httpx.AsyncClient, server, n: int, alone: dict) -> None:
    url = f"http://127.0.0.1:{server.http.port}/kv_event_sources"
    for i in range(10):
        assert (await http.get(url)).json() == alone["kv_event_sources"]
        assert (await http.get(url, params={"x": "a" * 4000, "n": str(i)})).json() == alone["kv_event_sources"]
    junk = await http.request("GET", url, content=MALFORMED)
    assert (junk.status_code, junk.json()) == (200, alone["kv_event_sources"])  # a GET's body is never read
    refused = await http.post(url, json={"prompt": "x"})
    assert (refused.status_code, refused.text) == (405, "Method Not Allowed")
    await abandon_unread(http, "GET", url)


async def count_tokens_round(http: httpx.AsyncClient, server, n: int, alone: dict) -> None:
    url = f"http://127.0.0.1:{server.http.port}/v1/messages/count_tokens"
    refusals = [
        ((400, MALFORMED_MESSAGE), await http.post(url, content=MALFORMED)),
        ((400, "messages: must be a non-empty array"), await http.post(url, json={"messages": "no"})),
        ((400, "messages[0].content: must be a string or an array of content blocks"),
         await http.post(url, json={"model": "letters", "messages": [{"role": "user", "content": 5}]})),
        ((400, DEEP_MESSAGE), await http.post(url, content=DEEP)),
        ((413, OVER_SIZED_MESSAGE), await http.post(url, content=OVER)),
    ]
    for expected, r in refusals:
        assert anthropic_error(r) == expected, r.text
    huge = await http.post(url, json={"model": "letters", "messages": [{"role": "user", "content": HUGE}]})
    assert huge.json() == {"input_tokens": alone["count_tokens"]["input_tokens"] - len("hi") + len(HUGE)}
    for _ in range(5):
        assert (await http.post(url, json={"model": "letters", "messages": HI})).json() == alone["count_tokens"]
    await abandon_mid_body(server, "/v1/messages/count_tokens")


async def honest(server) -> list[tuple]:
    """Six generates (ids and logits digest, no cache) and six tokenizes over the socket."""
    async with await AsyncClient.connect(server.socket_path) as client:
        out = []
        for i in range(6):
            prompt = f"honest {i} " * 3
            result = await client.generate(prompt=prompt, max_tokens=8, logits=True, cache=False).collect()
            out.append((result.ids, result.logits_sha256, (await client.tokenize(text=prompt)).ids))
        return out


async def probes(http: httpx.AsyncClient, server) -> dict:
    """The honest HTTP answers of the three routes, to hold the hostile rounds' to."""
    root = f"http://127.0.0.1:{server.http.port}"
    sources = await http.get(f"{root}/kv_event_sources")
    tokenize = await http.post(f"{root}/tokenize", json={"messages": HI})
    counted = await http.post(f"{root}/v1/messages/count_tokens", json={"model": "letters", "messages": HI})
    assert [r.status_code for r in (sources, tokenize, counted)] == [200] * 3
    return {"kv_event_sources": sources.json(), "tokenize": tokenize.json(), "count_tokens": counted.json()}


Round = Callable[[httpx.AsyncClient, Any, int, dict], Awaitable[None]]


async def beside_hostiles(server, http: httpx.AsyncClient, alone: dict, rounds: list[Round]) -> tuple[list, list[int]]:
    """The honest run, started once every hostile caller has ended a round; each caller goes
    on until the honest run is done (and for MIN_ROUNDS at least), so each overlaps it whole."""
    num_rounds = [0] * len(rounds)
    first_rounds = [anyio.Event() for _ in rounds]
    honest_done = anyio.Event()
    beside: list = []

    async def hostile(k: int) -> None:
        while num_rounds[k] < MIN_ROUNDS or not honest_done.is_set():
            await rounds[k](http, server, num_rounds[k], alone)
            num_rounds[k] += 1
            first_rounds[k].set()

    async with anyio.create_task_group() as tg:
        for k in range(len(rounds)):
            tg.start_soon(hostile, k)
        for started in first_rounds:
            await started.wait()
        beside.append(await honest(server))
        honest_done.set()
    return beside, num_rounds


async def test_hostile_tokenize_kv_sources_and_count_tokens_callers_change_and_leak_nothing(tmp_path):
    pytest.importorskip("zmq")  # /kv_event_sources answers (and asks the engine) only with --kv-events
    short = Path(tempfile.mkdtemp(prefix="kvh-", dir="/tmp"))  # ipc:// paths have ~107 bytes
    try:
        async with running_server(tmp_path, http_addr="127.0.0.1:0", kv_events=f"ipc://{short}/kv.sock") as server:
            alone = await honest(server)
            async with httpx.AsyncClient(timeout=60) as http:
                answers = await probes(http, server)
                assert answers["kv_event_sources"]["0"]["endpoint"] == f"ipc://{short}/kv.sock"
                beside, num_rounds = await beside_hostiles(
                    server, http, answers, [tokenize_round, kv_sources_round, count_tokens_round])
                assert await probes(http, server) == answers  # the daemon serves on, the same
            assert beside == [alone]
            assert min(num_rounds) >= MIN_ROUNDS
            status = await wait_idle(server)
            assert status["lanes_busy"] == 0
            assert server.link.num_open_streams == 0 and server.http.front.num_streams == 0
            assert server.gate.seats.num_free == server.gate.seats.num_seats
            assert (server.gate.heavy_running, server.gate.heavy_waiting) == (0, 0)
    finally:
        shutil.rmtree(short, ignore_errors=True)


BODY_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
               "/v1/responses", "/tokenize"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_a_body_cut_short_is_refused_quietly_on_every_body_route(tmp_path, monkeypatch):
    """A client that hangs up part-way through its body is one refusal like any other: no
    traceback in the server's log (one per cheap connection would let anyone fill it), and
    the next caller is served."""
    from prefixd.front.http.app import HttpFront

    ended: list[str] = []  # requests whose handling has ended, by path
    make_app = HttpFront.app

    def counting_app(front):
        app = make_app(front)

        async def wrapped(scope, receive, send):
            try:
                await app(scope, receive, send)
            finally:
                ended.append(scope.get("path", ""))
        return wrapped

    monkeypatch.setattr(HttpFront, "app", counting_app)
    records = _Records()
    log = logging.getLogger("uvicorn.error")  # where the ASGI server logs an application's exception
    try:
        async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
            log.addHandler(records)  # once the server has set up its logging (which drops handlers)
            for path in BODY_ROUTES:
                await abandon_mid_body(server, path)
                with anyio.fail_after(30):
                    while path not in ended:
                        await anyio.sleep(0.01)
            assert [r.getMessage() for r in records.records] == []
            async with httpx.AsyncClient(timeout=60) as http:
                r = await http.post(f"http://127.0.0.1:{server.http.port}/v1/completions",
                                    json={"prompt": "ab", "max_tokens": 2})
                assert r.status_code == 200
            await wait_idle(server)
    finally:
        log.removeHandler(records)
