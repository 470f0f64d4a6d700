"""The CLI's default sampling on the default model (its GGUF ships no settings: temperature
0.7, top-p 0.9, top-k 40 and no repetition penalty): a plain question's answer rarely loops,
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


SEEDS = range(1, 17)
MODEL_CARD_TEMPERATURE = 0.2  # SmolLM2's card; the defaults do not take it (docs/benchmarks.md, *Sampling defaults*)


def _loops(client, question: list[dict], sampling: dict) -> list[int]:
    """The seeds whose 64-token answer repeats a trigram more than 3 times."""
    looped = []
    for seed in SEEDS:
        reply = client.generate(messages=question, max_tokens=64, sampling={**sampling, "seed": seed},
                                cache=False).collect()
        if _most_repeated_trigram(reply.text) > 3:
            looped.append(seed)
    return looped


def test_the_default_answer_to_a_plain_question_rarely_loops(default_daemon: DaemonProcess):
    """Over 16 seeds, at most 2 default answers loop (measured: 0 with int4 revision 6, 1 with
    revision 7), where the model card's temperature loops on most (measured 14 of 16 with
    both): which answer loops moves with any change to the numerics, how often does not."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with default_daemon.client() as client:
        sampling = _cli_sampling(client, 0)
        assert sampling == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.0, "seed": 0}
        defaults = _loops(client, question, sampling)
        card = _loops(client, question, {**sampling, "temperature": MODEL_CARD_TEMPERATURE})
    assert len(defaults) <= 2, f"default answers looped for seeds {defaults}"
    assert len(card) >= len(SEEDS) // 2, f"temperature {MODEL_CARD_TEMPERATURE} looped only for seeds {card}"


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
