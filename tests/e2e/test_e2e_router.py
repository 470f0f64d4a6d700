"""A real router in front of real daemons: SMG (`pip install smg`; skipped without its `smg`
command on PATH) with its cache_aware policy over two `prefixd serve --http` daemons on the
tiny random llama. Two agent conversations interleaved through SMG: every turn of a
conversation lands on the daemon that served its first turn, its later turns are cache hits
there, and every reply (text and token logprobs) equals a single daemon's, bit for bit."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.daemon_proc import LIVENESS_S, free_ports, serving

SMG = shutil.which("smg")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(SMG is None, reason="smg is not installed (pip install smg)")]
TURNS = 4
FOLLOW_UPS = ["Go on.", "And then?", "Say more.", "Why?"]


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=LIVENESS_S) as response:
        return json.loads(response.read())


def post_json(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=LIVENESS_S) as response:
        return json.loads(response.read())


def num_requests(base: str) -> float:
    """Requests the daemon at `base` has finished (its own prefixd_requests_total, every reason)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=LIVENESS_S) as response:
        text = response.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "prefixd_requests"
               for s in f.samples if s.name == "prefixd_requests_total")


@contextmanager
def smg_router(workdir: Path, worker_urls: list[str], policy: str) -> Iterator[str]:
    """`smg launch` on loopback over `worker_urls`; yields its base URL once every worker is ready.
    The warm-up slice is off: it sends cache hits to an empty worker on purpose."""
    port, metrics_port = free_ports(2)
    args = [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0", "--log-level", "info"]
    with (workdir / "smg.log").open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + LIVENESS_S
        while not _all_ready(base, len(worker_urls)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"smg did not come up:\n{(workdir / 'smg.log').read_text(errors='replace')}")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=LIVENESS_S)


def _all_ready(base: str, count: int) -> bool:
    try:
        workers = get_json(f"{base}/workers")["workers"]
    except (OSError, urllib.error.URLError, ValueError):
        return False
    return len(workers) == count and all(w.get("is_healthy") and w.get("status") == "ready" for w in workers)


@pytest.fixture(scope="module")
def http_daemons(tiny_llama_dir, tmp_path_factory):
    """Three daemons on the tiny llama: two behind the router, one alone (the reference)."""
    ports = free_ports(3)
    gens = [serving(tiny_llama_dir, tmp_path_factory.mktemp(f"d_router{i}"), "--lanes", "2", "--max-context", "1024",
                    "--cache-budget", "64M", "--dtype", "fp32", "--http", f"127.0.0.1:{port}")
            for i, port in enumerate(ports)]
    daemons = [next(gen) for gen in gens]
    yield daemons, [f"http://127.0.0.1:{port}" for port in ports]
    for gen in gens:
        for _ in gen:  # the rest of `serving`: SIGTERM and the clean exit
            pass


def conversation_starts() -> list[list[dict[str, str]]]:
    return [
        [{"role": "system", "content": "You are a ship's navigator. Answer in plain words."},
         {"role": "user", "content": "Plot a course from Lisbon to the Azores and name the hazards."}],
        [{"role": "system", "content": "You review Python code for a small team, briefly."},
         {"role": "user", "content": "Is a bare except clause ever fine in a retry loop?"}],
    ]


def run_interleaved(base: str, daemons: list[str]) -> tuple[list[list[dict]], list[list[int]]]:
    """Both conversations, turn by turn in turns (A1 B1 A2 B2 ...), through `base`. Returns each
    turn's reply and, for each conversation, the index of the daemon that served each turn."""
    conversations = conversation_starts()
    replies: list[list[dict]] = [[] for _ in conversations]
    served: list[list[int]] = [[] for _ in conversations]
    for turn in range(TURNS):
        for c, messages in enumerate(conversations):
            before = [num_requests(d) for d in daemons]
            body = {"model": "llama", "messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True}
            reply = post_json(f"{base}/v1/chat/completions", body)
            after = [num_requests(d) for d in daemons]
            served[c].append([i for i in range(len(daemons)) if after[i] > before[i]][0])
            replies[c].append(reply)
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
            messages.append({"role": "user", "content": FOLLOW_UPS[turn]})
    return replies, served


def test_cache_aware_smg_keeps_each_conversation_on_its_daemon_with_the_same_bits(http_daemons, tmp_path):
    _, urls = http_daemons
    routed, alone = urls[:2], urls[2]
    with smg_router(tmp_path, routed, "cache_aware") as base:
        replies, served = run_interleaved(base, routed)
    reference, _ = run_interleaved(alone, [alone])
    for c in range(2):
        assert len(set(served[c])) == 1, f"conversation {c} moved between daemons: {served[c]}"
        for turn in range(1, TURNS):
            usage, previous = replies[c][turn]["usage"], replies[c][turn - 1]["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= previous["prompt_tokens"], (c, turn)
        for got, want in zip(replies[c], reference[c]):
            assert got["choices"][0]["message"] == want["choices"][0]["message"]
            assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]  # floats, compared exactly


def test_smg_registers_each_daemon_with_its_facts_and_reads_its_load(http_daemons, tmp_path):
    _, urls = http_daemons
    routed = urls[:2]
    own = {url: get_json(f"{url}/v1/loads")["loads"][0] for url in routed}
    with smg_router(tmp_path, routed, "least_load") as base:
        while not all("engine_load" in w for w in get_json(f"{base}/workers")["workers"]):  # its first poll
            time.sleep(0.1)
        workers = {w["url"]: w for w in get_json(f"{base}/workers")["workers"]}
        reply = post_json(f"{base}/v1/chat/completions", {"model": "llama", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert reply["usage"]["completion_tokens"] == 2
    for url in routed:
        worker = workers[url]
        assert worker["runtime_type"] == "generic"  # neither SGLang nor vLLM
        assert (worker["labels"]["max_running_requests"], worker["labels"]["context_length"]) == ("2", "1024")
        assert worker["labels"]["max_total_tokens"] == str(own[url]["max_total_num_tokens"])
        load = worker["engine_load"]["loads"][0]
        assert load["max_total_num_tokens"] == own[url]["max_total_num_tokens"]
        assert load["max_running_requests"] == 2


VLLM_ROUTER = shutil.which("vllm-router")


@pytest.mark.skipif(VLLM_ROUTER is None, reason="vllm-router is not installed (pip install vllm-router)")
def test_vllm_router_power_of_two_reads_each_daemons_load(http_daemons, tmp_path):
    _, urls = http_daemons
    routed = urls[:2]
    port, metrics_port = free_ports(2)
    args = [VLLM_ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *routed,
            "--policy", "power_of_two", "--worker-startup-check-interval", "1",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    with (tmp_path / "vllm-router.log").open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + LIVENESS_S
        while True:  # the router's /get_loads asks each worker's /get_load; -1 where that fails
            try:
                loads = {entry["worker"]: entry["load"] for entry in get_json(f"{base}/get_loads")["workers"]}
                if len(loads) == 2:
                    break
            except (OSError, urllib.error.URLError, ValueError, KeyError):
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "vllm-router.log").read_text()
            time.sleep(0.1)
        reply = post_json(f"{base}/v1/chat/completions", {"model": "llama", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    finally:
        proc.terminate()
        proc.wait(timeout=LIVENESS_S)
    assert loads == {url: 0 for url in routed}
    assert reply["usage"]["completion_tokens"] == 2
