"""Start a real Server in-process (real socket, real Engine, LetterDevice) for tests.

The engine runs in a thread of the test process (ThreadLauncher) over the same engine link
and frames as the daemon's engine process, so a test can drive the LetterDevice directly;
tests/daemon/test_engine_process.py runs the engine in a process of its own."""

from __future__ import annotations

import io
import os
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import anyio

from prefixd.front.bounds import ConnectionBounds
from prefixd.daemon.config import DaemonConfig
from prefixd.daemon.server import Server
from prefixd.front.engine_link import ThreadLauncher
from tests.daemon.fakes import LetterDevice, fake_runtime_factory

T = TypeVar("T")


def open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


async def fds_once_closed(server) -> set[int]:
    """`open_fds()` once the server has closed every connection: a client's close reaches the
    server's side of the socket only when that connection's task sees it end."""
    with anyio.fail_after(60):  # a connection that never ends is a failure of its own
        while server._connections:
            await anyio.sleep(0.01)
    return open_fds()


@asynccontextmanager
async def running_server(tmp_path: Path, device: LetterDevice | None = None, **overrides) -> AsyncIterator[Server]:
    device = device or LetterDevice()
    bounds = overrides.pop("bounds", ConnectionBounds())
    if "out_frames" in overrides:
        bounds = replace(bounds, out_frames=overrides.pop("out_frames"))
    if "max_streams" in overrides:
        bounds = replace(bounds, max_streams=overrides.pop("max_streams"))
    env = overrides.pop("env", {})
    factory = overrides.pop("runtime_factory", None) or fake_runtime_factory(device)
    freeze_heap = overrides.pop("freeze_heap", False)
    cfg = DaemonConfig(socket_path=tmp_path / "run" / "prefixd.sock", metrics_addr="127.0.0.1:0",
                       grace_s=overrides.pop("grace_s", 5.0), **overrides)
    server = Server(cfg, engine=ThreadLauncher(factory, cfg), env=env, out=io.StringIO(),
                    bounds=bounds, freeze_heap=freeze_heap)
    server.device = device  # type: ignore[attr-defined]
    server.factory = factory  # type: ignore[attr-defined]
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.run)
        await server.listening.wait()
        try:
            yield server
        finally:
            device.gate.set()
            server.request_exit(0)


def idle_engine(server: Server):
    """The engine of a harness server (its thread's), to read once `wait_idle` has returned:
    an idle engine's thread sleeps on the link and touches nothing."""
    return server.factory.runtime.engine  # type: ignore[attr-defined]


async def wait_idle(server: Server) -> dict:
    """Wait (event-driven polling, no time assertions) until no stream is left anywhere; the
    engine's integrity check has passed."""
    while True:
        status = await server.link.status()
        if status["engine_idle"] and not any(c.num_streams for c in server._connections):
            status = await server.link.status(check=True)
            assert status["integrity"] is None, status["integrity"]
            return status
        await anyio.sleep(0.01)


async def honest_beside(hostile: Callable[[], Awaitable[None]], honest: Callable[[], Awaitable[T]]) -> T:
    """What `honest()` returns when `hostile()` runs beside it (both started together, both
    run to their end)."""
    result: list[T] = []

    async def run_honest() -> None:
        result.append(await honest())

    async with anyio.create_task_group() as tg:
        tg.start_soon(hostile)
        tg.start_soon(run_honest)
    return result[0]
