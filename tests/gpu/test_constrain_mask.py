"""GrammarMask on its own (the tiny llama's 49152-id tokenizer, no model): its forbidden ids are
exactly llguidance's bitmask at every state, built on the caller's thread or the worker's; the
integer ops it applies on the CPU equal torch's masked_fill bit for bit (inf, NaN, -0.0 and
padded ids); a wrong token leaves only the end token; a failure on the worker reaches the
caller."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
llguidance = pytest.importorskip("llguidance")

from prefixd.gpu.constrain import GrammarMask  # noqa: E402
from prefixd.text.grammar import grammar_of, ll_tokenizer  # noqa: E402
from prefixd.text.tokenizer import Tokenizer  # noqa: E402

VOCAB = 49152
SCHEMA = {"type": "object", "required": ["name", "n"], "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
FORMATS = {
    "regex": ({"type": "regex", "regex": "[a-z ]{60}"}, "the river runs past old stone bridges and"),
    "json": ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, json.dumps({"name": "bees", "n": 12})),
}


@pytest.fixture(scope="module")
def tok(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def ll_tok(tok):
    return ll_tokenizer(tok)


def reference_forbidden(matcher, end_id: int) -> np.ndarray:
    """What the mask must be: llguidance's own bitmask, unpacked, the end token when it is empty."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:VOCAB]
    allowed = bits.astype(bool) if not matcher.is_error() else np.zeros(VOCAB, dtype=bool)
    if not allowed.any():
        allowed[end_id] = True
    return ~allowed


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_forbidden_ids_are_llguidances_bitmask_at_every_state(tok, ll_tok, name, background):
    fmt, text = FORMATS[name]
    grammar = grammar_of(fmt)
    mask = GrammarMask(ll_tok, grammar, vocab_size=VOCAB, background=background)
    ref = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    ids = tok.encode(text)
    for token in ids:
        expected = reference_forbidden(ref, ll_tok.eos_token)
        assert np.array_equal(mask.forbidden(), expected)
        assert not mask.forbidden()[token]  # the path is valid
        mask.advance(token)
        assert ref.consume_token(token)
    assert np.array_equal(mask.forbidden(), reference_forbidden(ref, ll_tok.eos_token))
    assert 0 < int((~mask.forbidden()).sum()) < VOCAB and mask.error is None


@pytest.mark.parametrize("padded", [0, 64])
@pytest.mark.parametrize("background", [False, True])
def test_applied_row_equals_masked_fill_bit_for_bit(ll_tok, background, padded):
    vocab = VOCAB + padded  # a model may pad its embedding rows past the tokenizer's ids
    mask = GrammarMask(ll_tok, grammar_of(FORMATS["regex"][0]), vocab_size=vocab, background=background)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g) * 30
    logits[1, ::7] = float("inf")
    logits[2, ::5] = float("nan")
    logits[3, ::3] = -0.0
    logits[3, 1::3] = float("-inf")
    before = logits.clone()
    forbidden = torch.from_numpy(mask.forbidden().copy())
    assert forbidden[VOCAB:].all() and not forbidden.all()
    for i in range(4):
        out = mask.apply(logits[i])  # a row view, as the runner passes it
        expected = logits[i].masked_fill(forbidden, float("-inf"))
        assert out.dtype == torch.float32 and out.shape == (vocab,)
        assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(logits.view(torch.int32), before.view(torch.int32))  # rows untouched


@pytest.mark.parametrize("background", [False, True])
def test_a_wrong_token_leaves_only_the_end_token(tok, ll_tok, background):
    mask = GrammarMask(ll_tok, grammar_of(FORMATS["regex"][0]), vocab_size=VOCAB, background=background)
    digit = tok.encode("7")[0]
    assert mask.forbidden()[digit]
    mask.advance(digit)
    assert mask.error is not None
    assert np.flatnonzero(mask.allowed()).tolist() == [ll_tok.eos_token]


def test_a_grammar_that_is_done_allows_only_the_end_token(tok, ll_tok):
    mask = GrammarMask(ll_tok, grammar_of({"type": "regex", "regex": "ab"}), vocab_size=VOCAB, background=True)
    for token in tok.encode("ab"):
        mask.advance(token)
    assert np.flatnonzero(mask.allowed()).tolist() == [ll_tok.eos_token]
    assert mask.error is None


def test_a_failure_on_the_worker_reaches_the_caller(ll_tok, monkeypatch):
    mask = GrammarMask(ll_tok, grammar_of(FORMATS["regex"][0]), vocab_size=VOCAB, background=True)
    mask.forbidden()

    def broken(self):
        raise RuntimeError("mask failed")

    monkeypatch.setattr(GrammarMask, "_compute", broken)
    mask.advance(int(mask.allowed().nonzero()[0][0]))
    with pytest.raises(RuntimeError, match="mask failed"):
        mask.apply(torch.zeros(VOCAB))


def test_masks_held_over_a_round_are_built_together_with_the_bits_each_builds_alone(tok, ll_tok):
    # What the CPU runner does: every lane advances inside held_masks, and their next masks are
    # built in one llguidance batch when the block ends (a wrong token's error state included).
    from prefixd.gpu.constrain import held_masks

    regex, json_schema = FORMATS["regex"][0], FORMATS["json"][0]
    streams = [(regex, "the river runs past"), (json_schema, json.dumps({"name": "bees", "n": 12})),
               (regex, "old stone"), (json_schema, '{"name": "x"')]
    masks = [GrammarMask(ll_tok, grammar_of(fmt), vocab_size=VOCAB) for fmt, _ in streams]
    refs = [llguidance.LLMatcher(ll_tok, grammar_of(fmt), log_level=0) for fmt, _ in streams]
    texts = [tok.encode(text) for _, text in streams]
    wrong = tok.encode("{")[0]  # not a letter: the first regex stream's last step puts it in error
    for step in range(max(map(len, texts))):
        with held_masks():
            for k, ids in enumerate(texts):
                if step < len(ids):
                    token = wrong if (k == 0 and step == len(ids) - 1) else ids[step]
                    masks[k].advance(token)
                    refs[k].consume_token(token)
            assert all(m._state is None for k, m in enumerate(masks) if step < len(texts[k]))  # held back
        for k, mask in enumerate(masks):
            assert mask._state is not None or step >= len(texts[k])  # built when the block ended
            assert np.array_equal(mask.forbidden(), reference_forbidden(refs[k], ll_tok.eos_token))
    assert masks[0].error is not None and np.flatnonzero(~masks[0].forbidden()).tolist() == [ll_tok.eos_token]


def test_a_failed_batch_walk_builds_each_mask_alone_and_a_failed_mask_fails_only_its_own_apply(ll_tok, monkeypatch):
    from prefixd.gpu import constrain

    class BrokenExecutor:
        def unsafe_compute_mask_ptr(self, *args):
            raise RuntimeError("batch walk failed")

    monkeypatch.setattr(constrain, "_mask_executor", lambda: BrokenExecutor())
    grammar = grammar_of(FORMATS["regex"][0])
    good, bad = (GrammarMask(ll_tok, grammar, vocab_size=VOCAB) for _ in range(2))
    ref = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    monkeypatch.setattr(bad, "_compute", lambda: (_ for _ in ()).throw(RuntimeError("this stream's mask failed")))
    token = ll_tok.tokenize_str("a")[0]
    with constrain.held_masks():
        for mask in (good, bad):
            mask.advance(token)
    ref.consume_token(token)
    assert np.array_equal(good.forbidden(), reference_forbidden(ref, ll_tok.eos_token))  # built alone
    with pytest.raises(RuntimeError, match="this stream's mask failed"):
        bad.apply(torch.zeros(VOCAB))
