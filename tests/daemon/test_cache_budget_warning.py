"""`--cache-budget` smaller than what weights, lanes and workspace reserve warns at start-up
(issue 8: 64M silently gave the store 0 bytes)."""

from __future__ import annotations

import dataclasses

from prefixd.daemon.config import cache_budget_warning
from prefixd.engine.runtime import Runtime
from prefixd.scheduler.config import SchedulerConfig
from tests.daemon.fakes import VOCAB, ByteDecoder, ByteTokenizer, LetterDevice
from tests.daemon import harness
from tests.daemon.harness import running_server

# LetterDevice: weights 10,000 bytes, no lane state, 8 workspace bytes per row; 2 lanes x grid 8.
RESERVED = 10_000 + 2 * 8 * 8


def sched(budget: int | None) -> SchedulerConfig:
    return SchedulerConfig(num_lanes=2, grid=8, round_row_budget=64, cache_budget_bytes=budget)


def test_warning_names_budget_allowance_and_reserved_bytes():
    info = LetterDevice(num_lanes=2).info  # 1,024-byte pages
    assert cache_budget_warning(info, sched(RESERVED - 1)) == (
        f"--cache-budget {RESERVED - 1} bytes leaves the prefix cache 0 bytes (less than one 1024-byte page): "
        f"weights, lane state and workspace take {RESERVED} bytes of the budget first; "
        f"give at least {RESERVED + 1024} bytes, or auto, to cache prefixes")
    assert "leaves the prefix cache 1023 bytes" in cache_budget_warning(info, sched(RESERVED + 1023))
    assert cache_budget_warning(info, sched(RESERVED + 1024)) is None
    assert cache_budget_warning(info, sched(None)) is None
    assert cache_budget_warning(info, dataclasses.replace(sched(0), cache=False)) is None


async def test_daemon_prints_the_warning_at_start_up(tmp_path, monkeypatch):
    device = LetterDevice(num_lanes=2)

    def factory(cfg, observer):
        from prefixd.scheduler.engine import Engine

        engine = Engine(device, sched(64), observer=observer)
        tokenizer = ByteTokenizer()
        info = {"name": "letters", "family": "fake", "vocab_size": VOCAB, "max_context": engine.max_context}
        return Runtime(engine=engine, tokenizer=tokenizer, model_info=info, decoder_factory=lambda: ByteDecoder(tokenizer))

    async with running_server(tmp_path, device) as server:
        pass
    assert "prefixd: warning" not in server._out.getvalue()
    monkeypatch.setattr(harness, "fake_runtime_factory", lambda _device: factory)
    async with running_server(tmp_path, device) as server:
        pass
    assert (f"prefixd: warning: --cache-budget 64 bytes leaves the prefix cache 0 bytes (less than one 1024-byte "
            f"page): weights, lane state and workspace take {RESERVED} bytes") in server._out.getvalue()
