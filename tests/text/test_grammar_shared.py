"""One llguidance tokenizer per model tokenizer: every connection's GrammarChecker and the
runner share it, so a constrained request costs no tokenizer build (a ~0.2-1 s stall of the
event loop and the engine thread, with the GIL held), and concurrent first requests build it
once."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("llguidance")

from prefixd.text import grammar  # noqa: E402
from prefixd.text.grammar import GrammarChecker, grammar_of, ll_tokenizer  # noqa: E402

REGEX = {"type": "regex", "regex": "[a-z ]{20}"}


def test_checkers_of_one_tokenizer_share_one_llguidance_tokenizer(tok, monkeypatch):
    builds = []
    real = grammar._build_ll_tokenizer
    monkeypatch.setattr(grammar, "_build_ll_tokenizer", lambda t: builds.append(t) or real(t))
    monkeypatch.setattr(grammar, "_shared", type(grammar._shared)())  # nothing built before this test
    first, second = GrammarChecker(tok), GrammarChecker(tok)  # two connections' builders
    first.check(grammar_of(REGEX))
    second.check(grammar_of(REGEX))
    assert second.ll_tokenizer is first.ll_tokenizer is ll_tokenizer(tok)
    assert builds == [tok]


def test_concurrent_first_uses_build_it_once(monkeypatch):
    builds = []

    def slow_build(tokenizer):
        builds.append(tokenizer)
        time.sleep(0.05)  # long enough for every thread to ask before the build ends
        return object()

    monkeypatch.setattr(grammar, "_build_ll_tokenizer", slow_build)

    class Model:
        """A tokenizer object not seen before."""

    model = Model()
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(ll_tokenizer(model))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(got) == 8 and all(g is got[0] for g in got)


def test_another_tokenizer_gets_its_own(monkeypatch):
    monkeypatch.setattr(grammar, "_build_ll_tokenizer", lambda t: object())

    class Model:
        pass

    a, b = Model(), Model()
    assert ll_tokenizer(a) is ll_tokenizer(a)
    assert ll_tokenizer(a) is not ll_tokenizer(b)
