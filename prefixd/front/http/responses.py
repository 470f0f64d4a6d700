"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A create is spelled as the chat request it means (responses_map.py) and takes HttpFront's
own path (`_start`: pacing, heavy-work slots, a fair seat, the in-flight cap; `_events`: the
OutputProcessor), so it reaches the engine as the same StreamRequest. Answered responses are
kept (responses_store.py, unless `store: false`) with their whole conversation, which the
next turn's `previous_response_id` continues.

    streamed: response.created, response.in_progress,
              [output_item.added, reasoning_text.delta..., reasoning_text.done,
               output_item.done]                             the reasoning, when the reply thinks
              [output_item.added, content_part.added, output_text.delta..., output_text.done,
               content_part.done, output_item.done]          the message, when there is text
              [output_item.added, function_call_arguments.delta, .done, output_item.done]...
              response.completed | response.incomplete | response.failed
"""

from __future__ import annotations

import json
import secrets
import time
from contextlib import aclosing
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prefixd.front.http.app import NAMESPACE_HEADER, HttpFront, _read_json, openai_namespace
from prefixd.front.http.extension import UsageExtension
from prefixd.front.http.openai_map import HttpError
from prefixd.front.http.responses_map import MappedResponse, chat_param, map_response, normalize_items
from prefixd.front.http.responses_store import ResponseStore
from prefixd.front.output import reasoning_of
from prefixd.ipc.events import DoneEvent, TokenEvent

_FINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


class ResponseAnswer:
    """What one response has produced so far, spelled as a Responses object."""

    def __init__(self, response_id: str, model: str, created_at: int, mapped: MappedResponse,
                 extension: UsageExtension) -> None:
        self.id = response_id
        self.extension = extension  # usage.prefixd
        self.model = model
        self.created_at = created_at
        self.mapped = mapped
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.done: DoneEvent | None = None
        self.error: dict[str, str] | None = None  # set when the generate failed
        self.message_id = "msg_" + response_id.removeprefix("resp_")
        self.reasoning_id = "rs_" + response_id.removeprefix("resp_")

    def add(self, event: TokenEvent | DoneEvent) -> None:
        if isinstance(event, TokenEvent):
            self.text.append(event.text)
            self.reasoning.append(reasoning_of(event))
            self.extension.add(event)
        else:
            self.done = event
            if event.finish_reason == "error":
                self.error = {"code": "server_error", "message": event.note or "the generate failed"}

    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        if self.done is None:
            return "in_progress"
        return "incomplete" if self.done.finish_reason == "length" else "completed"

    @property
    def has_reasoning(self) -> bool:
        return any(self.reasoning)

    @property
    def message_index(self) -> int:
        """The message item's output_index: after the reasoning item, when there is one."""
        return int(self.has_reasoning)

    def reasoning_item(self, *, done: bool) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": "".join(self.reasoning)}] if done else []
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content,
                "status": "completed" if done else "in_progress"}

    def message_item(self, *, done: bool) -> dict[str, Any]:
        status = "incomplete" if self.status == "incomplete" else "completed"
        content = [self.text_part()] if done else []
        return {"type": "message", "id": self.message_id, "status": status if done else "in_progress",
                "role": "assistant", "content": content}

    def text_part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": "".join(self.text), "annotations": []}

    def call_item(self, k: int, call: dict[str, Any], *, done: bool) -> dict[str, Any]:
        function = call["function"]
        return {"type": "function_call", "id": f"fc_{self.message_id[4:]}_{k}", "call_id": call["id"],
                "name": function["name"], "arguments": function["arguments"] if done else "",
                "status": "completed" if done else "in_progress"}

    @property
    def has_message(self) -> bool:
        """Whether the output holds a message item: when there is text, or nothing else."""
        return any(self.text) or not (self.done is not None and self.done.tool_calls)

    def output(self) -> list[dict[str, Any]]:
        if self.done is None:
            return []
        items = [self.reasoning_item(done=True)] if self.has_reasoning else []
        items += [self.message_item(done=True)] if self.has_message else []
        return items + [self.call_item(k, c, done=True) for k, c in enumerate(self.done.tool_calls or ())]

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "model": self.model, "output": self.output(), "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "usage": self._usage(), **self.mapped.echo,
        }
        if self.mapped.ignored_tools:
            out["prefixd"] = {"ignored_tools": list(self.mapped.ignored_tools)}
        return out

    def _usage(self) -> dict[str, Any] | None:
        if self.done is None:
            return None
        u = self.done.usage
        out: dict[str, Any] = {"input_tokens": u.prompt_tokens,
                               "input_tokens_details": {"cached_tokens": u.cached_tokens},
                               "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                               "total_tokens": u.prompt_tokens + u.completion_tokens}
        out["prefixd"] = self.extension.usage(self.done)
        return out


class ResponsesApi:
    """The Responses routes over an HttpFront (its auth, gate path and output processor)."""

    def __init__(self, front: HttpFront, store: ResponseStore | None = None) -> None:
        self.front = front
        self.store = store or ResponseStore()

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])]

    async def create(self, request: Request) -> Response:
        return await self.front._guard(request, lambda: self._create(request))

    async def retrieve(self, request: Request) -> Response:
        return await self.front._guard(request, lambda: self._retrieve(request))

    async def delete(self, request: Request) -> Response:
        return await self.front._guard(request, lambda: self._delete(request))

    # -- create -----------------------------------------------------------------------------

    async def _create(self, request: Request) -> Response:
        body = await _read_json(request)
        self.front.check_model(body.get("model"))
        namespace = openai_namespace(request, body)
        mapped = map_response(body, namespace, self._history(namespace, body.get("previous_response_id")),
                              self.front.normalisers)
        client = self.front.client(request, namespace)
        try:
            stream_id, built, receive = await self.front._start(client, mapped.request)
        except HttpError as e:
            raise chat_param(e) from None
        answer = ResponseAnswer(f"resp_{secrets.token_hex(16)}", self.front.model, int(time.time()), mapped,
                                self.front.usage_extension(mapped.request))
        events = self.front._events(stream_id, built, receive, client)
        if mapped.request.stream:
            return StreamingResponse(self._sse(answer, events, namespace), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        async with aclosing(events):
            async for event in events:
                answer.add(event)
        if answer.error is not None:
            raise HttpError(500, answer.error["message"], kind="server_error")
        self._keep(namespace, answer)
        return JSONResponse(answer.body())

    def _history(self, namespace: str, previous: Any) -> tuple[dict[str, Any], ...]:
        """The conversation `previous_response_id` names; 404 when it is not stored here."""
        if previous is None:
            return ()
        if not isinstance(previous, str):
            raise HttpError(400, "previous_response_id: must be a string", param="previous_response_id")
        stored = self.store.get(namespace, previous)
        if stored is None:
            raise HttpError(404, f"previous_response_id: response {previous!r} is not stored here (unknown, "
                            "evicted, deleted, created with store: false, or in another namespace); send the "
                            "whole conversation as input instead", param="previous_response_id",
                            code="previous_response_not_found")
        return stored.items

    def _keep(self, namespace: str, answer: ResponseAnswer) -> None:
        if answer.mapped.echo["store"] and answer.status != "failed":
            body = answer.body()
            self.store.put(namespace, body, answer.mapped.items + tuple(normalize_items(body["output"])))

    async def _sse(self, answer: ResponseAnswer, events: AsyncIterator[TokenEvent | DoneEvent],
                   namespace: str) -> AsyncIterator[str]:
        event = _EventWriter()
        yield event("response.created", response=answer.body())
        yield event("response.in_progress", response=answer.body())
        items = _OpenItems(answer, event)
        try:
            async with aclosing(events):
                async for got in events:
                    if isinstance(got, TokenEvent):
                        reasoning = reasoning_of(got)
                        answer.add(got)
                        for text in items.deltas(reasoning, got.text):
                            yield text
                    else:
                        answer.add(got)
        except HttpError as e:
            answer.error = {"code": "server_error", "message": e.message}
            yield event("response.failed", response=answer.body())
            return
        for text in self._closing(answer, event, items):
            yield text
        self._keep(namespace, answer)
        yield event(_FINAL_EVENT[answer.status], response=answer.body())

    @staticmethod
    def _closing(answer: ResponseAnswer, event: _EventWriter, items: _OpenItems) -> list[str]:
        """The events that close the reasoning and message items (opening the message when it
        had no text) and give each function call."""
        out = items.close_reasoning()
        index = answer.message_index
        at = {"item_id": answer.message_id, "output_index": index}
        if answer.has_message:
            if not items.message_open:
                out.append(items.open_message())
            part = answer.text_part()
            out.append(event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[]))
            out.append(event("response.content_part.done", **at, content_index=0, part=part))
            out.append(event("response.output_item.done", output_index=index, item=answer.message_item(done=True)))
        assert answer.done is not None, "_events ends with the done event"
        first = index + int(answer.has_message)
        for k, call in enumerate(answer.done.tool_calls or ()):
            item = answer.call_item(k, call, done=True)
            where = {"item_id": item["id"], "output_index": first + k}
            out.append(event("response.output_item.added", output_index=first + k,
                             item=answer.call_item(k, call, done=False)))
            out.append(event("response.function_call_arguments.delta", **where, delta=item["arguments"]))
            out.append(event("response.function_call_arguments.done", **where, name=item["name"],
                             arguments=item["arguments"]))
            out.append(event("response.output_item.done", output_index=first + k, item=item))
        return out

    # -- stored responses -------------------------------------------------------------------

    async def _retrieve(self, request: Request) -> Response:
        response_id, namespace = self._stored_key(request)
        stored = self.store.get(namespace, response_id)
        if stored is None:
            raise _not_stored(response_id)
        return JSONResponse(stored.body)

    async def _delete(self, request: Request) -> Response:
        response_id, namespace = self._stored_key(request)
        if not self.store.delete(namespace, response_id):
            raise _not_stored(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @staticmethod
    def _stored_key(request: Request) -> tuple[str, str]:
        return request.path_params["response_id"], request.headers.get(NAMESPACE_HEADER) or ""


def _not_stored(response_id: str) -> HttpError:
    return HttpError(404, f"response {response_id!r} is not stored in this namespace", param="response_id",
                     code="not_found")


class _EventWriter:
    """Server-sent events with `event:` lines, numbered in order (`sequence_number`)."""

    def __init__(self) -> None:
        self.num_sent = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.num_sent, **fields}
        self.num_sent += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


class _OpenItems:
    """The output items a stream has opened: the reasoning item (index 0), then the message."""

    def __init__(self, answer: ResponseAnswer, event: _EventWriter) -> None:
        self.answer = answer
        self.event = event
        self.reasoning_open = False
        self.reasoning_done = False
        self.message_open = False

    def deltas(self, reasoning: str, text: str) -> list[str]:
        """The events for one token event's reasoning and text (already added to the answer)."""
        out = []
        at = {"item_id": self.answer.reasoning_id, "output_index": 0, "content_index": 0}
        if reasoning:
            if not self.reasoning_open:
                self.reasoning_open = True
                out.append(self.event("response.output_item.added", output_index=0,
                                      item=self.answer.reasoning_item(done=False)))
            out.append(self.event("response.reasoning_text.delta", **at, delta=reasoning))
        if text:
            out.extend(self.close_reasoning())
            if not self.message_open:
                out.append(self.open_message())
            index = self.answer.message_index
            out.append(self.event("response.output_text.delta", item_id=self.answer.message_id, output_index=index,
                                  content_index=0, delta=text, logprobs=[]))
        return out

    def close_reasoning(self) -> list[str]:
        if not self.reasoning_open or self.reasoning_done:
            return []
        self.reasoning_done = True
        item = self.answer.reasoning_item(done=True)
        at = {"item_id": self.answer.reasoning_id, "output_index": 0, "content_index": 0}
        return [self.event("response.reasoning_text.done", **at, text=item["content"][0]["text"]),
                self.event("response.output_item.done", output_index=0, item=item)]

    def open_message(self) -> str:
        """output_item.added and content_part.added of the message (two events, one string)."""
        self.message_open = True
        index = self.answer.message_index
        return (self.event("response.output_item.added", output_index=index, item=self.answer.message_item(done=False))
                + self.event("response.content_part.added", item_id=self.answer.message_id, output_index=index,
                             content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
