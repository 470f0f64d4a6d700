"""Stored responses for /v1/responses: what `previous_response_id` continues and GET reads.

Bounded by count and by bytes, least recently used out first (creating, reading, and
continuing a response each count as a use), and per namespace: an id is looked up in the
caller's namespace only. Held in the front process's memory; a daemon restart forgets it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 1024
MAX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One answered response and the whole conversation it ends."""

    body: dict[str, Any]  # the response object as it was answered
    items: tuple[dict[str, Any], ...]  # normalized: every input item so far, then its output items
    num_bytes: int  # the JSON of body and items; items shared with an earlier turn count again


class ResponseStore:
    """An LRU map (namespace, response id) -> StoredResponse, within `max_responses` and
    `max_bytes` (event loop only)."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(f"store bounds must be positive, got {max_responses} responses, {max_bytes} bytes")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    @property
    def num_responses(self) -> int:
        return len(self._entries)

    def put(self, namespace: str, body: dict[str, Any], items: tuple[dict[str, Any], ...]) -> list[str]:
        """Keep `body` (its `id` is the key) with its conversation, evicting the least recently
        used until both bounds hold. Returns the evicted ids, oldest first; a response over
        `max_bytes` on its own is not kept (its own id is then listed)."""
        num_bytes = len(json.dumps([body, items], ensure_ascii=False).encode())
        if num_bytes > self.max_bytes:
            return [body["id"]]
        self.delete(namespace, body["id"])
        evicted = []
        while self._entries and (len(self._entries) >= self.max_responses or
                                 self.num_bytes + num_bytes > self.max_bytes):
            (_, old_id), old = self._entries.popitem(last=False)
            self.num_bytes -= old.num_bytes
            evicted.append(old_id)
        self._entries[(namespace, body["id"])] = StoredResponse(body, items, num_bytes)
        self.num_bytes += num_bytes
        return evicted

    def get(self, namespace: str, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        key = (namespace, response_id)
        stored = self._entries.get(key)
        if stored is not None:
            self._entries.move_to_end(key)
        return stored

    def delete(self, namespace: str, response_id: str) -> bool:
        """Forget a response; False when it was not stored."""
        stored = self._entries.pop((namespace, response_id), None)
        if stored is None:
            return False
        self.num_bytes -= stored.num_bytes
        return True
