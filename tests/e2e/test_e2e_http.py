"""The HTTP front of a real daemon on the default model: examples/agent_loop.py runs a
tool-using loop whose later turns report cached tokens, and a forced, constrained tool call
gives the same call and logprobs through HTTP as through the socket."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixd.ipc.sync_client import SyncClient
from tests.e2e.daemon_proc import free_ports, serving

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def http_daemon(default_model, tmp_path_factory):
    [port] = free_ports(1)
    for daemon in serving(default_model, tmp_path_factory.mktemp("d_http"), "--lanes", "2", "--max-context", "1024",
                          "--cache-budget", "256M", "--http", f"127.0.0.1:{port}"):
        yield daemon, f"http://127.0.0.1:{port}/v1"


def load_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("agent_loop", EXAMPLES / "agent_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agent_loop_later_turns_report_cached_tokens(http_daemon):
    _, base_url = http_daemon
    agent = load_example()
    turns = agent.run(openai.OpenAI(base_url=base_url, api_key="unused"), "default", "What is 17 times 23?")
    assert turns[0]["calls"] and turns[0]["calls"][0][0] == "multiply"  # forced by the grammar
    json.loads(turns[0]["calls"][0][1])
    assert len(turns) >= 2
    for turn in turns[1:]:
        assert turn["cached_tokens"] >= turns[0]["prompt_tokens"]


def test_forced_tool_call_and_logprobs_match_through_http_and_the_socket(http_daemon):
    daemon, base_url = http_daemon
    agent = load_example()
    messages = [{"role": "user", "content": "Multiply 6 by 7."}]
    reply = openai.OpenAI(base_url=base_url, api_key="unused").chat.completions.create(
        model="default", messages=messages, tools=agent.TOOLS, tool_choice="required", max_tokens=64,
        temperature=0.7, seed=11, logprobs=True, top_logprobs=2)
    with SyncClient(daemon.socket) as client:
        result = client.generate(messages=messages, tools=agent.TOOLS, tool_choice="required", max_tokens=64,
                                 sampling={"temperature": 0.7, "seed": 11}, logprobs=2).collect()
    http_call = reply.choices[0].message.tool_calls[0]
    assert (http_call.function.name, http_call.function.arguments) == (
        result.tool_calls[0]["function"]["name"], result.tool_calls[0]["function"]["arguments"])
    assert [e.logprob for e in reply.choices[0].logprobs.content] == [e["logprob"] for e in result.logprobs]
