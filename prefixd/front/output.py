"""The one output path: engine events of a stream -> protocol events (ipc/events.py).

    engine TokenEvent ─▶ detokenize ─▶ stop strings ─▶ reasoning split ─▶ tool-call capture ─▶ TokenEvent
                                                      (content only)
    engine done  ─▶ held-back text, parsed tool calls, finish reason, usage ─▶ DoneEvent

Both fronts (the socket connection, the HTTP front) take their events from here and turn
them into wire maps with `to_wire()`. With `reasoning` on, token events are ReasonedTokens:
`text` is the reply's content, `reasoning` its think span's text (prefixd/text/reasoning.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from prefixd.front.stops import StopMatcher, StopSet
from prefixd.ipc.events import DoneEvent, TokenEvent
from prefixd.scheduler.streams import TokenEvent as EngineTokens
from prefixd.text.reasoning import ReasoningSplitter
from prefixd.text.tools import ToolCallSplitter


@dataclasses.dataclass(frozen=True, slots=True)
class ReasonedTokens(TokenEvent):
    """A TokenEvent of a reply split into reasoning and content: `text` is content only."""

    reasoning: str = ""


def reasoning_of(event: TokenEvent) -> str:
    """The reasoning text an event carries ("" for a plain TokenEvent)."""
    return event.reasoning if isinstance(event, ReasonedTokens) else ""


class OutputProcessor:
    """Turns one stream's engine events into TokenEvents and its DoneEvent.

    `stop_hit` turns True when a stop string matched: the caller then cancels the stream,
    keeping `keep_generated` tokens' rows, and later token events are dropped (their text is
    past the stop).
    """

    def __init__(self, request_id: int, decoder: Any, *, stop: StopSet | tuple[str, ...] = (),
                 stop_ids: frozenset[int] = frozenset(), parse_tools: bool = False,
                 reasoning: ReasoningSplitter | None = None,
                 token_bytes: Callable[[int], bytes] | None = None) -> None:
        self.request_id = request_id
        self._decoder = decoder
        self._stops = StopMatcher(stop)
        self._stop_ids = stop_ids
        self._tools = ToolCallSplitter() if parse_tools else None
        self._reasoning = reasoning
        self._token_bytes = token_bytes
        self._ids: list[int] = []
        self._kept_bytes = 0  # bytes of reply text before any stop string
        self.num_sent_ids = 0

    @property
    def stop_hit(self) -> bool:
        return self._stops.stopped

    def tokens(self, event: EngineTokens) -> TokenEvent | None:
        """The TokenEvent for one round's tokens (None once a stop string matched)."""
        if self._stops.stopped:
            return None
        ids, digests, logprobs = event.ids, event.logits_sha256, event.logprobs
        if self._stops.watching and len(ids) > 1:
            # One token at a time, up to the one that completes a stop string: the reply's ids
            # and usage then end there however the engine grouped its tokens (drafted rounds,
            # the stream interval), as they do when every event holds one token.
            text = ""
            for k, token in enumerate(ids):
                text += self._push((token,))
                if self._stops.stopped:
                    ids, digests = ids[: k + 1], None if digests is None else digests[: k + 1]
                    logprobs = None if logprobs is None else logprobs[: k + 1]
                    break
        else:
            text = self._push(ids)
        self._ids.extend(ids)
        self._kept_bytes += len(text.encode("utf-8"))
        self.num_sent_ids += len(ids)
        reasoning, content = self._split(text)
        return self._event(tuple(ids), reasoning, self._shown(content), digests, _wire_logprobs(ids, logprobs))

    def _push(self, ids: tuple[int, ...]) -> str:
        """The reply text `ids` release past the stop matcher. A stop id ends the stream; its text
        (an end-of-turn marker) is not the reply's."""
        return self._stops.push(self._decoder.push([i for i in ids if i not in self._stop_ids]))[0]

    @property
    def keep_generated(self) -> int | None:
        """Generated tokens whose bytes all lie before the stop string (None: unknown)."""
        if self._token_bytes is None:
            return None
        num_bytes = 0
        for k, token in enumerate(self._ids):
            num_bytes += len(self._token_bytes(token))
            if num_bytes > self._kept_bytes:
                return k
        return len(self._ids)

    def done(self, done: Any) -> list[TokenEvent | DoneEvent]:
        """The last events: a TokenEvent with held-back text when there is some, then DoneEvent."""
        tail = reasoning = ""
        if not self._stops.stopped:
            reasoning, tail = self._split(self._stops.push(self._decoder.flush())[0] + self._stops.flush())
        if self._reasoning is not None:
            more_reasoning, more = self._reasoning.finish()
            reasoning, tail = reasoning + more_reasoning, tail + more
        tail = self._shown(tail)
        calls: tuple[dict[str, Any], ...] | None = None
        if self._tools is not None:
            more, parsed = self._tools.finish()
            tail += more
            calls = tuple(call.to_wire() for call in parsed) or None
        events: list[TokenEvent | DoneEvent] = [self._event((), reasoning, tail)] if tail or reasoning else []
        events.append(DoneEvent(self.request_id, self._finish_reason(done, calls), self._usage(done.usage),
                                done.note or None, calls))
        return events

    def _split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of reply text; all content when reasoning is not parsed."""
        if self._reasoning is None or not text:
            return "", text
        return self._reasoning.push(text)

    def _event(self, ids: tuple[int, ...], reasoning: str, text: str, *rest: Any) -> TokenEvent:
        if self._reasoning is None:
            return TokenEvent(self.request_id, ids, text, *rest)
        return ReasonedTokens(self.request_id, ids, text, *rest, reasoning=reasoning)

    def _shown(self, text: str) -> str:
        return self._tools.push(text) if self._tools is not None and text else text

    def _finish_reason(self, done: Any, calls: Any) -> str:
        reason = "stop" if self._stops.stopped else done.finish_reason
        return "tool_calls" if calls and reason == "stop" else reason

    def _usage(self, usage: Any) -> Any:
        if not self._stops.stopped:
            return usage
        return dataclasses.replace(usage, completion_tokens=self.num_sent_ids)


def _wire_logprobs(ids: tuple[int, ...], logprobs: Any) -> tuple[dict[str, Any], ...] | None:
    if logprobs is None:
        return None
    return tuple(
        {"id": token, "logprob": lp.logprob, "top": [{"id": i, "logprob": v} for i, v in lp.top]}
        if lp is not None else {"id": token, "logprob": 0.0, "top": []}
        for token, lp in zip(ids, logprobs)
    )
