"""Start a real Server in-process (real socket, real Engine, LetterDevice) for tests."""

from __future__ import annotations

import io
import os
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator

import anyio

from prefixd.front.bounds import ConnectionBounds
from prefixd.daemon.config import DaemonConfig
from prefixd.daemon.server import Server
from tests.daemon.fakes import LetterDevice, fake_runtime_factory


def open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


@asynccontextmanager
async def running_server(tmp_path: Path, device: LetterDevice | None = None, **overrides) -> AsyncIterator[Server]:
    device = device or LetterDevice()
    bounds = overrides.pop("bounds", ConnectionBounds(render_process=False))  # tests that render in it ask
    if "out_frames" in overrides:
        bounds = replace(bounds, out_frames=overrides.pop("out_frames"))
    if "max_streams" in overrides:
        bounds = replace(bounds, max_streams=overrides.pop("max_streams"))
    env = overrides.pop("env", {})
    factory = overrides.pop("runtime_factory", None) or fake_runtime_factory(device)
    freeze_heap = overrides.pop("freeze_heap", False)
    cfg = DaemonConfig(socket_path=tmp_path / "run" / "prefixd.sock", metrics_addr="127.0.0.1:0",
                       grace_s=overrides.pop("grace_s", 5.0), **overrides)
    server = Server(cfg, runtime_factory=factory, env=env, out=io.StringIO(),
                    bounds=bounds, freeze_heap=freeze_heap)
    server.device = device  # type: ignore[attr-defined]
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.run)
        await server.listening.wait()
        try:
            yield server
        finally:
            device.gate.set()
            server.request_exit(0)


async def engine_call(server: Server, fn):
    return await server._host.call(fn)  # noqa: SLF001 - tests look at the engine through its thread


async def wait_idle(server: Server) -> dict:
    """Wait (event-driven polling, no time assertions) until no stream is left anywhere."""
    while True:
        idle, status = await engine_call(server, lambda e: (e.idle, e.status()))
        if idle and not any(c.num_streams for c in server._connections):
            await engine_call(server, lambda e: e.check_integrity())
            return status
        await anyio.sleep(0.01)
