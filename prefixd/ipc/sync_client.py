"""`SyncClient`: the AsyncClient's calls, blocking, for scripts and the CLI.

An anyio blocking portal runs the AsyncClient (and its reader task) in a thread.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from functools import partial
from typing import Any, Iterator

from anyio.from_thread import BlockingPortal, start_blocking_portal

from prefixd.ipc.client import AsyncClient, GenerateResult, GenerateStream
from prefixd.ipc.events import DoneEvent, HelloReply, TokenEvent, TokensReply
from prefixd.ipc.framing import Limits
from prefixd.ipc.messages import SUPPORTED_VERSIONS


class SyncGenerateStream:
    """The events of one generate, blocking; see GenerateStream. Iterating sends it."""

    def __init__(self, portal: BlockingPortal, stream: GenerateStream) -> None:
        self._portal = portal
        self._stream = stream

    @property
    def id(self) -> int:
        return self._stream.id

    @property
    def done(self) -> DoneEvent | None:
        return self._stream.done

    def start(self) -> SyncGenerateStream:
        self._portal.call(self._stream.start)
        return self

    def __iter__(self) -> Iterator[TokenEvent | DoneEvent]:
        self.start()
        while self._stream.done is None:
            yield self._portal.call(self._stream.__anext__)

    def cancel(self) -> None:
        self._portal.call(self._stream.cancel)

    def collect(self) -> GenerateResult:
        return self._portal.call(self._stream.collect)

    def __enter__(self) -> SyncGenerateStream:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self._portal.call(self._stream.__aexit__, None, None, None)


class SyncClient:
    """One blocking connection to the daemon; use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike[str] | None = None, limits: Limits | None = None) -> None:
        self._portal_cm: AbstractContextManager[BlockingPortal] = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            client = self._portal.call(AsyncClient.connect, path, limits)
            self._client_cm = self._portal.wrap_async_context_manager(client)
            self._client = self._client_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    def close(self) -> None:
        try:
            self._client_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def hello(self, versions: tuple[int, ...] = SUPPORTED_VERSIONS, client: str | None = None) -> HelloReply:
        return self._portal.call(partial(self._client.hello, versions, client))

    def generate(self, **fields: Any) -> SyncGenerateStream:
        """As AsyncClient.generate: iterate it, or call collect()."""
        return SyncGenerateStream(self._portal, self._client.generate(**fields))

    def cancel(self, target: int) -> None:
        self._portal.call(self._client.cancel, target)

    def status(self) -> dict[str, Any]:
        return self._portal.call(self._client.status)

    def tokenize(
        self, text: str | None = None, messages: list[dict[str, Any]] | None = None, add_special: bool | None = None
    ) -> TokensReply:
        return self._portal.call(partial(self._client.tokenize, text, messages, add_special))

    def detokenize(self, ids: list[int] | tuple[int, ...]) -> str:
        return self._portal.call(self._client.detokenize, ids)
