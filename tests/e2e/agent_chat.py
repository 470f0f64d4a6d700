"""The store issue's agent conversation, and running its turns through a daemon.

Two chats share one long system prompt (a tools header). Chat "a" has six turns, with tool
results among its new messages; chat "b" has two. A turn's request is the whole
conversation so far: the system prompt, every earlier message, and the assistant replies
that the cold run generated, fed back verbatim, so every mode sends the same prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Sequence

from prefixd.ipc.client import AsyncClient, GenerateResult
from prefixd.ipc.events import Usage
from tests.e2e.together import run_together

_TOOLS = (
    ("search_files", "Search the workspace for files whose path matches a glob pattern.", "pattern"),
    ("read_file", "Read a text file and return its lines with line numbers.", "path"),
    ("run_tests", "Run the test suite of a package and report failures with their output.", "package"),
    ("get_weather", "Return the current weather for a city: temperature, wind and sky.", "city"),
    ("convert_units", "Convert a quantity between metric and imperial units exactly.", "quantity"),
    ("calendar", "List the events of a day in the user's calendar, with times and places.", "date"),
)

SYSTEM_PROMPT = (
    "You are a careful assistant that helps a developer with their daily work. You may call "
    "tools. To call one, answer with a single JSON object {\"tool\": NAME, \"argument\": VALUE} "
    "and nothing else; its result comes back in a message from the tool. Tools:\n"
    + "\n".join(f"- {name}({arg}): {doc}" for name, doc, arg in _TOOLS)
    + "\nRules: answer briefly; never invent a tool result; quote numbers exactly as the tool "
    "gave them; when a tool fails, say so and suggest the next step; keep the user's units."
)

CHAT_A: tuple[tuple[str, str], ...] = (
    ("user", "What is the weather in Lyon right now?"),
    ("tool", '{"city": "Lyon", "temp_c": 17.5, "wind_kmh": 12, "sky": "scattered clouds"}'),
    ("user", "Convert that temperature to Fahrenheit, please."),
    ("tool", '{"quantity": "17.5 C", "result": "63.5 F"}'),
    ("tool", '{"date": "2024-05-14", "events": [{"time": "09:30", "title": "standup", "place": "room 2"}]}'),
    ("user", "Thanks. Summarise all of that in one sentence."),
)

CHAT_B: tuple[tuple[str, str], ...] = (
    ("user", "Which test files mention the word cache?"),
    ("tool", '{"pattern": "tests/**/*cache*.py", "matches": ["tests/test_cache.py", "tests/store/test_cache_keys.py"]}'),
)

CHATS = {"a": CHAT_A, "b": CHAT_B}
FILLER_TOKEN = 42


@dataclass(frozen=True)
class Step:
    """The tokens and logits digests of one request, and how the daemon served it."""

    ids: tuple[int, ...]
    digests: tuple[str, ...]
    text: str
    finish_reason: str
    usage: Usage

    @classmethod
    def of(cls, result: GenerateResult) -> Step:
        assert result.logits_sha256 is not None, "requests ask for logits digests"
        return cls(result.ids, result.logits_sha256, result.text, result.finish_reason, result.usage)


TurnKey = tuple[str, int]  # (chat, turn index from 0)


@dataclass(frozen=True)
class Transcript:
    """The cold run: each turn's request messages and its output."""

    messages: dict[TurnKey, tuple[dict[str, str], ...]]
    steps: dict[TurnKey, Step]

    @property
    def keys(self) -> list[TurnKey]:
        return list(self.messages)


def turn_messages(system: str, inputs: Sequence[tuple[str, str]], replies: Sequence[str]) -> tuple[dict[str, str], ...]:
    """The request for turn len(replies): system, then each input followed by its reply."""
    out = [{"role": "system", "content": system}]
    for i, (role, content) in enumerate(inputs[: len(replies) + 1]):
        out.append({"role": role, "content": content})
        if i < len(replies):
            out.append({"role": "assistant", "content": replies[i]})
    return tuple(out)


async def generate(client: AsyncClient, messages: Sequence[dict[str, str]], **fields: Any) -> Step:
    result = await client.generate(messages=list(messages), logits=True, **fields).collect()
    return Step.of(result)


async def cold_transcript(client: AsyncClient, max_tokens: int, system: str = SYSTEM_PROMPT,
                          chats: dict[str, tuple[tuple[str, str], ...]] = CHATS) -> Transcript:
    """Run every chat turn by turn with the store off, one request at a time."""
    messages: dict[TurnKey, tuple[dict[str, str], ...]] = {}
    steps: dict[TurnKey, Step] = {}
    for chat, inputs in chats.items():
        replies: list[str] = []
        for turn in range(len(inputs)):
            request = turn_messages(system, inputs, replies)
            step = await generate(client, request, max_tokens=max_tokens, cache=False)
            messages[(chat, turn)] = request
            steps[(chat, turn)] = step
            replies.append(step.text)
    return Transcript(messages, steps)


def alternating(keys: Iterable[TurnKey]) -> list[TurnKey]:
    """Every turn of chat "a", each followed by a turn of chat "b" (b's turns repeat in
    order): no two requests in a row continue the same conversation."""
    keys = list(keys)
    a_turns = sorted(k for k in keys if k[0] == "a")
    b_turns = sorted(k for k in keys if k[0] == "b")
    return [key for i, a in enumerate(a_turns) for key in (a, b_turns[i % len(b_turns)])]


def back_to_back(keys: Iterable[TurnKey]) -> list[TurnKey]:
    """Each chat's turns in a row, chat by chat."""
    return sorted(keys)


async def replay(client: AsyncClient, transcript: Transcript, order: Sequence[TurnKey], max_tokens: int, *,
                 between: Callable[[TurnKey, Step], Awaitable[None]] | None = None, **fields: Any) -> dict[TurnKey, Step]:
    """Send the transcript's requests one at a time in `order`; `between(key, step)` runs
    after each one."""
    out: dict[TurnKey, Step] = {}
    for key in order:
        out[key] = await generate(client, transcript.messages[key], max_tokens=max_tokens, **fields)
        if between is not None:
            await between(key, out[key])
    return out


async def take_the_lane(client: AsyncClient) -> None:
    """A one-token request of another namespace, store off: on a one-lane daemon it takes the
    lane, so the conversation's next turn resumes from the store, not a resident lane."""
    result = await client.generate(tokens=[FILLER_TOKEN], max_tokens=1, cache=False, namespace="filler").collect()
    assert result.usage.cache == "off"


async def replay_concurrently(socket: Path, transcript: Transcript, max_tokens: int,
                              **fields: Any) -> tuple[dict[TurnKey, Step], int]:
    """Send every request of the transcript at once, each on its own connection; also
    return the most lanes seen busy together."""
    requests = {key: {"messages": list(transcript.messages[key]), "max_tokens": max_tokens, "logits": True, **fields}
                for key in transcript.keys}
    results, most_busy = await run_together(socket, requests)
    return {key: Step.of(result) for key, result in results.items()}, most_busy  # type: ignore[misc]


def outputs(steps: dict[TurnKey, Step]) -> dict[TurnKey, tuple[tuple[int, ...], tuple[str, ...]]]:
    """What exactness compares: token ids and logits digests of every step, per turn."""
    return {key: (step.ids, step.digests) for key, step in sorted(steps.items())}
