"""The OpenAI-compatible routes (Starlette): /v1/chat/completions, /v1/completions,
/v1/models, /health. Each generate goes the socket front's way: RequestBuilder -> the gate
(pacing, heavy-work slots, a fair seat, the in-flight cap) -> the engine -> OutputProcessor,
then answers.py spells the events the OpenAI way (anthropic.py: Anthropic's /v1/messages,
over the same calls).

An HTTP *client*, for the gate, is its namespace (the `x-prefixd-namespace` header or the
body's `user`) where it names one, else its address: callers on one address that name no
namespace share one client's fair share."""

from __future__ import annotations

import hmac
import json
import time
from typing import Any, AsyncIterator, Callable, TypeVar

import anyio

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prefixd.front.bounds import OFF_LOOP_BYTES
from prefixd.front.engine_link import EngineLost
from prefixd.front.gate import GateClient
from prefixd.front.heavy import BuildJob
from prefixd.front.http.answers import SSE_DONE, Answer
from prefixd.front.http.extension import UsageExtension
from prefixd.front.http.openai_map import HttpError, MappedRequest, map_chat, map_completion
from prefixd.front.output import reasoning_of
from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.events import DoneEvent, TokenEvent
from prefixd.scheduler.streams import TokenEvent as EngineTokens
from prefixd.text.hygiene import DEFAULT_NORMALISERS

MAX_BODY_BYTES = 8 << 20
# A body past OFF_LOOP_BYTES (front/bounds.py, the socket front's threshold too) is parsed (and
# mapped, where the route can) on a worker thread, not on the event loop: an agent's 300 KB
# chat of 8,000 messages costs ~5 ms to parse and check and ~5 ms more to map, and on the loop
# every other client's tokens waited that long (bench/soak.py --http, huge chats alone: honest
# p99 TTFT 1.43x the baseline on the loop, 1.07x off it).
# The thread still holds the interpreter lock while json.loads runs (~8 ms a MiB), but gives
# it back every switch interval for the rest.
MAX_JSON_DEPTH = 64  # arrays and objects inside each other in a body; the top one is 1
# A body refused for its size is still read, and dropped, up to this many bytes in all, so that
# a client still sending it reads the 413 (a close with bytes unread resets the connection).
MAX_DROPPED_BODY_BYTES = 64 << 20
NAMESPACE_HEADER = "x-prefixd-namespace"
_STATUS = {ErrorCode.TOO_MANY_STREAMS: 429, ErrorCode.SHUTTING_DOWN: 503, ErrorCode.BUSY: 503,
           ErrorCode.INTERNAL: 500}


class HttpFront:
    """The routes over the daemon's shared services (see connection.Services). `normalisers`:
    the prompt hygiene every route applies (prefixd/text/hygiene.py, `--prompt-hygiene`);
    `kv_events`: where the engine publishes KV events, for the router probes (worker.py)."""

    def __init__(self, services: Any, *, token: str | None = None,
                 normalisers: tuple[str, ...] = DEFAULT_NORMALISERS, kv_events: Any = None) -> None:
        self.services = services
        self.token = token
        self.normalisers = normalisers
        self.kv_events = kv_events  # worker.KvEventSource with --kv-events, else None
        self.gate = services.gate
        self.streams: set[int] = set()  # engine stream ids in flight
        self.model = str(services.hello_reply()["model"].get("name", "prefixd"))

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    def cancel_streams(self) -> None:
        for stream_id in list(self.streams):
            self.gate.cancel(stream_id)

    def app(self) -> Starlette:
        from prefixd.front.http.anthropic import MessagesApi  # it builds on this module
        from prefixd.front.http.responses import ResponsesApi  # it builds on this module
        from prefixd.front.http.worker import WorkerApi  # the routes a router probes

        self.messages_api = MessagesApi(self)
        self.responses_api = ResponsesApi(self)
        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            *self.responses_api.routes(),
            Route("/v1/messages", self.messages_api.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.messages_api.count_tokens, methods=["POST"]),
            *WorkerApi(self).routes(),
        ])

    # -- routes -----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """200 {"status": "ok"} while the engine serves; 503 while it restarts or the daemon stops."""
        if self.services.shutting_down():
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if not self.gate.link.serving:
            return JSONResponse({"status": self.gate.link.state}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return await self._guard(request, self._models)

    async def chat(self, request: Request) -> Response:
        return await self._guard(request, lambda: self._generate(request, chat=True))

    async def completions(self, request: Request) -> Response:
        return await self._guard(request, lambda: self._generate(request, chat=False))

    async def _guard(self, request: Request, handler: Any) -> Response:
        try:
            self._authorize(request)
            return await handler()
        except HttpError as e:
            await self.charge_refusal(request, e)
            return JSONResponse(e.body(), status_code=e.status)

    async def charge_refusal(self, request: Request, error: HttpError) -> None:
        """A 4xx costs its caller (the namespace header, else its address: the body may be
        what was wrong) a refused frame's credits, and waits while the caller is in debt."""
        if 400 <= error.status < 500:
            await self.gate.refused(self.peer(request, request.headers.get(NAMESPACE_HEADER, "")))

    async def _models(self) -> Response:
        entry = {"id": self.model, "object": "model", "created": 0, "owned_by": "prefixd"}
        return JSONResponse({"object": "list", "data": [entry]})

    def _authorize(self, request: Request) -> None:
        """The token, as `Authorization: Bearer TOKEN` or (Anthropic's clients) `x-api-key: TOKEN`."""
        if self.token is None:
            return
        bearer = request.headers.get("authorization", "").encode()
        key = request.headers.get("x-api-key", "").encode()
        if not (hmac.compare_digest(bearer, f"Bearer {self.token}".encode())
                or hmac.compare_digest(key, self.token.encode())):
            raise HttpError(401, "missing or wrong bearer token", kind="authentication_error", code="invalid_api_key")

    def check_model(self, model: Any) -> None:
        """404 model_not_found unless `model` names the loaded model (or default, prefixd, none)."""
        if model not in (self.model, "default", "prefixd", None):
            raise HttpError(404, f"model {model!r} is not served here; this daemon serves {self.model!r}",
                            param="model", code="model_not_found")

    @staticmethod
    def peer(request: Request, namespace: str) -> tuple[str, str]:
        """Who a request is from: its namespace where it names one, else its address."""
        return ("http", namespace) if namespace else ("http", request.client.host if request.client else "")

    def client(self, request: Request, namespace: str) -> GateClient:
        """The gate's client of one request (`peer`)."""
        return self.gate.join(self.peer(request, namespace), connection=False)

    # -- generate ---------------------------------------------------------------------------

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        def parse(body: dict[str, Any]) -> tuple[str, MappedRequest]:
            self.check_model(body.get("model"))
            namespace = openai_namespace(request, body)
            return namespace, map_chat(body, namespace, self.normalisers) if chat else map_completion(body, namespace)

        namespace, mapped = await read_mapped(request, parse)
        client = self.client(request, namespace)
        stream_id, built, receive = await self._start(client, mapped)
        tokenizer = self.services.builder.tokenizer
        answer = Answer(f"{'chatcmpl' if chat else 'cmpl'}-{stream_id}", self.model, int(time.time()), chat,
                        tokenizer.token_bytes, self.usage_extension(mapped))
        events = self._events(stream_id, built, receive, client)
        if mapped.stream:
            return StreamingResponse(_sse(answer, events, mapped), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        async for event in events:
            if isinstance(event, TokenEvent):
                answer.add(event)
            else:
                answer.done = event
        assert answer.done is not None, "_events ends with the done event"
        if answer.done.finish_reason == "error":
            raise HttpError(500, answer.done.note or "the generate failed", kind="server_error")
        return JSONResponse(answer.body(mapped.logprobs))

    async def _start(self, client: GateClient, mapped: MappedRequest) -> tuple[int, Any, Any]:
        """Through the gate: paced, built (heavy work in turn), seated fairly, submitted. The
        seat, the in-flight count and the pacing visit go back when the engine ends the
        stream (whether or not anyone still reads it), or at once if it never starts."""
        stream_id = self.services.next_stream_id()
        msg = {**mapped.generate, "id": stream_id}
        owner = (client.peer, stream_id)
        held = _Held(self.gate, client)
        try:
            if self.services.shutting_down():
                raise HttpError(503, "the daemon is shutting down and takes no new work", kind="server_error")
            await self.gate.paced(client)
            self.gate.reserve(client.peer)
            held.reserved = True
            built = await self.gate.build(client, msg, self.build_job(mapped, msg, stream_id), probe=lambda: False)
            if await self.gate.seat(client, owner):
                held.owner = owner
            receive = await self.gate.submit(built.request, client, on_end=held.release)
        except ProtocolError as e:
            held.release()
            raise _http_error(e) from None
        except BaseException:
            held.release()
            raise
        return stream_id, built, receive

    async def build_only(self, request: Request, mapped: MappedRequest, namespace: str) -> Any:
        """The request built as its generate would be (the prompt rendered and tokenized),
        through the gate's pacing and heavy-work slots, and never submitted: its BuiltGenerate."""
        client = self.client(request, namespace)
        # tool_choice only picks a grammar for the reply; the rendering is the same without it
        msg = {k: v for k, v in mapped.generate.items() if k != "tool_choice"} | {"id": 0}
        try:
            await self.gate.paced(client)
            return await self.gate.build(client, msg, self.build_job(mapped, msg, 0), probe=lambda: False)
        except ProtocolError as e:
            raise _http_error(e) from None
        finally:
            self.gate.leave(client)

    def usage_extension(self, mapped: MappedRequest) -> UsageExtension:
        """usage.prefixd of one request (extension.py), on every API."""
        return UsageExtension.of(mapped.generate, mapped.normalised, self.services.builder.tokenizer)

    @staticmethod
    def build_job(mapped: MappedRequest, msg: dict[str, Any], stream_id: int) -> BuildJob:
        """RequestBuilder.generate of `msg` (protocol version 2) with the request's ChatOptions
        (thinking, reasoning)."""
        return BuildJob("generate", (msg, stream_id, 2), chat=mapped.chat)

    async def _events(self, stream_id: int, built: Any, receive: Any,
                      client: GateClient) -> AsyncIterator[TokenEvent | DoneEvent]:
        """The generate's events; leaving early (a client gone) cancels it, and counts as
        abandoning it (abandon.py), as a socket client's hang-up does."""
        out = self.services.builder.output(built)
        self.streams.add(stream_id)
        finished = False
        lost = "the engine stopped before this generate finished"
        try:
            async with receive:
                async for event in receive:
                    if isinstance(event, EngineLost):
                        lost = event.note
                        continue
                    if not isinstance(event, EngineTokens):
                        finished = True
                        for final in out.done(event):
                            yield final
                        return
                    was_hit = out.stop_hit
                    token = out.tokens(event)
                    if token is not None:
                        yield token
                    if out.stop_hit and not was_hit:
                        keep = out.keep_generated
                        self.gate.cancel(stream_id, None if keep is None else len(built.request.tokens) + keep)
            raise HttpError(500, lost, kind="server_error", code="internal")
        finally:
            self.streams.discard(stream_id)
            if not finished:
                self.gate.cancel(stream_id)
                if not self.services.shutting_down():
                    self.gate.abandon(client)



class _Held:
    """What one HTTP generate holds at the gate; `release` gives it all back, once."""

    def __init__(self, gate: Any, client: GateClient) -> None:
        self.gate = gate
        self.client = client
        self.reserved = False
        self.owner: Any = None
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self.reserved:
            self.gate.release(self.client.peer)
        if self.owner is not None:
            self.gate.unseat(self.owner)
        self.gate.leave(self.client)


async def _sse(answer: Answer, events: AsyncIterator[TokenEvent | DoneEvent], mapped: MappedRequest) -> AsyncIterator[str]:
    """Chat (or completion) chunks as server-sent events, ending with [DONE]."""
    if answer.chat:
        yield answer.chunk({"role": "assistant", "content": ""})
    try:
        async for event in events:
            if isinstance(event, TokenEvent):
                answer.add(event)
                lps = [answer.logprob_entry(e) for e in event.logprobs or ()] if mapped.logprobs else None
                reasoning = reasoning_of(event)
                if reasoning:  # the same text by both names clients read it by
                    yield answer.chunk({"reasoning_content": reasoning, "reasoning": reasoning},
                                       logprobs=None if event.text else lps)
                if event.text or (lps and not reasoning):
                    yield answer.chunk({"content": event.text}, logprobs=lps)
                continue
            answer.done = event
            if answer.chat and event.tool_calls:
                yield answer.chunk({"tool_calls": answer.tool_call_deltas()})
            yield answer.chunk({}, finish=_finish(event))
            if mapped.include_usage:
                yield answer.chunk(usage=True)
    except HttpError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    yield SSE_DONE


def _finish(done: DoneEvent) -> str:
    from prefixd.front.http.answers import FINISH

    return FINISH[done.finish_reason]


def _http_error(e: ProtocolError) -> HttpError:
    status = _STATUS.get(e.code, 400)
    kind = "server_error" if status >= 500 else "invalid_request_error"
    field = e.message.split(":", 1)[0] if ":" in e.message else None
    return HttpError(status, e.message, kind=kind, param=field, code=e.code.value)


def openai_namespace(request: Request, body: dict[str, Any]) -> str:
    """An OpenAI-shaped request's namespace: the x-prefixd-namespace header, else the body's
    `user` where it is a string, else "" (the caller's address then names its client)."""
    user = body.get("user")
    return request.headers.get(NAMESPACE_HEADER) or (user if isinstance(user, str) else "")


T = TypeVar("T")  # what a route's parse makes of a body


async def _read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object (`read_mapped` with nothing to map)."""
    return await read_mapped(request, lambda body: body)


async def read_mapped(request: Request, parse: Callable[[dict[str, Any]], T]) -> T:
    """`parse` (a route's checks and mapping; no shared state) of the request body as a JSON
    object: on the event loop for a small body, on a worker thread past OFF_LOOP_BYTES.
    413 past MAX_BODY_BYTES, once the rest of the body is read and dropped (up to
    MAX_DROPPED_BODY_BYTES); 400 when it is not JSON, nests deeper than MAX_JSON_DEPTH or is
    not an object; 400 too when the client hangs up before the body is whole (the answer then
    goes nowhere: a refusal like any other, not a server error). Every route that takes a body
    reads it here."""
    try:
        raw = await _read_body(request)
    except ClientDisconnect:
        raise HttpError(400, "the client hung up before its body was whole") from None
    if len(raw) <= OFF_LOOP_BYTES:
        return parse(_json_object(raw))
    return await anyio.to_thread.run_sync(lambda: parse(_json_object(raw)))


async def _read_body(request: Request) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        if int(length) <= MAX_DROPPED_BODY_BYTES:
            await _drop_rest(request.stream(), 0)
        raise HttpError(413, f"body of {length} bytes is over the {MAX_BODY_BYTES}-byte limit")
    chunks, size = [], 0
    stream = request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            await _drop_rest(stream, size)
            raise HttpError(413, f"body is over the {MAX_BODY_BYTES}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


async def _drop_rest(chunks: AsyncIterator[bytes], size: int) -> None:
    """Read what is left of a refused body and drop it, until `size` (the bytes read so far)
    passes MAX_DROPPED_BODY_BYTES or the client hangs up."""
    try:
        async for chunk in chunks:
            size += len(chunk)
            if size > MAX_DROPPED_BODY_BYTES:
                return
    except ClientDisconnect:
        return


def _json_object(raw: bytes) -> dict[str, Any]:
    """`raw` parsed as a JSON object; HttpError 400 when it is not one."""
    too_deep = HttpError(400, f"body nests arrays and objects deeper than {MAX_JSON_DEPTH}")
    try:
        body = json.loads(raw)
    except RecursionError:  # deeper than the parser's own recursion, far past MAX_JSON_DEPTH
        raise too_deep from None
    except ValueError as e:
        raise HttpError(400, f"body is not valid JSON: {e}") from None
    if _nests_deeper(body, MAX_JSON_DEPTH):
        raise too_deep
    if not isinstance(body, dict):
        raise HttpError(400, "body must be a JSON object")
    return body


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest deeper than `limit` in `value`; level by level, no recursion."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        if not level:
            return False
    return True
