"""The daemon through its real socket, on the default model and on a tiny random llama:
chat, generate from text and from token ids, cancel, status, tokenize/detokenize, and the
CLI's `generate --json` and `status --json`."""

from __future__ import annotations

import json
import subprocess

import pytest

from prefixd.ipc.events import DoneEvent, TokenEvent
from tests.e2e.daemon_proc import PREFIXD, DaemonProcess, idle_view, process_env
from tests.helpers.device import TEST_DEVICE

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
USER = {"role": "user", "content": "Name three primary colours."}
RENDERED = (
    "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
    "<|im_start|>user\nName three primary colours.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
LONG_PROMPT = "Count from one to one thousand, one number per line, without stopping:\n"
CLI_TIMEOUT_S = 300  # a bound on a hung CLI, never asserted


@pytest.fixture(scope="module", params=[pytest.param("default", marks=pytest.mark.slow), "tiny"])
def daemon(request: pytest.FixtureRequest) -> DaemonProcess:
    return request.getfixturevalue(f"{request.param}_daemon")


def test_status_describes_the_model_and_idle_lanes(daemon: DaemonProcess, request: pytest.FixtureRequest):
    status = daemon.status()
    model = status["model"]
    assert (model["family"], model["vocab_size"], model["device"], model["lanes"]) == ("llama", 49152, TEST_DEVICE, 8)
    assert model["hidden_size"] == (576 if "default" in request.node.callspec.id else 64)
    assert status["socket"] == str(daemon.socket)
    assert status["max_context"] == 1024
    assert [lane["state"] for lane in status["lanes"]].count("busy") == status["lanes_busy"] == 0
    assert len(status["lanes"]) == 8
    assert status["waiting"] == 0
    assert status["store"]["budget_bytes"] > 0


def test_tokenize_and_detokenize_round_trip(daemon: DaemonProcess):
    text = "Hello, world! Ünïcödé ✓ 12345"
    with daemon.client() as client:
        ids = client.tokenize(text, add_special=False).ids
        assert client.detokenize(ids) == text
        chat = client.tokenize(messages=[SYSTEM, USER])
        header = client.tokenize("<|im_start|>assistant\n", add_special=False).ids
        assert client.detokenize(chat.ids) == RENDERED
        starts = chat.message_starts
        assert starts is not None and len(starts) == 3 and starts[0] == 0
        assert client.detokenize(chat.ids[starts[1]:starts[2]]) == "<|im_start|>user\nName three primary colours.<|im_end|>\n"
        assert chat.ids[starts[2]:] == header


def test_chat_messages_equal_their_token_ids_with_the_same_starts(daemon: DaemonProcess):
    with daemon.client() as client:
        chat = client.tokenize(messages=[SYSTEM, USER])
        by_messages = client.generate(messages=[SYSTEM, USER], max_tokens=6, logits=True, cache=False).collect()
        by_tokens = client.generate(tokens=chat.ids, chunk_starts=chat.message_starts, max_tokens=6, logits=True,
                                    cache=False).collect()
        text = client.detokenize(by_messages.ids)
    assert (by_tokens.ids, by_tokens.logits_sha256) == (by_messages.ids, by_messages.logits_sha256)
    assert by_messages.finish_reason in ("length", "stop")
    assert len(by_messages.ids) == len(by_messages.logits_sha256) == by_messages.usage.completion_tokens
    assert len(by_messages.ids) == 6 or by_messages.finish_reason == "stop"
    assert by_messages.usage.prompt_tokens == len(chat.ids)
    assert (by_messages.usage.cache, by_messages.usage.cached_tokens, by_messages.usage.prefilled_tokens) == (
        "off", 0, len(chat.ids))
    assert by_messages.text == text


def test_text_prompt_equals_its_token_ids(daemon: DaemonProcess):
    prompt = "The capital of France is"
    with daemon.client() as client:
        ids = client.tokenize(prompt).ids
        by_text = client.generate(prompt=prompt, max_tokens=5, logits=True, cache=False).collect()
        by_tokens = client.generate(tokens=ids, max_tokens=5, logits=True, cache=False).collect()
    assert (by_text.ids, by_text.logits_sha256, by_text.text) == (by_tokens.ids, by_tokens.logits_sha256, by_tokens.text)
    assert by_text.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("cache", [False, True])
def test_cancel_mid_stream_ends_cancelled_and_frees_the_lane(daemon: DaemonProcess, cache: bool):
    before = idle_view(daemon.status())
    with daemon.client() as client:
        with client.generate(prompt=LONG_PROMPT, max_tokens=900, cache=cache, namespace="cancel") as stream:
            events = iter(stream)
            first = next(events)
            assert isinstance(first, TokenEvent)
            busy = client.status()
            stream.cancel()
            rest = list(events)
        after = client.status()
    done = rest[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled"
    assert all(isinstance(event, TokenEvent) for event in rest[:-1])
    received = len(first.ids) + sum(len(event.ids) for event in rest[:-1])
    assert done.usage.completion_tokens == received < 900
    assert busy["lanes_busy"] == 1
    assert (after["lanes_busy"], after["waiting"]) == (0, 0)
    if not cache:  # nothing kept: every page the stream held is free again
        assert idle_view(after) == before


def _cli(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PREFIXD, *args, "--socket", str(daemon.socket)], capture_output=True, text=True,
                          env=process_env(), timeout=CLI_TIMEOUT_S)


def test_cli_generate_json_matches_the_client(daemon: DaemonProcess):
    out = _cli(daemon, "generate", "--prompt", "Name a colour.", "--max-tokens", "4", "--no-cache", "--greedy", "--json")
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    with daemon.client() as client:
        direct = client.generate(messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4,
                                 cache=False).collect()
    assert set(printed) == {"text", "tokens", "finish_reason", "usage", "sampling"}
    assert (tuple(printed["tokens"]), printed["text"], printed["finish_reason"]) == (
        direct.ids, direct.text, direct.finish_reason)
    assert printed["usage"]["prompt_tokens"] == direct.usage.prompt_tokens
    assert printed["usage"]["completion_tokens"] == len(printed["tokens"])
    assert printed["usage"]["cache"] == "off"


def test_cli_status_json_prints_the_status_map(daemon: DaemonProcess):
    out = _cli(daemon, "status", "--json")
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["socket"] == str(daemon.socket)
    assert printed["lanes_busy"] == 0
    assert printed["model"] == daemon.status()["model"]
