"""The CLI's default sampling on the default model (its GGUF ships no settings: temperature
0.7, top-p 0.9, top-k 40 and no repetition penalty): a plain question's answer does not loop,
and a function asked back verbatim comes back unchanged with the defaults' penalty (none)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from prefixd.daemon.client_cli import _model_defaults, _sampling
from tests.e2e.daemon_proc import DaemonProcess

pytestmark = pytest.mark.slow

FUNCTIONS = ("def add(a, b):\n    return a + b", "def square(x):\n    return x * x")


def _cli_sampling(client, seed: int) -> dict:
    """What `prefixd chat` / `generate` send with no sampling flags."""
    flags = SimpleNamespace(greedy=False, temperature=None, top_p=None, top_k=None, min_p=None, repeat_penalty=None,
                            seed=seed)
    return _sampling(flags, _model_defaults(client))


def _most_repeated_trigram(text: str) -> int:
    words = text.split()
    return max(Counter(zip(words, words[1:], words[2:])).values(), default=0)


def test_the_default_answer_to_a_plain_question_does_not_loop(default_daemon: DaemonProcess):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with default_daemon.client() as client:
        for seed in (1, 2, 3):
            sampling = _cli_sampling(client, seed)
            assert sampling == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.0, "seed": seed}
            reply = client.generate(messages=question, max_tokens=64, sampling=sampling, cache=False).collect()
            assert _most_repeated_trigram(reply.text) <= 3, reply.text


@pytest.mark.parametrize("function", FUNCTIONS, ids=["add", "square"])
def test_a_function_asked_back_verbatim_comes_back_unchanged(default_daemon: DaemonProcess, function: str):
    """Greedy, with whatever penalty the defaults carry (a penalty of 1.1 alters both)."""
    ask = [{"role": "user", "content": f"Repeat this Python function exactly, with no changes:\n\n"
                                       f"```python\n{function}\n```"}]
    with default_daemon.client() as client:
        defaults = _cli_sampling(client, 0)
        sampling = {"temperature": 0.0, **{k: v for k, v in defaults.items() if k == "repetition_penalty"}}
        reply = client.generate(messages=ask, max_tokens=48, sampling=sampling, cache=False).collect()
    assert function in reply.text, reply.text
