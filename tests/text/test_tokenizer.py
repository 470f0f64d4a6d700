"""Tokenizer: GGUF and tokenizer.json builds agree with transformers; special tokens come
from the model; padded ids decode to nothing; streaming detokenization is UTF-8 safe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefixd.text.tokenizer import StreamDecoder, Tokenizer, TokenizerError

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, Apollo 11 landed; 3.14159 and 1,000,000 and 007 and 2024-11-29.",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    "fn main() { println!(\"{}\", 42); }\t\tlet v: Vec<u8> = vec![];",
    "Unicode: naïve café, Ærøskøbing, Straße, 東京タワー, 한국어, Ελληνικά, русский.",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 and ✨sparkles✨",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\nnewlines\n\n\n  mixed \r\n windows line",
    "multiple     interior      spaces and\u00a0nbsp",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside and <|im_end|>",
    "Don't you'll we've they're I'm he'd it's SHOUTING'S",
    "",
    " ",
    "x" * 300,
    "12345678901234567890",
    "a😀b",
]


@pytest.mark.slow
def test_gguf_ids_equal_transformers_gguf_tokenizer(tok: Tokenizer, default_gguf: Path) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    for text in CORPUS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text


def test_hf_dir_ids_equal_gguf_ids(tok: Tokenizer, tiny_llama_dir: Path) -> None:
    hf = Tokenizer.from_hf_dir(tiny_llama_dir)
    for text in CORPUS:
        assert hf.encode(text) == tok.encode(text), text
    assert (hf.bos_id, hf.eos_id, hf.vocab_size) == (1, 2, 49152)
    assert 2 in hf.stop_ids
    assert hf.chat_template == tok.chat_template


def test_digits_split_one_by_one_for_smollm(tok: Tokenizer) -> None:
    ids = tok.encode("2024")
    assert [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_special_token_text_becomes_one_id(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert (tok.token_id("<|im_end|>"), tok.token_id("no such token")) == (2, None)
    assert tok.decode([1, 4093, 2]) == "<|im_start|>user<|im_end|>"


def test_special_ids_come_from_metadata(gguf_fields: dict[str, Any]) -> None:
    tok = Tokenizer.from_gguf_fields(gguf_fields)
    assert (tok.bos_id, tok.eos_id, tok.stop_ids, tok.add_bos) == (1, 2, frozenset({2}), False)
    changed = dict(gguf_fields)
    changed["tokenizer.ggml.eos_token_id"] = 0
    changed["tokenizer.ggml.eot_token_id"] = 2
    changed["tokenizer.ggml.add_bos_token"] = True
    other = Tokenizer.from_gguf_fields(changed)
    assert (other.eos_id, other.stop_ids, other.add_bos) == (0, frozenset({0, 2}), True)
    assert other.encode("hi", add_special=True) == [1, *other.encode("hi")]


def test_roundtrip_decode(tok: Tokenizer) -> None:
    for text in CORPUS:
        assert tok.decode(tok.encode(text)) == text


def test_padded_ids_decode_to_nothing(tok: Tokenizer) -> None:
    hello = tok.encode("hello")
    assert tok.vocab_size == 49152
    assert tok.decode([*hello, 49152, 49200, *hello]) == "hellohello"
    assert tok.token_bytes(49152) == b""
    assert tok.token_bytes(-1) == b""


def test_warm_builds_every_ids_bytes_up_front(gguf_fields: dict[str, Any], monkeypatch) -> None:
    """After warm(), token_bytes spells nothing more: the table the first streamed token would
    have built (every id's bytes) is there, equal to what spelling each id gives."""
    fresh = Tokenizer.from_gguf_fields(gguf_fields)
    fresh.warm()
    want = {i: Tokenizer._spell_bytes(fresh, i) for i in (0, 1, 300, 12345, fresh.vocab_size - 1)}

    def spelled(self, token_id: int) -> bytes:
        raise AssertionError(f"token {token_id} spelled after warm()")

    monkeypatch.setattr(Tokenizer, "_spell_bytes", spelled)
    assert {i: fresh.token_bytes(i) for i in want} == want


def test_token_bytes_concatenate_to_utf8(tok: Tokenizer) -> None:
    for text in CORPUS:
        assert b"".join(tok.token_bytes(i) for i in tok.encode(text)) == text.encode("utf-8")


def test_stream_decoder_holds_split_characters(tok: Tokenizer) -> None:
    text = "a😀b 東京 👨‍👩‍👧 é"
    ids = tok.encode(text)
    per_token_bytes = [tok.token_bytes(i) for i in ids]
    assert any(not _is_utf8(b) for b in per_token_bytes), "corpus must split a character"
    stream = StreamDecoder(tok)
    pieces = [stream.push([i]) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert "😀" in pieces  # the emoji comes out whole, in one piece


def test_stream_decoder_flush_replaces_incomplete_tail(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    stream = StreamDecoder(tok)
    assert stream.push(ids[:1]) == ""
    assert stream.flush() == "\ufffd"


def test_missing_or_unsupported_tokenizer_metadata_raises(gguf_fields: dict[str, Any]) -> None:
    no_model = {k: v for k, v in gguf_fields.items() if k != "tokenizer.ggml.model"}
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf_fields(no_model)
    with pytest.raises(TokenizerError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_fields({k: v for k, v in gguf_fields.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(TokenizerError, match="pre-tokenizer"):
        Tokenizer.from_gguf_fields({**gguf_fields, "tokenizer.ggml.pre": "no-such-pre"})


def test_pre_tokenizer_follows_metadata_name(gguf_fields: dict[str, Any]) -> None:
    """llama-bpe and qwen2 keep a newline run whole before a word; gpt2-style (smollm) leaves
    the last newline to the word's side of the split."""
    smollm = Tokenizer.from_gguf_fields(gguf_fields)
    for pre in ("llama-bpe", "qwen2"):
        other = Tokenizer.from_gguf_fields({**gguf_fields, "tokenizer.ggml.pre": pre})
        assert other.encode("x\n\n\ny") == [104, 16506, 105]
    assert smollm.encode("x\n\n\ny") == [104, 1116, 198, 105]


def test_missing_tokenizer_json_raises(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# --- sentencepiece ("llama") GGUF vocabularies: Llama 2 / Mistral style ---

SPM_CORPUS = [
    "Hello world, how are you?",
    "  two leading spaces and trailing  ",
    "emoji 😀 falls back to bytes; 東京 too",
    "code:\n\tdef f(x): return x*2\n",
    "numbers 1234 and 3.14",
]


@pytest.fixture(scope="module")
def spm_fields(tok: Tokenizer) -> dict[str, Any]:
    """A sentencepiece-style vocabulary made from the default vocabulary's text pieces:
    <unk>, <s>, </s>, 256 byte tokens, then pieces scored by their original rank."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    seen = set(tokens)
    for i in range(tok.vocab_size):
        try:
            text = tok.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            continue
        piece = text.replace(" ", "\u2581")
        if piece and piece not in seen and "\n" not in piece and "<|" not in piece:
            seen.add(piece)
            tokens.append(piece)
            types.append(1)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


def test_spm_roundtrip_prefix_and_byte_fallback(spm_fields: dict[str, Any]) -> None:
    spm = Tokenizer.from_gguf_fields(spm_fields)
    assert spm.add_bos and spm.encode("hi", add_special=True)[0] == 1
    for text in SPM_CORPUS:
        assert spm.decode(spm.encode(text)) == text
    hello = spm.encode("Hello")
    assert spm.token_text(hello[0]) == "\u2581Hello"
    emoji = spm.encode("😀")
    assert [spm.token_text(i) for i in emoji[-4:]] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert b"".join(spm.token_bytes(i) for i in emoji[-4:]) == "😀".encode()
    # The space prefix is added again after a special token, as llama.cpp does.
    assert spm.encode("<s>Hello") == [1, *hello]


def test_spm_chat_starts_map_through_char_offsets(spm_fields: dict[str, Any]) -> None:
    source = "{% for m in messages %}<s>[{{ m.role }}] {{ m.content }}</s>{% endfor %}"
    spm = Tokenizer.from_gguf_fields({**spm_fields, "tokenizer.chat_template": source})
    rendered = spm.render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                               add_generation_prompt=False)
    assert [rendered.ids[s] for s in rendered.message_starts] == [1, 1]


@pytest.mark.slow
def test_spm_ids_equal_transformers(spm_fields: dict[str, Any], tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tests.helpers.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "spm.gguf", tiny_llama_dir, extra_keys=spm_fields,
                           drop_keys=("tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    spm = Tokenizer.from_gguf_fields(spm_fields)
    for text in SPM_CORPUS:
        if not text.startswith(" "):
            assert spm.encode(text) == ref.encode(text, add_special_tokens=False), text


def test_spm_leading_spaces_keep_the_prefix_space(spm_fields: dict[str, Any]) -> None:
    """llama.cpp prepends one space even to text that starts with spaces (transformers'
    Metaspace folds it into them); we follow llama.cpp, whose GGUF format this is."""
    spm = Tokenizer.from_gguf_fields(spm_fields)
    text = "  two"
    assert "".join(spm.token_text(i) or "" for i in spm.encode(text)) == "\u2581\u2581\u2581two"


def test_hf_stop_ids_include_generation_config_eos(tmp_path: Path, tiny_llama_dir: Path) -> None:
    import json
    import shutil

    root = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, root)
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = Tokenizer.from_hf_dir(root)
    assert (hf.eos_id, hf.stop_ids) == (2, frozenset({0, 2}))


class _RecordingBackend:
    """A tokenizers backend that records which calls it gets (and makes them)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        return getattr(self._backend, name)


def test_long_texts_and_id_lists_use_the_gil_releasing_batch_calls(tok: Tokenizer) -> None:
    """A long encode or decode goes through `*_batch` (which releases the GIL, so a huge chat
    render does not stall the engine thread) and gives the same ids and text as the
    single-item call; short ones keep the single-item call."""
    from prefixd.text.tokenizer import UNLOCKED_DECODE_IDS, UNLOCKED_ENCODE_CHARS

    backend = tok._backend
    long_text = " ".join(CORPUS) * (UNLOCKED_ENCODE_CHARS // len(" ".join(CORPUS)) + 1)
    expected = backend.encode(long_text, add_special_tokens=False).ids
    assert len(long_text) > UNLOCKED_ENCODE_CHARS and len(expected) > UNLOCKED_DECODE_IDS
    recorder = _RecordingBackend(backend)
    tok._backend = recorder
    try:
        assert tok.encode(long_text) == expected
        assert tok.token_char_starts(long_text) == [s for s, _ in backend.encode(long_text).offsets]
        assert tok.decode(expected) == backend.decode(expected, skip_special_tokens=False)
        assert recorder.calls == ["encode_batch", "encode_batch", "decode_batch"]
        recorder.calls.clear()
        assert tok.encode(CORPUS[0]) == backend.encode(CORPUS[0], add_special_tokens=False).ids
        assert tok.decode(expected[:8]) == backend.decode(expected[:8], skip_special_tokens=False)
        assert recorder.calls == ["encode", "decode"]
    finally:
        tok._backend = backend
