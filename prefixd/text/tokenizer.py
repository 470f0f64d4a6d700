"""Tokenizer: byte-level BPE from GGUF metadata or a tokenizer.json, plus chat rendering.

Built on the `tokenizers` package. Special tokens (BOS, EOS, end-of-turn) come from the
model's own metadata. Ids at or past the tokenizer's vocabulary (padded embedding rows)
decode to nothing. No torch here.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from tokenizers import Tokenizer as _HFTokenizer

from prefixd.text.chat import ChatTemplate, RenderedChat, load_hf_templates, render_conversation
from prefixd.text.tokenizer_gguf import TokenizerError, build_gguf_backend

__all__ = ["RenderedChat", "StreamDecoder", "Tokenizer", "TokenizerError"]

# Longer inputs go through the `*_batch` calls, which release the GIL while the Rust side
# works; the single-item calls hold it throughout, stalling the engine thread and the loop.
UNLOCKED_ENCODE_CHARS = 4096
UNLOCKED_DECODE_IDS = 1024

def _byte_decoder() -> dict[str, int]:
    """Inverse of byte-level BPE's byte -> printable-char spelling."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = dict(zip(printable, printable))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_decoder()


def _token_text(value: Any) -> str | None:
    """A tokenizer_config special-token entry: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Text <-> ids for one model, its special tokens, and its chat template."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        vocab_size: int,
        bos_id: int | None,
        eos_id: int | None,
        stop_ids: frozenset[int],
        add_bos: bool,
        chat_template: str | None,
        named_templates: Mapping[str, str] | None = None,
        byte_level: bool = True,
    ) -> None:
        self._backend = backend
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids = stop_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._named_templates = dict(named_templates or {})
        self._byte_level = byte_level
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._templates: dict[str, ChatTemplate] = {}
        self._bytes_table: list[bytes] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (for the render process) without the caches, which rebuild on use."""
        return {**self.__dict__, "_templates": {}, "_bytes_table": None}

    # --- construction ---------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata values (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        backend, byte_level = build_gguf_backend(fields)
        tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
        default_bos = fields.get("tokenizer.ggml.model") == "llama"  # sentencepiece models start with BOS

        def opt_id(key: str) -> int | None:
            value = fields.get(key)
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos, eos = opt_id("tokenizer.ggml.bos_token_id"), opt_id("tokenizer.ggml.eos_token_id")
        ends = {opt_id(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")} - {None}
        template = fields.get("tokenizer.chat_template")
        return cls(
            backend,
            vocab_size=len(tokens),
            bos_id=bos,
            eos_id=eos,
            stop_ids=frozenset(int(i) for i in ends if i is not None),
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", default_bos)),
            chat_template=template if isinstance(template, str) else None,
            byte_level=byte_level,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from tokenizer.json (+ tokenizer_config.json, chat_template.jinja, config.json,
        generation_config.json when present). TokenizerError names the missing file/key."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{tok_file}: missing tokenizer.json")
        try:
            backend = _HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the tokenizers package raises bare Exceptions on bad JSON
            raise TokenizerError(f"{tok_file}: cannot parse: {exc}") from exc
        tok_cfg = _read_json(root / "tokenizer_config.json")
        model_cfg = _read_json(root / "config.json")
        gen_cfg = _read_json(root / "generation_config.json")

        def id_of(key: str) -> int | None:
            text = _token_text(tok_cfg.get(key))
            found = backend.token_to_id(text) if text is not None else None
            if found is None and isinstance(model_cfg.get(f"{key}_id"), int):
                found = model_cfg[f"{key}_id"]
            return found

        bos, eos = id_of("bos_token"), id_of("eos_token")
        ends: set[int] = {eos} if eos is not None else set()
        for cfg in (model_cfg, gen_cfg):
            value = cfg.get("eos_token_id")
            ends.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
        if "add_bos_token" in tok_cfg:
            add_bos = bool(tok_cfg["add_bos_token"])
        else:
            with_special = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and len(with_special) > 0 and with_special[0] == bos
        default, named = load_hf_templates(root, tok_cfg)
        model = json.loads(backend.to_str()).get("model", {})
        return cls(
            backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_id=bos,
            eos_id=eos,
            stop_ids=frozenset(ends),
            add_bos=add_bos,
            chat_template=default,
            named_templates=named,
            byte_level=not model.get("byte_fallback", False),
        )

    # --- text <-> ids -----------------------------------------------------------------

    def encode(self, text: str, *, add_special: bool = False) -> list[int]:
        """Ids of `text`; special-token text (e.g. <|im_start|>) becomes its id. With
        add_special, BOS is prepended when the model asks for it (add_bos)."""
        ids = self._encoding(text).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included; ids without a token decode to nothing."""
        kept = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        if len(kept) > UNLOCKED_DECODE_IDS:
            return self._backend.decode_batch([kept], skip_special_tokens=False)[0]
        return self._backend.decode(kept, skip_special_tokens=False)

    def _encoding(self, text: str) -> Any:
        """The backend's encoding of `text` (no special tokens added), without holding the
        GIL for long texts."""
        if len(text) > UNLOCKED_ENCODE_CHARS:
            return self._backend.encode_batch([text], add_special_tokens=False)[0]
        return self._backend.encode(text, add_special_tokens=False)

    def warm(self) -> None:
        """Build the tables that the first streamed token would otherwise build (the bytes of
        every id: about 0.1 s for a 49K vocabulary), so that no request pays for them."""
        self.token_bytes(0)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes one token stands for (b"" for ids without a token)."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        if self._bytes_table is None:
            # Built once: streaming and message-start mapping look up every generated id.
            self._bytes_table = [self._spell_bytes(i) for i in range(self.vocab_size)]
        return self._bytes_table[token_id]

    def _spell_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            return bytes(_BYTE_OF_CHAR[c] for c in piece) if all(c in _BYTE_OF_CHAR for c in piece) else piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def backend_json(self) -> str:
        """The `tokenizers` JSON of this tokenizer (what constrained decoding builds on)."""
        return self._backend.to_str()

    def token_id(self, text: str) -> int | None:
        """Id of a vocabulary entry or special token spelled exactly `text`, or None."""
        return self._backend.token_to_id(text)

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary entry (as spelled in the vocab) for an id, or None."""
        return self._backend.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None

    # --- chat ------------------------------------------------------------------------

    @property
    def named_templates(self) -> dict[str, str]:
        """The model's named chat templates (e.g. "default", "tool_use"), by name."""
        return dict(self._named_templates)

    def render_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list | None = None,
        should_stop: Callable[[], bool] | None = None,
        **template_kwargs: Any,
    ) -> RenderedChat:
        """Render `messages` with the model's chat template and tokenize the text.

        Returns the ids, the token position where each message starts (plus the generation
        prompt's start when add_generation_prompt), and the text. Raises ChatTemplateError when
        the model has no template or the template rejects the conversation (ChatTooLarge, before
        rendering, past the size limits), RenderCancelled once `should_stop()` is true.
        """
        template = self._template(tools)
        return render_conversation(
            template, messages, self, add_generation_prompt=add_generation_prompt, tools=tools,
            should_stop=should_stop, **template_kwargs
        )

    def _template(self, tools: list | None) -> ChatTemplate:
        from prefixd.text.chat import ChatTemplateError

        name = "tool_use" if tools and "tool_use" in self._named_templates else "default"
        source = self._named_templates.get(name, self.chat_template)
        if source is None:
            raise ChatTemplateError("the model has no chat template")
        if name not in self._templates:
            specials = {
                "bos_token": self._added_text(self.bos_id),
                "eos_token": self._added_text(self.eos_id),
            }
            self._templates[name] = ChatTemplate(source, specials)
        return self._templates[name]

    def _added_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._added.get(token_id) or self.token_bytes(token_id).decode("utf-8", errors="replace")

    def offsets_bytes(self, ids: Sequence[int]) -> list[int]:
        """Cumulative byte offsets: element k is the byte length of tokens [0, k)."""
        out, pos = [0], 0
        for i in ids:
            pos += len(self.token_bytes(int(i)))
            out.append(pos)
        return out


    def token_char_starts(self, text: str) -> list[int]:
        """Character offset where each token of encode(text) starts."""
        return [start for start, _ in self._encoding(text).offsets]


class StreamDecoder:
    """UTF-8-safe incremental detokenizer: emits only complete characters."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Sequence[int]) -> str:
        """Text completed by `ids`; bytes of a character split across tokens are held back."""
        data = b"".join(self._tokenizer.token_bytes(int(i)) for i in ids)
        return self._utf8.decode(data, final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: cannot parse: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data
