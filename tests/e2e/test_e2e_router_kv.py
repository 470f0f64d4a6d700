"""vllm-router's `kv_aware` policy over two real daemons publishing KV events (skipped
without `vllm-router` on PATH; pyzmq needed). Each conversation's first turn goes to one
daemon directly, so only the events say where its prefix is; every later turn, sent through
the router, lands on that daemon (a cache hit there), and every reply and its logprobs
equal a single daemon's, bit for bit. Also the probes the router reads: `/kv_event_sources`,
`kv_block_size` in `/get_server_info` (both only with --kv-events) and `/tokenize`."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from prefixd.ipc.sync_client import SyncClient
from tests.e2e.daemon_proc import LIVENESS_S, DaemonProcess, free_ports, serving
from tests.e2e.test_e2e_router import FOLLOW_UPS, conversation_starts, get_json, num_requests, post_json

pytest.importorskip("zmq")
VLLM_ROUTER = shutil.which("vllm-router")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(VLLM_ROUTER is None, reason="vllm-router is not installed (pip install vllm-router)")]
TURNS = 4
PAGE = 16  # --page-size's default: the events' block size


@pytest.fixture(scope="module")
def kv_daemons(tiny_llama_dir, tmp_path_factory):
    """Two daemons publishing KV events (map layout, with replay) and one alone without them."""
    ports = free_ports(7)  # distinct: three HTTP fronts, two publishers, two replay sockets
    http, pub, replay = ports[:3], ports[3:5], ports[5:]
    events = [["--kv-events", f"tcp://127.0.0.1:{pub[i]}?layout=map", "--kv-events-replay",
               f"tcp://127.0.0.1:{replay[i]}"] for i in range(2)] + [[]]
    gens = [serving(tiny_llama_dir, tmp_path_factory.mktemp(f"d_kv{i}"), "--lanes", "2", "--max-context", "1024",
                    "--cache-budget", "64M", "--dtype", "fp32", "--http", f"127.0.0.1:{port}", *events[i])
            for i, port in enumerate(http)]
    daemons = [next(gen) for gen in gens]
    yield daemons, [f"http://127.0.0.1:{port}" for port in http], pub, replay
    for gen in gens:
        for _ in gen:  # the rest of `serving`: SIGTERM and the clean exit
            pass


def kv_status(daemon: DaemonProcess) -> dict[str, Any]:
    with SyncClient(daemon.socket) as client:
        return client.status()["kv_events"]


@contextmanager
def kv_router(workdir: Path, daemons: list[DaemonProcess], urls: list[str], pub: list[int],
              replay: list[int]) -> Iterator[str]:
    """vllm-router --policy kv_aware with each daemon's event endpoints given (--kv-event-source),
    as 0.1.17 subscribes only to those; yields its base URL once it lists both workers and has
    applied a batch from each daemon (its subscriptions are live: a PUB drops what it sends
    before a subscription arrives)."""
    port, metrics_port = free_ports(2)
    sources = [a for i, url in enumerate(urls) for a in (
        "--kv-event-source", f"{url}=tcp://127.0.0.1:{pub[i]}",
        "--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{replay[i]}")]
    args = [VLLM_ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", "kv_aware",
            *sources, "--kv-event-block-size", str(PAGE), "--kv-event-model", "llama",
            "--worker-startup-check-interval", "1", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port), "--log-level", "debug"]
    log_path = workdir / "vllm-router.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + LIVENESS_S
        while not (_lists_workers(base, len(urls)) and all(
                f"subscriber for {url} rank0" in _plain(log_path) for url in urls)):
            assert proc.poll() is None and time.monotonic() < deadline, _plain(log_path)
            time.sleep(0.1)
        subscribed, attempt = [False] * len(urls), 0
        while not all(subscribed):  # a probe of its own (new pages) to each daemon not yet seen
            attempt += 1
            for i, (daemon, url) in enumerate(zip(daemons, urls)):
                if not subscribed[i]:
                    before = kv_status(daemon)["batches"]
                    chat(url, [{"role": "user", "content": f"Probe {attempt}: only the subscription is checked."}])
                    subscribed[i] = applied(daemon, url, log_path, before, wait=False)
            assert proc.poll() is None and time.monotonic() < deadline, _plain(log_path)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=LIVENESS_S)


def _lists_workers(base: str, count: int) -> bool:
    try:
        return len(get_json(f"{base}/get_loads")["workers"]) == count
    except (OSError, urllib.error.URLError, ValueError, KeyError):
        return False


def _plain(log_path: Path) -> str:
    """The router's log without its colour codes."""
    return re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text(errors="replace"))


def chat(base: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": "llama", "messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True}
    return post_json(f"{base}/v1/chat/completions", body)


APPLIED = re.compile(r"kv_index live sequence advanced source=(\S+) rank=0 seq=(\d+)")


def applied(daemon: DaemonProcess, url: str, log_path: Path, batches_before: int, *, wait: bool = True) -> bool:
    """Whether the router has applied `daemon`'s latest batch, once the daemon has published one
    since `batches_before` (the turn's pages): vllm-router logs each batch's sequence number as
    it applies it (debug level). With `wait`, until it has; else after the deadline's first
    tenth (a subscription not yet live never sees that batch)."""
    deadline = time.monotonic() + LIVENESS_S
    while (status := kv_status(daemon))["batches"] <= batches_before:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    last = status["next_seq"] - 1
    give_up = deadline if wait else time.monotonic() + LIVENESS_S / 10
    while not any(source == url and int(seq) >= last for source, seq in APPLIED.findall(_plain(log_path))):
        if time.monotonic() > give_up:
            assert not wait, f"the router never applied {url}'s batch {last}"
            return False
        time.sleep(0.02)
    return True


def next_turn(messages: list[dict[str, str]], reply: dict[str, Any], turn: int) -> None:
    messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    messages.append({"role": "user", "content": FOLLOW_UPS[turn]})


def test_daemons_tell_a_router_where_their_events_are(kv_daemons):
    daemons, urls, pub, replay = kv_daemons
    for i in range(2):
        assert get_json(f"{urls[i]}/kv_event_sources") == {"0": {
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub[i]}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay[i]}", "topic": "", "buffer_steps": 10_000, "hwm": 10_000}}
        info = get_json(f"{urls[i]}/get_server_info")
        assert (info["kv_block_size"], info["page_size"]) == (PAGE, PAGE)
    with pytest.raises(urllib.error.HTTPError) as missing:  # no --kv-events: nothing to find
        get_json(f"{urls[2]}/kv_event_sources")
    assert missing.value.code == 404
    assert "kv_block_size" not in get_json(f"{urls[2]}/get_server_info")
    messages = conversation_starts()[0]
    tokens = post_json(f"{urls[2]}/tokenize", {"model": "llama", "messages": messages})
    reply = chat(urls[2], messages)
    assert tokens["count"] == len(tokens["tokens"]) == reply["usage"]["prompt_tokens"]
    assert tokens["max_model_len"] == 1024
    assert tokens["tokens"][:4] == [1, 9690, 198, 2683]  # <|im_start|> system \n You: the chat template's


def test_kv_aware_vllm_router_follows_each_daemons_events_with_the_same_bits(kv_daemons, tmp_path):
    daemons, urls, pub, replay = kv_daemons
    routed, alone = urls[:2], urls[2]
    conversations = conversation_starts()
    replies: list[list[dict]] = [[] for _ in conversations]
    served: list[list[int]] = [[] for _ in conversations]
    log_path = tmp_path / "vllm-router.log"
    with kv_router(tmp_path, daemons[:2], routed, pub, replay) as base:
        # vllm-router 0.1.17 asks for no replay when it starts: it knows what is published from now on
        for c, messages in enumerate(conversations):  # turn 1 of conversation c straight to daemon c
            before = kv_status(daemons[c])["batches"]
            replies[c].append(chat(routed[c], messages))
            applied(daemons[c], routed[c], log_path, before)
            next_turn(messages, replies[c][0], 0)
        for turn in range(1, TURNS):
            for c, messages in enumerate(conversations):
                counts = [num_requests(u) for u in routed]
                batches = [kv_status(d)["batches"] for d in daemons[:2]]
                reply = chat(base, messages)
                after = [num_requests(u) for u in routed]
                served[c].append([i for i in range(2) if after[i] > counts[i]][0])
                applied(daemons[served[c][-1]], routed[served[c][-1]], log_path, batches[served[c][-1]])
                replies[c].append(reply)
                next_turn(messages, reply, turn)
    log = _plain(log_path)
    assert served == [[0] * (TURNS - 1), [1] * (TURNS - 1)], log
    for c in range(2):
        for turn in range(1, TURNS):
            usage, previous = replies[c][turn]["usage"], replies[c][turn - 1]["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= previous["prompt_tokens"], (c, turn)
    reference = [[] for _ in conversations]
    for c, messages in enumerate(conversation_starts()):
        for turn in range(TURNS):
            reference[c].append(chat(alone, messages))
            next_turn(messages, reference[c][-1], turn)
    for c in range(2):
        for got, want in zip(replies[c], reference[c], strict=True):
            assert got["choices"][0]["message"] == want["choices"][0]["message"]
            assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]  # floats, compared exactly
