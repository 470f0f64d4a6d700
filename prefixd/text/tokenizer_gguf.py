"""Tokenizer backends from GGUF metadata, built with the `tokenizers` package.

Two vocabulary kinds: "gpt2" (byte-level BPE with merges and a pre-tokenizer named by
`tokenizer.ggml.pre`) and "llama" (sentencepiece pieces with scores and byte-fallback
tokens <0xNN>; merges are recovered from the scores: a pair merges with the rank of the
piece it makes). Token types mark control tokens (special) and user-defined ones (matched
whole, not special).
"""

from __future__ import annotations

from typing import Any, Mapping

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

# Pre-tokenizer split rules by GGUF `tokenizer.ggml.pre` name (the merges were learned on
# text split this way).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS: dict[str, tuple[str, bool]] = {  # name -> (regex, ignore_merges)
    **{n: (_LLAMA3_SPLIT, True) for n in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3")},
    **{n: (_QWEN2_SPLIT, False) for n in ("qwen2", "deepseek-r1-qwen")},
}
_DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
_GPT2_PRES = frozenset({"default", "gpt-2", "gpt2", "olmo", "jais"})

_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4


class TokenizerError(ValueError):
    """The model's tokenizer data is missing, malformed or of an unsupported kind."""


def _pre_tokenizer(pre: str | None) -> tuple[Any, bool]:
    """(pre_tokenizer, ignore_merges) for a GGUF pre-tokenizer name."""
    if pre in _PRE_SPLITS:
        regex, ignore_merges = _PRE_SPLITS[pre]
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), ignore_merges
    if pre in _DIGIT_SPLIT_PRES:
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]), False
    if pre is None or pre in _GPT2_PRES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    raise TokenizerError(f"tokenizer.ggml.pre: unsupported pre-tokenizer {pre!r}")


def _added_tokens(backend: _HFTokenizer, tokens: list[str], types: list[int]) -> None:
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _TOKEN_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def _first_ids(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    return vocab


def _bpe_backend(fields: Mapping[str, Any], tokens: list[str]) -> _HFTokenizer:
    merges = fields.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError("tokenizer.ggml.merges: missing")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    pre, ignore_merges = _pre_tokenizer(fields.get("tokenizer.ggml.pre"))
    backend = _HFTokenizer(models.BPE(vocab=_first_ids(tokens), merges=pairs, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    return backend


def spm_merges(tokens: list[str], scores: list[float], mergeable: list[bool]) -> list[tuple[str, str]]:
    """Merges implied by a sentencepiece vocabulary: every split of a piece into two pieces,
    ranked by the merged piece's score (best first), then by the halves' ids."""
    vocab = _first_ids(tokens)
    found: list[tuple[float, int, int, str, str]] = []
    for piece, pid in vocab.items():
        if not mergeable[pid]:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[pid], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _spm_backend(fields: Mapping[str, Any], tokens: list[str], types: list[int]) -> _HFTokenizer:
    scores = list(fields.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise TokenizerError("tokenizer.ggml.scores: missing or not one per token")
    mergeable = [t in (_TOKEN_NORMAL, _TOKEN_USER_DEFINED) for t in types] if types else [True] * len(tokens)
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    model = models.BPE(vocab=_first_ids(tokens), merges=spm_merges(tokens, scores, mergeable), unk_token=unk,
                       fuse_unk=True, byte_fallback=True)
    backend = _HFTokenizer(model)
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    # Spaces become U+2581 and, as llama.cpp does, one is prepended to the text and after every
    # special token (normalizers run on each run of text between special tokens). Leading
    # spaces are kept as they are (Metaspace would merge the prefix into them).
    steps_in = [normalizers.Prepend("\u2581")] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps_in, normalizers.Replace(" ", "\u2581")])
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def build_gguf_backend(fields: Mapping[str, Any]) -> tuple[_HFTokenizer, bool]:
    """(backend, byte_level) for GGUF tokenizer metadata; TokenizerError names the key."""
    kind = fields.get("tokenizer.ggml.model")
    if kind is None:
        raise TokenizerError("tokenizer.ggml.model: missing (the file has no tokenizer)")
    if kind not in ("gpt2", "llama"):
        raise TokenizerError(f"tokenizer.ggml.model: unsupported tokenizer model {kind!r} (have: gpt2, llama)")
    tokens: list[str] = list(fields.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise TokenizerError("tokenizer.ggml.tokens: missing")
    types = [int(t) for t in fields.get("tokenizer.ggml.token_type") or []]
    if types and len(types) != len(tokens):
        raise TokenizerError("tokenizer.ggml.token_type: not one per token")
    backend = _bpe_backend(fields, tokens) if kind == "gpt2" else _spm_backend(fields, tokens, types)
    _added_tokens(backend, tokens, types)
    return backend, kind == "gpt2"
