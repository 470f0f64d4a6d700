"""The serve process shortens the GIL switch interval (the engine thread retakes the GIL
around every op); in-process servers (tests, embedders) leave the interpreter's alone."""

from __future__ import annotations

import sys

import prefixd.daemon.server as server_module
from prefixd.daemon.config import DaemonConfig


class _StubServer:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg

    async def run(self) -> int:
        return 7


def test_serve_sets_the_gil_switch_interval_before_running(monkeypatch, tmp_path):
    before = sys.getswitchinterval()
    arenas = []
    monkeypatch.setattr(server_module, "Server", _StubServer)
    monkeypatch.setattr(server_module, "one_malloc_arena", lambda: arenas.append(1))  # process-wide
    try:
        assert server_module.serve(DaemonConfig(socket_path=tmp_path / "s.sock")) == 7
        assert sys.getswitchinterval() == server_module.GIL_SWITCH_S
        assert arenas == [1]  # one malloc arena, so the idle trim reaches worker threads' heap
    finally:
        sys.setswitchinterval(before)
    assert server_module.GIL_SWITCH_S < before  # shorter than CPython's default


async def test_an_in_process_server_leaves_the_interval_alone(tmp_path):
    from tests.daemon.harness import running_server

    before = sys.getswitchinterval()
    async with running_server(tmp_path):
        assert sys.getswitchinterval() == before
