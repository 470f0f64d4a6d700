"""Client requests -> engine requests and direct replies (parsing, tokenizing, chat prompts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from prefixd.front.output import OutputProcessor
from prefixd.front.stops import StopSet
from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.events import HelloReply, TextReply, TokensReply
from prefixd.ipc.framing import Limits
from prefixd.ipc.messages import (
    SUPPORTED_VERSIONS,
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
from prefixd.text.grammar import GrammarChecker, GrammarError, grammar_of, tool_call_grammar
from prefixd.text.reasoning import ReasoningSplitter, opens_thinking, template_switches_thinking, template_thinks
from prefixd.text.tools import prepare_chat, template_knows_tools


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """What an HTTP front asks of a chat generate beyond its wire map (the socket protocol
    has no field for these yet)."""

    enable_thinking: bool | None = None  # passed to a template that reads it; None: its default
    reasoning: bool = False  # split a thinking template's think span out of the reply


@dataclass(frozen=True, slots=True)
class BuiltGenerate:
    """A validated generate: the engine's request plus what the connection does itself."""

    request_id: int
    request: StreamRequest
    stop: StopSet  # prepared here, in the worker thread, not on the event loop
    parse_tools: bool = False  # the reply's tool calls become done.tool_calls
    parse_reasoning: bool = False  # the reply's think span becomes ReasonedTokens.reasoning
    reasoning_open: bool = False  # the prompt ends inside the span: the reply starts in it


class RequestBuilder:
    """Turns wire maps into typed requests; everything it raises is a ProtocolError.

    Thread-safe: `generate` and `tokenize` run in worker threads (tokenizing can be long).
    """

    def __init__(self, tokenizer: Any, model_info: dict[str, Any], limits: Limits) -> None:
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.limits = limits
        self._grammars = GrammarChecker(tokenizer)

    def warm(self) -> None:
        """The tokenizer's lazily built tables, built now (a worker thread at start): the first
        request's tokens would otherwise wait for them, and every stream beside it too."""
        warm = getattr(self.tokenizer, "warm", None)
        if warm is not None:
            warm()

    def decoder(self) -> Any:
        """A fresh UTF-8-safe incremental decoder (push(ids) -> str, flush() -> str)."""
        own = getattr(self.tokenizer, "stream_decoder", None)  # a tokenizer with a decoder of its own
        if own is not None:
            return own()
        from prefixd.text.tokenizer import StreamDecoder

        return StreamDecoder(self.tokenizer)

    def output(self, built: BuiltGenerate) -> OutputProcessor:
        """The output processor of one generate (both fronts use it)."""
        reasoning = ReasoningSplitter(inside=built.reasoning_open) if built.parse_reasoning else None
        return OutputProcessor(built.request_id, self.decoder(), stop=built.stop, stop_ids=built.request.stop_ids,
                               parse_tools=built.parse_tools, reasoning=reasoning,
                               token_bytes=getattr(self.tokenizer, "token_bytes", None))

    def _parse(self, msg: dict[str, Any], cls: type, version: int = SUPPORTED_VERSIONS[-1]) -> Any:
        parsed = parse_request(msg, version)
        assert isinstance(parsed, cls), f"dispatched {msg.get('type')!r} to {cls.__name__}"
        return parsed

    def hello(self, msg: dict[str, Any], reply: dict[str, Any]) -> HelloReply:
        """The hello reply: `reply` holds server, model and limits; the version is the highest shared."""
        hello: Hello = self._parse(msg, Hello)
        shared = set(hello.versions) & set(SUPPORTED_VERSIONS)
        if not shared:
            raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION,
                                f"versions {list(hello.versions)}: this daemon speaks {list(SUPPORTED_VERSIONS)}",
                                hello.id)
        return HelloReply(hello.id, max(shared), reply["server"], reply.get("model", {}), reply.get("limits", {}))

    def status(self, msg: dict[str, Any]) -> int:
        return self._parse(msg, Status).id

    def cancel(self, msg: dict[str, Any]) -> tuple[int, int]:
        cancel: Cancel = self._parse(msg, Cancel)
        return cancel.id, cancel.target

    def tokenize(self, msg: dict[str, Any], client_gone: Callable[[], bool] | None = None) -> TokensReply:
        """The tokens reply; a chat render stops early once `client_gone()` is true."""
        req: Tokenize = self._parse(msg, Tokenize)
        if req.messages is not None:
            rendered = self._render(req.messages, req.id, client_gone)
            return TokensReply(req.id, tuple(rendered.ids), tuple(rendered.message_starts))
        add_special = self.tokenizer.add_bos if req.add_special is None else req.add_special
        return TokensReply(req.id, tuple(self.tokenizer.encode(req.text, add_special=add_special)))

    def detokenize(self, msg: dict[str, Any]) -> TextReply:
        req: Detokenize = self._parse(msg, Detokenize)
        self._check_ids(req.ids, "ids", req.id)
        return TextReply(req.id, self.tokenizer.decode(req.ids))

    def generate(self, msg: dict[str, Any], stream_id: int, version: int = SUPPORTED_VERSIONS[-1],
                 client_gone: Callable[[], bool] | None = None, *,
                 chat: ChatOptions = ChatOptions()) -> BuiltGenerate:
        """The validated generate of a connection speaking protocol `version`; a chat render
        stops early once `client_gone()` is true. `chat`: see ChatOptions."""
        req: Generate = self._parse(msg, Generate, version)
        grammar = self._grammar(req)
        starts: tuple[int, ...] = ()
        parse_reasoning = reasoning_open = False
        if req.messages is not None:
            rendered = self._render(req.messages, req.id, client_gone, req.tools, chat.enable_thinking)
            tokens = tuple(rendered.ids)
            starts = tuple(s for s in rendered.message_starts if 0 < s < len(tokens))
            parse_reasoning = chat.reasoning and template_thinks(self._template_source(bool(req.tools)))
            reasoning_open = parse_reasoning and opens_thinking(rendered.text)
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
            sampling=SamplingParams(s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty, s.seed, grammar,
                                    req.logprobs),
            stop_ids=frozenset(req.stop_ids) | frozenset(self.tokenizer.stop_ids),
            chunk_starts=req.chunk_starts if req.chunk_starts is not None else starts,
            namespace=req.namespace,
            cache=req.cache,
            cache_key=req.cache_key,
            images=tuple(self._image(image, req.id) for image in req.images),
            want_logits=req.logits,
            draft=req.draft != "off",
        )
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        return BuiltGenerate(req.id, request, StopSet(req.stop), parse_tools, parse_reasoning, reasoning_open)

    def _render(self, messages: tuple[dict[str, Any], ...], request_id: int,
                client_gone: Callable[[], bool] | None, tools: tuple[dict[str, Any], ...] | None = None,
                enable_thinking: bool | None = None) -> Any:
        from prefixd.text.chat import ChatTooLarge, RenderCancelled

        source = self._template_source(bool(tools))
        chat, template_tools = prepare_chat([dict(m) for m in messages], list(tools) if tools else None, source)
        kwargs: dict[str, Any] = {} if client_gone is None else {"should_stop": client_gone}
        if template_tools is not None:
            kwargs["tools"] = template_tools
        if enable_thinking is not None and template_switches_thinking(source):
            kwargs["enable_thinking"] = enable_thinking
        try:
            return self.tokenizer.render_chat(chat, **kwargs)
        except ProtocolError:
            raise
        except ChatTooLarge as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"messages: {e}", request_id) from None
        except RenderCancelled as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"messages: {e}", request_id) from None
        except Exception as e:  # a template error is the client's messages' fault
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"messages: the chat template failed: {e}", request_id) from None

    def _grammar(self, req: Generate) -> str | None:
        """The grammar the reply must match (response_format, or a forced tool call), checked."""
        forced = isinstance(req.tool_choice, dict) or req.tool_choice == "required"
        if forced and not req.tools:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "tool_choice: needs tools", req.id)
        if forced and req.response_format not in (None, {"type": "text"}):
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                "response_format: cannot be combined with a tool_choice that forces a call", req.id)
        try:
            if forced:
                name = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None
                native = template_knows_tools(self._template_source(True))
                grammar = tool_call_grammar([dict(t) for t in req.tools or ()], name, native=native)
            else:
                grammar = grammar_of(req.response_format)
            if grammar is not None:
                self._grammars.check(grammar)
        except GrammarError as e:
            field = "tool_choice" if forced else "response_format"
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{field}: {e}", req.id) from None
        return grammar

    def _template_source(self, with_tools: bool) -> str | None:
        """The chat template a render will use (tool_use when the model names one)."""
        named = getattr(self.tokenizer, "named_templates", {})
        if with_tools and "tool_use" in named:
            return named["tool_use"]
        return getattr(self.tokenizer, "chat_template", None)

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
        finite = np.isfinite(rows)
        if not finite.all():
            row, col = (int(i) for i in np.argwhere(~finite)[0])
            raise ProtocolError(ErrorCode.BAD_PAYLOAD,
                                f"images.rows: value {rows[row, col]} at row {row}, column {col} of the image at "
                                f"{image.at} is not finite; embeddings must be finite float32", request_id)
        return ImageRows(ImageIdentity(image.at, image.tokens, image.gh, image.gw, image.hash), rows)

