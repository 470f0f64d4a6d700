"""Exactness end to end on the default model: the agent chat's turns give the same token ids
and the same logits bits at every step whether the store is off, on, on and evicting, the
conversation continues a resident lane, or all turns run as 8 concurrent streams.

The cold run (store off, one request at a time) generates the replies that later turns feed
back, so every mode sends byte-identical requests.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.e2e.agent_chat import (
    Transcript,
    all_at_once,
    alternating_with_store_stats, check_runs_equal_cold,
    check_usage,
    cold_transcript,
    continued_in_place,
    from_the_store,
    outputs,
    run_sync,
)
from prefixd.gpu import cpu_kernels
from tests.e2e.daemon_proc import DaemonProcess, serving, stopping

pytestmark = pytest.mark.slow

MAX_TOKENS = 5
ONE_LANE = ("--lanes", "1", "--max-context", "1024")
# What --cache-budget pays before the store on this model with one lane (weights, workspace);
# only a first guess: the fixture reads the daemon's own figure back.
DEFAULT_MODEL_RESERVED_GUESS = 278_073_984
# Holds one conversation's pages but not both chats': with the chats alternating, turns evict.
# Entries hold pages and a logits row (196,608 bytes), so the window is narrow and moves with
# the page's bytes: with int4's 8-bit pages (207,360 bytes) 6.8 MB stops evicting and 7.5 MB
# lets a turn fit; with bf16 pages (mode invariant, where `--mode auto` does not pick int4) 12 MB.
def evicting_store_bytes() -> int:
    return 7_000_000 if cpu_kernels.fast() else 12_000_000


@pytest.fixture(scope="module")
def cold(default_daemon: DaemonProcess) -> Transcript:
    return run_sync(cold_transcript, default_daemon.socket, MAX_TOKENS)


@pytest.fixture(scope="module")
def one_lane_daemon(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One lane and an ample store: a conversation's next turn resumes from the store."""
    yield from serving(default_model, tmp_path_factory.mktemp("d_one_lane"), *ONE_LANE, "--cache-budget", "400M")


@pytest.fixture(scope="module")
def evicting_daemon(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    daemon = DaemonProcess.start_with_store_budget(default_model, tmp_path_factory.mktemp("d_evicting"),
                                                   evicting_store_bytes(), DEFAULT_MODEL_RESERVED_GUESS, *ONE_LANE)
    yield from stopping(daemon)


def test_cold_run_serves_every_turn_cold(cold: Transcript):
    assert [key for key in cold.keys] == [("a", i) for i in range(6)] + [("b", 0), ("b", 1)]
    for key, step in cold.steps.items():
        assert step.usage.cache == "off", key
        assert step.usage.cached_tokens == 0, key
        assert len(step.ids) == len(step.digests) >= 1, key
    prompts = [cold.steps[("a", i)].usage.prompt_tokens for i in range(6)]
    assert prompts == sorted(set(prompts)), "each turn re-sends the conversation and adds to it"


def test_store_on_resumes_every_turn_from_the_store_exactly(one_lane_daemon: DaemonProcess, cold: Transcript):
    steps = run_sync(from_the_store, one_lane_daemon.socket, cold, MAX_TOKENS)
    assert outputs(steps) == outputs(cold.steps)
    check_usage(steps, cold)
    assert steps[("a", 0)].usage.cache == "miss"
    for key in [("a", i) for i in range(1, 6)] + [("b", 0), ("b", 1)]:
        assert steps[key].usage.cache == "hit", key
        assert steps[key].usage.cached_tokens > 0, key
    for chat, turns in (("a", 6), ("b", 2)):
        for i in range(1, turns):
            # The hit covers at least the whole previous request of the conversation.
            assert steps[(chat, i)].usage.cached_tokens >= steps[(chat, i - 1)].usage.prompt_tokens, (chat, i)


def test_evicting_store_resumes_exactly_while_every_turn_evicts(evicting_daemon: DaemonProcess, cold: Transcript):
    runs = run_sync(alternating_with_store_stats, evicting_daemon.socket, cold, MAX_TOKENS)
    stores = check_runs_equal_cold(runs, cold)
    evicted = [sum(store["evictions"].values()) for store in stores]
    first = next(i for i, n in enumerate(evicted) if n > 0)
    assert first <= 6, evicted  # by chat "a"'s fourth turn the store is full
    assert all(later > earlier for earlier, later in zip(evicted[first:], evicted[first + 1:])), evicted
    assert all(store["bytes"] <= evicting_store_bytes() for store in stores)


def test_resident_continuation_equals_cold(default_daemon: DaemonProcess, cold: Transcript):
    steps = run_sync(continued_in_place, default_daemon.socket, cold, MAX_TOKENS)
    assert outputs(steps) == outputs(cold.steps)
    check_usage(steps, cold)
    for chat, turns in (("a", 6), ("b", 2)):
        for i in range(1, turns):
            usage = steps[(chat, i)].usage
            assert usage.cache == "resident", (chat, i)
            assert usage.cached_tokens >= steps[(chat, i - 1)].usage.prompt_tokens, (chat, i)


def test_eight_concurrent_streams_equal_cold(default_daemon: DaemonProcess, cold: Transcript):
    steps, most_busy = run_sync(all_at_once, default_daemon.socket, cold, MAX_TOKENS, namespace="concurrent")
    assert outputs(steps) == outputs(cold.steps)
    check_usage(steps, cold)
    assert most_busy >= 2, "the streams shared rounds"

