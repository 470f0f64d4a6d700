"""Client requests -> engine requests and direct replies (parsing, tokenizing, chat prompts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from prefixd.daemon.stops import StopSet
from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.framing import Limits
from prefixd.ipc.messages import (
    PROTOCOL_VERSION,
    Cancel,
    Detokenize,
    Generate,
    Hello,
    Status,
    Tokenize,
    parse_request,
)
from prefixd.scheduler.records import ImageIdentity, ImageRows, SamplingParams
from prefixd.scheduler.streams import StreamRequest


@dataclass(frozen=True, slots=True)
class BuiltGenerate:
    """A validated generate: the engine's request plus what the connection does itself."""

    request_id: int
    request: StreamRequest
    stop: StopSet  # prepared here, in the worker thread, not on the event loop


class RequestBuilder:
    """Turns wire maps into typed requests; everything it raises is a ProtocolError.

    Thread-safe: `generate` and `tokenize` run in worker threads (tokenizing can be long).
    """

    def __init__(self, tokenizer: Any, model_info: dict[str, Any], limits: Limits,
                 decoder_factory: Callable[[], Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.limits = limits
        self._decoder_factory = decoder_factory

    def decoder(self) -> Any:
        """A fresh UTF-8-safe incremental decoder (push(ids) -> str, flush() -> str)."""
        if self._decoder_factory is not None:
            return self._decoder_factory()
        from prefixd.gpu.tokenizer import StreamDecoder

        return StreamDecoder(self.tokenizer)

    def _parse(self, msg: dict[str, Any], cls: type) -> Any:
        parsed = parse_request(msg)
        assert isinstance(parsed, cls), f"dispatched {msg.get('type')!r} to {cls.__name__}"
        return parsed

    def hello(self, msg: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
        hello: Hello = self._parse(msg, Hello)
        if PROTOCOL_VERSION not in hello.versions:
            raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION,
                                f"versions {list(hello.versions)}: this daemon speaks {PROTOCOL_VERSION}", hello.id)
        return {"type": "hello", "id": hello.id, **reply}

    def status(self, msg: dict[str, Any]) -> int:
        return self._parse(msg, Status).id

    def cancel(self, msg: dict[str, Any]) -> tuple[int, int]:
        cancel: Cancel = self._parse(msg, Cancel)
        return cancel.id, cancel.target

    def tokenize(self, msg: dict[str, Any], client_gone: Callable[[], bool] | None = None) -> dict[str, Any]:
        """The tokens reply; a chat render stops early once `client_gone()` is true."""
        req: Tokenize = self._parse(msg, Tokenize)
        if req.messages is not None:
            rendered = self._render(req.messages, req.id, client_gone)
            return {"type": "tokens", "id": req.id, "ids": list(rendered.ids),
                    "message_starts": list(rendered.message_starts)}
        add_special = self.tokenizer.add_bos if req.add_special is None else req.add_special
        return {"type": "tokens", "id": req.id, "ids": self.tokenizer.encode(req.text, add_special=add_special)}

    def detokenize(self, msg: dict[str, Any]) -> dict[str, Any]:
        req: Detokenize = self._parse(msg, Detokenize)
        self._check_ids(req.ids, "ids", req.id)
        return {"type": "text", "id": req.id, "text": self.tokenizer.decode(req.ids)}

    def generate(self, msg: dict[str, Any], stream_id: int,
                 client_gone: Callable[[], bool] | None = None) -> BuiltGenerate:
        """The validated generate; a chat render stops early once `client_gone()` is true."""
        req: Generate = self._parse(msg, Generate)
        starts: tuple[int, ...] = ()
        if req.messages is not None:
            rendered = self._render(req.messages, req.id, client_gone)
            tokens = tuple(rendered.ids)
            starts = tuple(s for s in rendered.message_starts if 0 < s < len(tokens))
        elif req.prompt is not None:
            tokens = tuple(self.tokenizer.encode(req.prompt, add_special=self.tokenizer.add_bos))
        else:
            tokens = tuple(req.tokens or ())
        if not tokens:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "prompt: tokenizes to no tokens", req.id)
        self._check_ids(req.stop_ids, "stop_ids", req.id)
        s = req.sampling
        request = StreamRequest(
            stream_id=stream_id,
            tokens=tokens,
            max_tokens=req.max_tokens,
            sampling=SamplingParams(s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty, s.seed),
            stop_ids=frozenset(req.stop_ids) | frozenset(self.tokenizer.stop_ids),
            chunk_starts=req.chunk_starts if req.chunk_starts is not None else starts,
            namespace=req.namespace,
            cache=req.cache,
            cache_key=req.cache_key,
            images=tuple(self._image(image, req.id) for image in req.images),
            want_logits=req.logits,
        )
        return BuiltGenerate(req.id, request, StopSet(req.stop))

    def _render(self, messages: tuple[dict[str, Any], ...], request_id: int,
                client_gone: Callable[[], bool] | None) -> Any:
        from prefixd.gpu.chat import ChatTooLarge, RenderCancelled

        kwargs = {} if client_gone is None else {"should_stop": client_gone}
        try:
            return self.tokenizer.render_chat([dict(m) for m in messages], **kwargs)
        except ProtocolError:
            raise
        except ChatTooLarge as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"messages: {e}", request_id) from None
        except RenderCancelled as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"messages: {e}", request_id) from None
        except Exception as e:  # a template error is the client's messages' fault
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"messages: the chat template failed: {e}", request_id) from None

    def _check_ids(self, ids: tuple[int, ...], field: str, request_id: int) -> None:
        vocab = int(self.model_info["vocab_size"])
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ProtocolError(ErrorCode.INVALID_TOKEN, f"{field}: token id {bad[0]} is outside [0, {vocab})", request_id)

    def _image(self, image: Any, request_id: int) -> ImageRows:
        hidden = int(self.model_info.get("hidden_size", 0))
        if image.hidden != hidden:
            raise ProtocolError(ErrorCode.BAD_PAYLOAD,
                                f"images.rows: {image.tokens} x {image.hidden} values, the model needs hidden {hidden}",
                                request_id)
        rows = np.frombuffer(image.rows, dtype="<f4").reshape(image.tokens, hidden)
        return ImageRows(ImageIdentity(image.at, image.tokens, image.gh, image.gw, image.hash), rows)
