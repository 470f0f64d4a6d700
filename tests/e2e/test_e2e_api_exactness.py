"""One conversation through Chat Completions, Messages, Responses and the socket, on the
default model: the same token ids and logits bits (the `prefixd` request extension asks for
them) whichever API carries it, and whether its turn runs cold, resumes from the cache, runs
beside seven other streams, or runs with drafting off (the daemon drafts with n-grams)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import httpx
import pytest

from prefixd.ipc.sync_client import SyncClient
from tests.e2e.daemon_proc import free_ports, serving

pytestmark = pytest.mark.slow

SYSTEM = ("You are a terse assistant for a developer. Answer in one short sentence, quote paths exactly, "
          "and never invent a file that the user did not name.")
FIRST = "Which file holds the settings in a Django project?"
SECOND = "And where do the URL routes live?"
MAX_TOKENS = 12
DRAFT_TRIES = 8  # reference generates until one drafts (see the first test)
EXTENSION = {"logits": True}


@pytest.fixture(scope="module")
def daemon(default_model, tmp_path_factory):
    [port] = free_ports(1)
    for d in serving(default_model, tmp_path_factory.mktemp("d_apis"), "--lanes", "8", "--max-context", "1024",
                     "--cache-budget", "256M", "--disk-cache", "", "--draft", "ngram", "--http", f"127.0.0.1:{port}"):
        yield d, f"http://127.0.0.1:{port}"


def turn(reply: str | None) -> list[dict[str, str]]:
    """The conversation's messages (no system): its first turn, or its second after `reply`."""
    messages = [{"role": "user", "content": FIRST}]
    if reply is not None:
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": SECOND}]
    return messages


def chat(base: str, messages: list[dict], namespace: str, max_tokens: int = MAX_TOKENS, **ext: Any) -> dict:
    body = {"model": "default", "messages": [{"role": "system", "content": SYSTEM}, *messages],
            "max_tokens": max_tokens, "temperature": 0, "logprobs": True, "prefixd": {**EXTENSION, **ext}}
    out = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"x-prefixd-namespace": namespace},
                     timeout=120).raise_for_status().json()
    return {"text": out["choices"][0]["message"]["content"], **out["usage"]["prefixd"],
            "cached": out["usage"]["prompt_tokens_details"]["cached_tokens"],
            "logprobs": [e["logprob"] for e in out["choices"][0]["logprobs"]["content"]]}


def messages_api(base: str, messages: list[dict], namespace: str, **ext: Any) -> dict:
    body = {"model": "default", "system": SYSTEM, "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0, "prefixd": {**EXTENSION, **ext}}
    out = httpx.post(f"{base}/v1/messages", json=body, headers={"x-prefixd-namespace": namespace},
                     timeout=120).raise_for_status().json()
    return {"text": "".join(b["text"] for b in out["content"] if b["type"] == "text"), **out["usage"]["prefixd"],
            "cached": out["usage"]["cache_read_input_tokens"]}


def responses_api(base: str, messages: list[dict], namespace: str, **ext: Any) -> dict:
    body = {"model": "default", "instructions": SYSTEM, "input": messages, "max_output_tokens": MAX_TOKENS,
            "temperature": 0, "store": False, "prefixd": {**EXTENSION, **ext}}
    out = httpx.post(f"{base}/v1/responses", json=body, headers={"x-prefixd-namespace": namespace},
                     timeout=120).raise_for_status().json()
    text = "".join(part["text"] for item in out["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    return {"text": text, **out["usage"]["prefixd"], "cached": out["usage"]["input_tokens_details"]["cached_tokens"]}


APIS: dict[str, Callable[..., dict]] = {"chat": chat, "messages": messages_api, "responses": responses_api}


def bits(result: dict) -> tuple:
    return tuple(result["ids"]), tuple(result["logits_sha256"])


@pytest.fixture(scope="module")
def first_reply(daemon) -> str:
    _, base = daemon
    return chat(base, turn(None), "first-reply")["text"]


def test_every_api_gives_the_socket_s_ids_logits_and_logprobs(daemon, first_reply):
    proc, base = daemon
    messages = [{"role": "system", "content": SYSTEM}, *turn(first_reply)]
    # The drafter drafts where its measured round costs say it pays (scheduler/draftpolicy.py):
    # on a loaded machine a short reply may go undrafted. Each try, drafted or not, must give
    # the same bits; the first drafted one is the reference (draft "off" below differs in its rounds).
    with SyncClient(proc.socket) as client:
        for attempt in range(DRAFT_TRIES):
            solo = client.generate(messages=messages, max_tokens=MAX_TOKENS, sampling={"temperature": 0},
                                   logits=True, logprobs=0, namespace=f"socket-cold-{attempt}").collect()
            got = (tuple(solo.ids), tuple(solo.logits_sha256))
            want = got if attempt == 0 else want
            assert got == want, attempt
            if solo.usage.draft_tokens > 0:
                break
    assert len(solo.ids) >= MAX_TOKENS // 2  # several tokens to compare (the model may end before MAX_TOKENS)
    assert solo.usage.draft_tokens > 0, f"no try of {DRAFT_TRIES} drafted (--draft ngram)"
    for name, api in APIS.items():
        got = api(base, turn(first_reply), f"{name}-cold")
        assert bits(got) == want, name
        assert got["cached"] == 0, name  # a namespace of its own: nothing cached for it
    assert chat(base, turn(first_reply), "chat-cold-again")["logprobs"] == [e["logprob"] for e in solo.logprobs]


def test_cold_resumed_beside_seven_and_undrafted_agree_on_every_api(daemon, first_reply):
    _, base = daemon
    want = bits(chat(base, turn(first_reply), "reference"))
    for name, api in APIS.items():
        api(base, turn(None), f"{name}-resumed")  # turn 1, kept by the cache
        resumed = api(base, turn(first_reply), f"{name}-resumed")
        assert resumed["cached"] > 0, name
        assert bits(resumed) == want, name
        assert bits(api(base, turn(first_reply), f"{name}-undrafted", draft="off")) == want, name

        beside: dict[int, dict] = {}
        others = [threading.Thread(target=lambda i=i: beside.__setitem__(i, chat(
            base, [{"role": "user", "content": f"Count from {i} to {i + 40}, one number a line."}],
            f"{name}-other-{i}", max_tokens=160, logits=False))) for i in range(7)]
        for t in others:
            t.start()
        crowded = api(base, turn(first_reply), f"{name}-beside")
        for t in others:
            t.join(timeout=300)
        assert len(beside) == 7, name
        assert bits(crowded) == want, name
