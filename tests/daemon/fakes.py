"""A byte tokenizer and a predictable plain-Python device for daemon tests.

Token ids: 0 = end of text, 1 and 2 unused, 3 + b for byte b. The device writes every row's
token into its pages and, after a row at position p, samples the letter "a".."z" number
p % 26 (so the text a prompt of n tokens continues with is known), or token 0 right after
a row holding the byte "!" (a stop id test hook). An optional per-round delay paces
streams so tests can act while they run; no test asserts on time.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from prefixd.engine.runtime import Runtime
from prefixd.scheduler.device import DeviceInfo
from prefixd.scheduler.records import CapturedState, LaneResult, RoundPlan, RoundResult, StoredSample

EOS = 0
VOCAB = 259


def letter_after(position: int) -> str:
    return chr(ord("a") + position % 26)


@dataclass(frozen=True)
class Rendered:
    ids: tuple[int, ...]
    message_starts: tuple[int, ...]
    text: str


class ByteTokenizer:
    vocab_size = VOCAB
    bos_id = None
    eos_id = EOS
    stop_ids = frozenset({EOS})
    add_bos = False
    chat_template = None
    warmed = False  # warm() was called (the front warms its tokenizer before it listens)

    def warm(self) -> None:
        self.warmed = True

    def encode(self, text: str, *, add_special: bool = False) -> list[int]:
        return [b + 3 for b in text.encode()]

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id - 3]) if 3 <= token_id < VOCAB else b""

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> ByteDecoder:
        return ByteDecoder(self)

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True, tools: Any = None,
                    should_stop: Any = None) -> Rendered:
        text, starts = "", []
        for m in messages:
            starts.append(len(text.encode()))
            text += f"<{m['role']}>{m['content']}\n"
        if add_generation_prompt:
            starts.append(len(text.encode()))
            text += "<assistant>"
        return Rendered(tuple(self.encode(text)), tuple(starts), text)


# A small Qwen3-like thinking template: an assistant reply after the last user message renders
# its reasoning_content in a think span, earlier ones drop it; enable_thinking=False writes an
# empty span into the generation prompt. OPENS_THINK: its generation prompt opens the span.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_query and m.reasoning_content %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
OPENS_THINK = THINKING_TEMPLATE.replace(
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}",
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}")


class TemplateTokenizer(ByteTokenizer):
    """ByteTokenizer ids with a real jinja chat template (prefixd/text/chat.py renders it)."""

    named_templates: dict[str, str] = {}

    def __init__(self, template: str = THINKING_TEMPLATE) -> None:
        from prefixd.text.chat import ChatTemplate

        self.chat_template = template
        self._compiled = ChatTemplate(template)

    def offsets_bytes(self, ids: Sequence[int]) -> list[int]:
        out = [0]
        for i in ids:
            out.append(out[-1] + len(self.token_bytes(i)))
        return out

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True, tools: Any = None,
                    should_stop: Any = None, **kwargs: Any) -> Any:
        from prefixd.text.chat import render_conversation

        return render_conversation(self._compiled, messages, self, add_generation_prompt=add_generation_prompt,
                                   tools=tools, should_stop=should_stop, **kwargs)


class ByteDecoder:
    """UTF-8-safe incremental decode over ByteTokenizer ids."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.tokenizer = tokenizer
        self._pending = b""

    def push(self, ids: Sequence[int]) -> str:
        data = self._pending + b"".join(self.tokenizer.token_bytes(i) for i in ids)
        for cut in range(len(data), max(len(data) - 4, -1), -1):
            try:
                text = data[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self._pending = data[cut:]
            return text
        self._pending = data
        return ""

    def flush(self) -> str:
        data, self._pending = self._pending, b""
        return data.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class FakeState:
    nbytes: int = 0


class LetterDevice:
    """Implements prefixd.scheduler.device.Device with predictable sampled letters."""

    def __init__(self, *, num_lanes: int = 4, num_pages: int = 256, page_size: int = 4,
                 max_context: int = 256, round_delay_s: float = 0.0) -> None:
        self.info = DeviceInfo(
            num_lanes=num_lanes, num_pages=num_pages, page_size=page_size, max_context=max_context,
            vocab_size=VOCAB, kv_bytes_per_page=1024, lane_state_bytes=0, logits_row_bytes=VOCAB * 4,
            weights_bytes=10_000, workspace_bytes_per_row=8, invariant_rows=True,
        )
        self.pool = np.full((num_pages, page_size), -1, dtype=np.int64)
        self.round_delay_s = round_delay_s
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = False  # True while a round waits for the gate
        self.rounds = 0
        self.fail_rounds = False
        self.closed = False

    def run_round(self, plan: RoundPlan) -> RoundResult:
        self.waiting = True
        self.gate.wait()
        self.waiting = False
        if self.fail_rounds:
            raise RuntimeError("planted device failure")
        if self.round_delay_s:
            time.sleep(self.round_delay_s)
        self.rounds += 1
        p = self.info.page_size
        for copy in plan.page_copies:
            self.pool[copy.dst] = self.pool[copy.src]
        stored = tuple(self._sample_stored(item) for item in plan.stored)
        results = []
        for work in plan.lanes:
            for i, tok in enumerate(work.tokens):
                pos = work.start + i
                self.pool[work.page_table[pos // p], pos % p] = tok
            sampled = tuple(self._next(work.start + r, work.tokens[r]) for r in work.sample_rows)
            logits = None
            if work.logits_rows:
                logits = np.stack([self._row(work.start + r) for r in work.logits_rows])
            digests = tuple(_sha256(self._row(work.start + r)) for r in work.digest_rows)
            results.append(LaneResult(lane=work.lane, sampled=sampled, logits=logits, digests=digests))
        captured = tuple(CapturedState(c.lane, c.cut, FakeState()) for c in plan.captures)
        return RoundResult(tuple(results), stored=stored, captured=captured)

    def close(self) -> None:
        self.closed = True

    def _sample_stored(self, item: StoredSample) -> LaneResult:
        row = item.logits[item.row]
        return LaneResult(item.lane, sampled=(int(np.argmax(row)),), digests=(_sha256(row),) if item.digest else ())

    def _next(self, position: int, token: int) -> int:
        if token == ord("!") + 3:
            return EOS
        return ord(letter_after(position)) + 3

    def _row(self, position: int) -> np.ndarray:
        row = np.zeros(VOCAB, dtype=np.float32)
        row[position % VOCAB] = 1.0
        return row


def _sha256(row: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(row, dtype=np.float32).tobytes()).hexdigest()


def fake_runtime_factory(device: LetterDevice, *, cache: bool = True, tokenizer: ByteTokenizer | None = None):
    """A Server runtime factory over the real Engine and `device` (and `tokenizer`, a
    ByteTokenizer unless given)."""
    from prefixd.scheduler.config import SchedulerConfig
    from prefixd.scheduler.engine import Engine

    def factory(cfg: Any, observer: Any) -> Runtime:
        config = SchedulerConfig(num_lanes=device.info.num_lanes, grid=8, round_row_budget=64, cache=cache)
        engine = Engine(device, config, observer=observer)
        info = {"name": "letters", "family": "fake", "vocab_size": VOCAB, "max_context": engine.max_context,
                "hidden_size": 4, "lanes": device.info.num_lanes}
        factory.runtime = Runtime(engine=engine, tokenizer=tokenizer or ByteTokenizer(), model_info=info)  # type: ignore[attr-defined]
        return factory.runtime  # type: ignore[attr-defined]

    return factory


def letter_factory(*, cache: bool = True, **device_args: Any):
    """`fake_runtime_factory` over a LetterDevice of `device_args`, by name: what an engine
    process of its own imports ("tests.daemon.fakes:letter_factory", ProcessLauncher)."""
    return fake_runtime_factory(LetterDevice(**device_args), cache=cache)
