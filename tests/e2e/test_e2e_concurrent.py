"""Concurrent equals solo through the socket: 8 clients at once, greedy and seeded sampling,
give each one exactly what it gets alone on an idle daemon (token ids and the logits bits of
every step), with the store off and on."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from prefixd.ipc.client import GenerateResult
from tests.e2e.daemon_proc import DaemonProcess
from tests.e2e.together import run_together

SAMPLED = {"temperature": 0.9, "top_k": 50, "top_p": 0.95}
QUESTIONS = (
    "What is the boiling point of water at sea level?",
    "Write a haiku about autumn leaves.",
    "List three uses of a paperclip.",
    "Explain recursion to a child in one sentence.",
    "Translate 'good morning' into French and Spanish.",
)


def requests(max_tokens: int) -> dict[str, dict[str, Any]]:
    """Eight requests of different lengths: greedy, seeded sampling, one prompt greedy and
    sampled, one prompt under two seeds and twice under the same seed."""
    def chat(i: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": QUESTIONS[i]}]

    out: dict[str, dict[str, Any]] = {
        "greedy0": {"messages": chat(0)},
        "greedy1": {"messages": chat(1)},
        "greedy2": {"messages": chat(2), "sampling": {"repetition_penalty": 1.3}},
        "seed7": {"messages": chat(3), "sampling": {**SAMPLED, "seed": 7}},
        "seed7_again": {"messages": chat(3), "sampling": {**SAMPLED, "seed": 7}},
        "seed8": {"messages": chat(3), "sampling": {**SAMPLED, "seed": 8}},
        "sampled0": {"messages": chat(0), "sampling": {"temperature": 1.2, "min_p": 0.02, "seed": 2**63 + 5}},
        "long": {"prompt": " ".join(QUESTIONS) * 3, "sampling": {**SAMPLED, "seed": 11}},
    }
    return {key: {**fields, "max_tokens": max_tokens, "logits": True} for key, fields in out.items()}


def exact(results: dict[str, GenerateResult]) -> dict[str, tuple]:
    return {key: (r.ids, r.logits_sha256, r.finish_reason, r.usage.prompt_tokens) for key, r in sorted(results.items())}


@pytest.fixture(scope="module", params=[pytest.param("default", marks=pytest.mark.slow), "tiny", "tiny_programs",
                                        "tiny_overlap"])
def setup(request: pytest.FixtureRequest) -> tuple[DaemonProcess, dict[str, dict[str, Any]], dict[str, GenerateResult]]:
    """The daemon, the requests, and each request's result run alone on the idle daemon with
    the store off."""
    daemon: DaemonProcess = request.getfixturevalue(f"{request.param}_daemon")
    reqs = requests(max_tokens=10 if request.param == "default" else 24)
    solo: dict[str, GenerateResult] = {}
    with daemon.client() as client:
        for key, fields in reqs.items():
            status = client.status()
            assert (status["lanes_busy"], status["waiting"]) == (0, 0), "solo means alone on an idle daemon"
            solo[key] = client.generate(**fields, cache=False).collect()
    return daemon, reqs, solo


def test_solo_runs_follow_their_seeds(setup):
    _, _, solo = setup
    assert exact({"x": solo["seed7"]}) == exact({"x": solo["seed7_again"]})
    assert solo["seed7"].ids != solo["seed8"].ids
    assert solo["sampled0"].ids != solo["greedy0"].ids
    for result in solo.values():
        assert len(result.ids) == len(result.logits_sha256) == result.usage.completion_tokens >= 1


@pytest.mark.parametrize("cache", [False, True], ids=["store_off", "store_on"])
def test_eight_clients_at_once_equal_each_alone(setup, cache: bool):
    daemon, reqs, solo = setup
    fields = {key: {**f, "cache": cache, "namespace": f"together-{cache}"} for key, f in reqs.items()}
    together, most_busy = anyio.run(run_together, daemon.socket, fields)
    assert exact(together) == exact(solo)
    assert {k: r.text for k, r in together.items()} == {k: r.text for k, r in solo.items()}
    assert most_busy >= 2, "the clients shared lane rounds"
    assert {r.usage.cache for r in together.values()} <= ({"miss", "hit"} if cache else {"off"})


def test_decode_programs_give_the_op_by_op_daemons_bits(tiny_daemon: DaemonProcess,
                                                       tiny_programs_daemon: DaemonProcess):
    """The same model served with decode rounds as fixed programs (gpu/programs.py) and op by
    op: each request alone, cold, gives the same ids and logits bits on both."""
    reqs = requests(max_tokens=24)
    with tiny_daemon.client() as plain, tiny_programs_daemon.client() as programs:
        for key in ("greedy0", "greedy2", "seed7", "long"):
            a = plain.generate(**reqs[key], cache=False).collect()
            b = programs.generate(**reqs[key], cache=False).collect()
            assert exact({key: a}) == exact({key: b}), key


def test_overlapped_rounds_give_the_one_at_a_time_daemons_bits(tiny_daemon: DaemonProcess,
                                                             tiny_overlap_daemon: DaemonProcess):
    """Eight clients at once on a daemon that overlaps each round with the next one's host work
    get what each gets alone on a daemon that runs rounds one at a time: ids and logits bits."""
    reqs = {key: {**f, "cache": True, "namespace": "overlap"} for key, f in requests(max_tokens=24).items()}
    with tiny_daemon.client() as plain:
        alone = {key: plain.generate(**{**fields, "cache": False}).collect() for key, fields in reqs.items()}
    together, most_busy = anyio.run(run_together, tiny_overlap_daemon.socket, reqs)
    assert exact(together) == exact(alone)
    assert most_busy >= 2, "the clients shared lane rounds"
    with tiny_overlap_daemon.client() as client:
        assert client.status()["model"]["overlap"] is True
