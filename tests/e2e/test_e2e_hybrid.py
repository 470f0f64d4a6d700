"""The exactness tests on a tiny hybrid (qwen3_5: Gated DeltaNet + gated attention) model
through real daemons: the agent chat resumed from the store, evicting, continued in place,
at 8 concurrent lanes and on a --no-cache daemon equals the cold run; a request with its own chunk starts equals
the cold run of the same schedule, resumed or among other streams.

The family resumes only at cut points of the request's own schedule (its chunked form and
step form differ in bits), so a turn resumes at the start of the previous reply's message
and prefills the reply again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from prefixd.ipc.client import AsyncClient
from tests.e2e.agent_chat import (
    Step,
    Transcript,
    TurnKey,
    all_at_once,
    alternating_with_store_stats, check_runs_equal_cold,
    check_usage,
    cold_transcript,
    continued_in_place,
    from_the_store,
    message_starts,
    outputs,
    run_sync,
    take_the_lane,
)
from tests.e2e.daemon_proc import DaemonProcess, serving, stopping
from tests.e2e.together import run_together
from tests.helpers.tiny_models import make_tiny_hybrid_hf_dir

MAX_TOKENS = 6
# fp32: a prefill schedule's bits reach the logits (bf16 rounds them away on this tiny model);
# a small grid: prompts prefill in many chunks.
FLAGS = ("--dtype", "fp32", "--max-context", "1024", "--grid", "32")
HYBRID_RESERVED_GUESS = 25_901_504  # see test_e2e_exactness: a first guess, read back from the daemon
EVICTING_STORE_BYTES = 500_000  # a few snapshots of this model: the alternating chats evict every turn


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_5 model with the default model's tokenizer and chat template."""
    pytest.importorskip("transformers.models.qwen3_5")
    
    path = make_tiny_hybrid_hf_dir(tmp_path_factory.mktemp("e2e_hybrid") / "model", seed=5, vocab_size=49152)
    return path


@pytest.fixture(scope="module")
def eight_lanes(hybrid_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from serving(hybrid_dir, tmp_path_factory.mktemp("h_eight"), "--lanes", "8", *FLAGS, "--cache-budget", "64M")


@pytest.fixture(scope="module")
def eight_lanes_programs(hybrid_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """CUDA's defaults, uncaptured: decode rounds as the fixed programs (gpu/programs.py) and
    each round beside the next one's admission (overlap)."""
    yield from serving(hybrid_dir, tmp_path_factory.mktemp("h_programs"), "--lanes", "8", *FLAGS, "--cache-budget",
                       "64M", "--cuda-graphs", "eager", "--overlap", "on")


@pytest.fixture(scope="module")
def one_lane(hybrid_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from serving(hybrid_dir, tmp_path_factory.mktemp("h_one"), "--lanes", "1", *FLAGS, "--cache-budget", "64M")


@pytest.fixture(scope="module")
def store_off(hybrid_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from serving(hybrid_dir, tmp_path_factory.mktemp("h_off"), "--lanes", "2", *FLAGS, "--no-cache")


@pytest.fixture(scope="module")
def evicting(hybrid_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    daemon = DaemonProcess.start_with_store_budget(hybrid_dir, tmp_path_factory.mktemp("h_evicting"),
                                                   EVICTING_STORE_BYTES, HYBRID_RESERVED_GUESS, "--lanes", "1", *FLAGS)
    yield from stopping(daemon)


@pytest.fixture(scope="module")
def cold(eight_lanes: DaemonProcess) -> tuple[Transcript, dict[TurnKey, tuple[int, ...]]]:
    """The cold transcript, and each turn's message starts (its cut points)."""
    transcript = run_sync(cold_transcript, eight_lanes.socket, MAX_TOKENS)
    return transcript, run_sync(message_starts, eight_lanes.socket, transcript)


def previous_reply_start(key: TurnKey, starts: dict[TurnKey, tuple[int, ...]], cold: Transcript) -> int:
    """Where the previous turn's reply begins in this turn's prompt: the last cut both share."""
    assert cold.messages[key][-2]["role"] == "assistant"
    return starts[key][len(cold.messages[key]) - 2]


def check(steps: dict[TurnKey, Step], cold: Transcript) -> None:
    assert outputs(steps) == outputs(cold.steps)
    check_usage(steps, cold)


def later_turns(cold: Transcript) -> list[TurnKey]:
    return [key for key in cold.keys if key[1] > 0]


def test_store_on_resumes_at_the_previous_reply_start_exactly(one_lane: DaemonProcess, cold):
    transcript, starts = cold
    steps = run_sync(from_the_store, one_lane.socket, transcript, MAX_TOKENS)
    check(steps, transcript)
    for key in later_turns(transcript):
        assert steps[key].usage.cache == "hit", key
        assert steps[key].usage.cached_tokens == previous_reply_start(key, starts, transcript), key
    assert steps[("b", 0)].usage.cached_tokens == starts[("b", 0)][1]  # chat "a"'s system prompt


def test_resident_lane_continues_from_its_last_cut_exactly(eight_lanes: DaemonProcess, cold):
    transcript, starts = cold
    steps = run_sync(continued_in_place, eight_lanes.socket, transcript, MAX_TOKENS)
    check(steps, transcript)
    for key in later_turns(transcript):
        assert steps[key].usage.cache == "resident", key
        assert steps[key].usage.cached_tokens == previous_reply_start(key, starts, transcript), key


def test_evicting_store_resumes_exactly_while_every_turn_evicts(evicting: DaemonProcess, cold):
    transcript, _ = cold
    runs = run_sync(alternating_with_store_stats, evicting.socket, transcript, MAX_TOKENS)
    stores = check_runs_equal_cold(runs, transcript)
    evicted = [sum(store["evictions"].values()) for store in stores]
    assert all(later > earlier for earlier, later in zip(evicted, evicted[1:])), evicted
    assert all(store["bytes"] <= EVICTING_STORE_BYTES for store in stores)


@pytest.mark.parametrize("cache", [False, True], ids=["store_off", "store_on"])
def test_eight_concurrent_streams_equal_cold(eight_lanes: DaemonProcess, cold, cache: bool):
    transcript, _ = cold
    steps, most_busy = run_sync(all_at_once, eight_lanes.socket, transcript, MAX_TOKENS, cache=cache,
                                namespace=f"concurrent-{cache}")
    check(steps, transcript)
    assert most_busy >= 2, "the streams shared rounds"


def test_eight_streams_through_decode_programs_with_overlap_equal_cold(eight_lanes_programs: DaemonProcess, cold):
    transcript, _ = cold
    steps, most_busy = run_sync(all_at_once, eight_lanes_programs.socket, transcript, MAX_TOKENS, cache=True,
                                namespace="programs")
    check(steps, transcript)
    assert most_busy >= 2, "the streams shared rounds"


PROMPT_LEN = 180
STARTS = (5, 37, 38, 100, 150)  # off the grid on purpose; 38: a one-row chunk


def test_a_daemon_with_the_store_off_equals_cold(store_off: DaemonProcess, cold):
    transcript, _ = cold
    steps = run_sync(continued_in_place, store_off.socket, transcript, MAX_TOKENS)
    check(steps, transcript)
    assert {step.usage.cache for step in steps.values()} == {"off"}
    assert "store" not in store_off.status()


async def _schedules(one: DaemonProcess, eight: DaemonProcess) -> dict[str, Any]:
    tokens = list(range(1000, 1000 + PROMPT_LEN))
    request = {"tokens": tokens, "chunk_starts": list(STARTS), "max_tokens": MAX_TOKENS, "logits": True}
    other = {**request, "chunk_starts": [5, 37, 39, 100, 150]}  # same tokens, another schedule below 150
    out: dict[str, Any] = {}
    async with await AsyncClient.connect(one.socket) as client:
        out["cold"] = await client.generate(**request, cache=False).collect()
        out["other_cold"] = await client.generate(**other, cache=False).collect()
        prefix = {**request, "tokens": tokens[:150], "chunk_starts": list(STARTS[:-1]), "namespace": "sched"}
        out["prefix"] = await client.generate(**prefix).collect()
        await take_the_lane(client)
        out["resumed"] = await client.generate(**request, namespace="sched").collect()
        await take_the_lane(client)
        out["other_resumed"] = await client.generate(**other, namespace="sched").collect()
    busy = {f"busy{i}": {"tokens": tokens[i * 10:i * 10 + 60], "max_tokens": 40, "cache": False} for i in range(7)}
    together, _ = await run_together(eight.socket, {"request": {**request, "cache": False}, **busy})
    out["together"] = together["request"]
    return out


def test_a_request_schedule_gives_the_cold_bits_of_that_schedule(one_lane: DaemonProcess, eight_lanes: DaemonProcess):
    r = run_sync(_schedules, one_lane, eight_lanes)

    def exact(result):
        return result.ids, result.logits_sha256

    assert exact(r["other_cold"]) != exact(r["cold"]), "the schedule shows in the bits: the checks below can fail"
    assert exact(r["resumed"]) == exact(r["cold"])
    assert (r["resumed"].usage.cache, r["resumed"].usage.cached_tokens) == ("hit", 150)
    assert exact(r["together"]) == exact(r["cold"])
    # Another schedule below the cut never resumes from this one's snapshot at 150.
    assert exact(r["other_resumed"]) == exact(r["other_cold"])
    assert r["other_resumed"].usage.cached_tokens in (0, 5, 37)
