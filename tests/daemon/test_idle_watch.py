"""--idle-exit in-process: a connected client keeps the daemon up; once the last one leaves
and nothing is open, the daemon asks itself to exit with code 0."""

from __future__ import annotations

import anyio

from prefixd.ipc.client import AsyncClient
from tests.daemon.harness import running_server


async def _exited(server) -> bool:
    with anyio.move_on_after(60):
        while not server.should_exit:
            await anyio.sleep(0.01)
    return server.should_exit


async def test_a_connected_client_keeps_the_daemon_up_and_its_leaving_starts_the_idle_clock(tmp_path):
    async with running_server(tmp_path, idle_exit_s=0.2) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            await client.generate(prompt="hi", max_tokens=2).collect()
            await anyio.sleep(0.8)  # four idle periods with a client connected
            assert not server.should_exit
        assert await _exited(server)
        assert server.exit_code == 0
        assert "prefixd: idle for 0.2s: exiting" in server._out.getvalue()  # noqa: SLF001


async def test_without_idle_exit_the_daemon_stays_up(tmp_path):
    async with running_server(tmp_path) as server:
        await anyio.sleep(0.5)
        assert not server.should_exit
