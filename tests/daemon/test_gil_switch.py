"""The serve process shortens the GIL switch interval (the engine thread retakes the GIL
around every op) and freezes the heap it loaded (a full collection of it held the GIL for
tens of ms); in-process servers (tests, embedders) leave the interpreter's settings alone."""

from __future__ import annotations

import gc
import sys

import prefixd.daemon.server as server_module
from prefixd.daemon.config import DaemonConfig


class _StubServer:
    def __init__(self, cfg: DaemonConfig, **kwargs) -> None:
        self.cfg = cfg
        self.kwargs = kwargs
        _StubServer.made = self

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
        assert _StubServer.made.kwargs == {"freeze_heap": True}
    finally:
        sys.setswitchinterval(before)
    assert server_module.GIL_SWITCH_S < before  # shorter than CPython's default


async def test_an_in_process_server_leaves_the_interval_alone(tmp_path):
    from tests.daemon.harness import running_server

    before = sys.getswitchinterval()
    async with running_server(tmp_path):
        assert sys.getswitchinterval() == before


async def test_a_server_told_to_freeze_its_heap_does_so_once_the_model_is_loaded(tmp_path):
    """After the load, everything alive is out of the collector's reach (gc.freeze), so a full
    collection walks only what serving allocated; an in-process server by default does not."""
    from tests.daemon.harness import running_server

    before = gc.get_freeze_count()
    async with running_server(tmp_path):
        assert gc.get_freeze_count() == before
    try:
        async with running_server(tmp_path / "frozen", freeze_heap=True) as server:
            assert gc.get_freeze_count() > before
            loaded = server._runtime.engine  # noqa: SLF001 - built by the load, before the freeze
            assert gc.is_tracked(loaded)
            assert not any(o is loaded for g in range(3) for o in gc.get_objects(g))  # in no generation: frozen
    finally:
        gc.unfreeze()
