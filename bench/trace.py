"""An agent trace for the store and daemon benchmarks: conversations that share a long
system prompt with a tools header and grow by tool results, code and prose.

Everything is drawn from a seeded generator, so a (shape, seed) pair always builds the same
text. Sizes are in tokens of the tokenizer passed in as `count_tokens`.

    trace = build_trace(QUICK_TRACE, count_tokens=lambda s: len(tok.encode(s)))
    for turn in trace.turns:            # interleaved: turn 0 of every conversation, then turn 1, ...
        messages = history[turn.conversation] + [turn.message]
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

CountTokens = Callable[[str], int]
PAGE = 16  # the daemon's default page size, used for the simulated LRU pages


@dataclass(frozen=True)
class TraceShape:
    """How big the trace is: conversations, turns each, and token sizes."""

    num_conversations: int
    num_turns: int
    system_tokens: int  # shared system prompt with the tools header
    turn_tokens: tuple[int, int]  # new tokens of one user or tool message, inclusive range
    seed: int = 0


FULL_TRACE = TraceShape(num_conversations=4, num_turns=10, system_tokens=1500, turn_tokens=(400, 600))
QUICK_TRACE = TraceShape(num_conversations=2, num_turns=3, system_tokens=600, turn_tokens=(200, 400))


@dataclass(frozen=True)
class Turn:
    """One message a conversation adds before the assistant answers."""

    conversation: int
    index: int
    message: dict[str, str]  # {"role": "user" | "tool", "content": ...}
    target_tokens: int


@dataclass(frozen=True)
class Trace:
    shape: TraceShape
    system: str
    turns: tuple[Turn, ...]  # replay order

    def conversation_turns(self, conversation: int) -> list[Turn]:
        return [t for t in self.turns if t.conversation == conversation]


_WORDS = (
    "request cache token budget page lane round prefix worker queue index schema record "
    "service client server latency buffer memory thread socket stream handler config module "
    "parser report metric window batch shard replica commit branch review deploy rollback "
    "timeout retry backoff cursor offset partition snapshot checksum ledger invoice account"
).split()
_VERBS = "reads writes checks updates returns fetches parses validates merges drops keeps".split()
_TOOLS = ("read_file", "write_file", "run_tests", "search_code", "http_get", "sql_query",
          "list_dir", "git_diff", "shell", "open_issue", "send_email", "calendar_lookup")


def build_trace(shape: TraceShape, count_tokens: CountTokens) -> Trace:
    """The trace for `shape`; the same shape, seed and tokenizer give the same text."""
    rng = random.Random(shape.seed)
    system = _system_prompt(rng, shape.system_tokens, count_tokens)
    per_conversation: list[list[Turn]] = []
    for conv in range(shape.num_conversations):
        turns = []
        for index in range(shape.num_turns):
            low, high = shape.turn_tokens
            target = int(rng.triangular(low, high, high))
            if index == 0:
                message = {"role": "user", "content": _fill(rng, target, count_tokens, _task)}
            else:
                kind = rng.choice((_json_result, _code_result, _prose_result))
                message = {"role": "tool", "content": _fill(rng, target, count_tokens, kind)}
            turns.append(Turn(conv, index, message, target))
        per_conversation.append(turns)
    order = [per_conversation[c][i] for i in range(shape.num_turns) for c in range(shape.num_conversations)]
    return Trace(shape, system, tuple(order))


def _fill(rng: random.Random, target: int, count_tokens: CountTokens, piece: Callable[[random.Random], str]) -> str:
    """Pieces joined until `target` tokens, the last one cut by words to land on it."""
    parts: list[str] = []
    while True:
        candidate = piece(rng)
        if count_tokens("\n".join([*parts, candidate])) <= target:
            parts.append(candidate)
            continue
        words = candidate.split(" ")
        lo, hi = 0, len(words)  # the most words of the last piece that still fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count_tokens("\n".join([*parts, " ".join(words[:mid])])) <= target:
                lo = mid
            else:
                hi = mid - 1
        return "\n".join([*parts, " ".join(words[:lo])]) if lo else "\n".join(parts)


def _system_prompt(rng: random.Random, target: int, count_tokens: CountTokens) -> str:
    intro = ("You are an engineering agent. Use the tools below to inspect and change the project. "
             "Call one tool at a time and explain each step briefly.\n# Tools\n")
    tools = iter(_TOOLS * 8)
    return intro + _fill(rng, target - count_tokens(intro), count_tokens, lambda r: _tool_spec(r, next(tools)))


def _tool_spec(rng: random.Random, name: str) -> str:
    params = {
        _word(rng): {"type": rng.choice(("string", "integer", "boolean")), "description": _sentence(rng, 8)}
        for _ in range(rng.randint(2, 4))
    }
    spec = {"name": f"{name}_{rng.randint(1, 99)}", "description": _sentence(rng, 14),
            "parameters": {"type": "object", "properties": params, "required": list(params)[:1]}}
    return json.dumps(spec)


def _task(rng: random.Random) -> str:
    return _sentence(rng, rng.randint(12, 30))


def _json_result(rng: random.Random) -> str:
    rows = [{"id": rng.randint(1000, 99999), "name": f"{_word(rng)}-{_word(rng)}",
             "status": rng.choice(("ok", "failed", "pending")), "latency_ms": round(rng.uniform(0.5, 900), 2),
             "updated": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:"
                        f"{rng.randint(0, 59):02d}:00Z"}
            for _ in range(rng.randint(2, 5))]
    return json.dumps({"tool": rng.choice(_TOOLS), "results": rows}, indent=1)


def _code_result(rng: random.Random) -> str:
    name, arg, other = _word(rng), _word(rng), _word(rng)
    body = [f"def {name}_{other}({arg}, limit={rng.randint(1, 64)}):",
            f'    """{_sentence(rng, 9)}"""',
            f"    out = []",
            f"    for item in {arg}[:limit]:",
            f"        if item.{other} > {rng.randint(0, 500)}:",
            f"            out.append(item.{_word(rng)})",
            f"    return sorted(out)"]
    return "\n".join(body)


def _prose_result(rng: random.Random) -> str:
    return " ".join(_sentence(rng, rng.randint(8, 20)) for _ in range(rng.randint(2, 4)))


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS)


def _sentence(rng: random.Random, num_words: int) -> str:
    words = [_word(rng) if i % 4 != 2 else rng.choice(_VERBS) for i in range(num_words)]
    return " ".join(words).capitalize() + "."


# -- a replayed trace, and simulations over its token streams ---------------------------------

@dataclass(frozen=True)
class TurnRecord:
    conversation: int
    index: int
    prompt_ids: tuple[int, ...]
    starts: tuple[int, ...]  # message starts: the daemon's default chunk starts
    output_ids: tuple[int, ...]
    cached: int
    cache: str  # usage.cache: miss | hit | resident | off
    ttft_s: float  # the daemon's own, from receipt of the request
    store_bytes: int  # after the turn

    @property
    def context(self) -> int:
        return len(self.prompt_ids)


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def unbounded_cached(turns: list[TurnRecord]) -> list[int]:
    """Per turn, the longest prefix of its prompt that an earlier request computed (prompt + reply)."""
    seen: list[tuple[int, ...]] = []
    out = []
    for t in turns:
        out.append(min(len(t.prompt_ids) - 1, max((lcp(t.prompt_ids, s) for s in seen), default=0)))
        seen.append(t.prompt_ids + t.output_ids)
    return out


def lru_cached(turns: list[TurnRecord], capacity_pages: int) -> list[int]:
    """Per turn, tokens a plain LRU cache of full KV pages serves: the leading pages found,
    each keyed by its token prefix; every page a request computes is then kept, least recently
    used out first."""
    cache: OrderedDict[int, None] = OrderedDict()
    out = []
    for t in turns:
        keys = _page_keys(t.prompt_ids)
        found = 0
        for key in keys:
            if key not in cache:
                break
            cache.move_to_end(key)
            found += 1
        out.append(min(found * PAGE, len(t.prompt_ids) - 1))
        computed = t.prompt_ids + t.output_ids[:-1]  # the last reply token's row is never computed
        for key in _page_keys(computed):
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity_pages:
            cache.popitem(last=False)
    return out


def _page_keys(ids: tuple[int, ...]) -> list[int]:
    return [hash(ids[: end]) for end in range(PAGE, len(ids) + 1, PAGE)]


def distinct_prompt_tokens(turns: list[TurnRecord]) -> int:
    """Distinct token prefixes over every prompt: the rows a trie of the prompts holds."""
    seen: list[tuple[int, ...]] = []
    total = 0
    for t in turns:
        total += len(t.prompt_ids) - max((lcp(t.prompt_ids, s) for s in seen), default=0)
        seen.append(t.prompt_ids)
    return total
