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

import anyio

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


def run_sync(fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
    """Run an async helper below from a synchronous test."""
    return anyio.run(lambda: fn(*args, **kwargs))


async def generate(client: AsyncClient, messages: Sequence[dict[str, str]], **fields: Any) -> Step:
    result = await client.generate(messages=list(messages), logits=True, **fields).collect()
    return Step.of(result)


async def cold_transcript(socket: Path, max_tokens: int) -> Transcript:
    """Run every chat turn by turn with the store off, one request at a time on an idle
    daemon; each reply joins the next turn's request."""
    messages: dict[TurnKey, tuple[dict[str, str], ...]] = {}
    steps: dict[TurnKey, Step] = {}
    async with await AsyncClient.connect(socket) as client:
        for chat, inputs in CHATS.items():
            replies: list[str] = []
            for turn in range(len(inputs)):
                status = await client.status()
                assert (status["lanes_busy"], status["waiting"]) == (0, 0), "the cold run is alone on the daemon"
                request = turn_messages(SYSTEM_PROMPT, inputs, replies)
                step = await generate(client, request, max_tokens=max_tokens, cache=False)
                messages[(chat, turn)] = request
                steps[(chat, turn)] = step
                replies.append(step.text)
    return Transcript(messages, steps)


async def message_starts(socket: Path, transcript: Transcript) -> dict[TurnKey, tuple[int, ...]]:
    """Each turn's message starts (then the generation prompt's start), from `tokenize`."""
    async with await AsyncClient.connect(socket) as client:
        return {key: (await client.tokenize(messages=list(transcript.messages[key]))).message_starts or ()
                for key in transcript.keys}


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


async def take_the_lane(client: AsyncClient) -> None:
    """A one-token request of another namespace, store off: on a one-lane daemon it takes the
    lane, so the conversation's next turn resumes from the store, not a resident lane."""
    result = await client.generate(tokens=[FILLER_TOKEN], max_tokens=1, cache=False, namespace="filler").collect()
    assert result.usage.cache == "off"


async def from_the_store(socket: Path, transcript: Transcript, max_tokens: int) -> dict[TurnKey, Step]:
    """Each chat's turns in a row, with the lane taken between them (one-lane daemons):
    every turn after the first resumes from the store."""
    out: dict[TurnKey, Step] = {}
    async with await AsyncClient.connect(socket) as client:
        for key in back_to_back(transcript.keys):
            out[key] = await generate(client, transcript.messages[key], max_tokens=max_tokens, namespace="store")
            await take_the_lane(client)
    return out


async def alternating_with_store_stats(socket: Path, transcript: Transcript,
                                       max_tokens: int) -> list[tuple[TurnKey, Step, dict[str, Any]]]:
    """The chats' turns alternating; each with the store's stats right after it."""
    out: list[tuple[TurnKey, Step, dict[str, Any]]] = []
    async with await AsyncClient.connect(socket) as client:
        for key in alternating(transcript.keys):
            step = await generate(client, transcript.messages[key], max_tokens=max_tokens, namespace="evicting")
            out.append((key, step, (await client.status())["store"]))
    return out


async def continued_in_place(socket: Path, transcript: Transcript, max_tokens: int) -> dict[TurnKey, Step]:
    """Each chat's turns back to back: every turn after the first extends a resident lane."""
    async with await AsyncClient.connect(socket) as client:
        return {key: await generate(client, transcript.messages[key], max_tokens=max_tokens, namespace="resident")
                for key in back_to_back(transcript.keys)}


async def all_at_once(socket: Path, transcript: Transcript, max_tokens: int,
                      **fields: Any) -> tuple[dict[TurnKey, Step], int]:
    """Every request of the transcript at once, each on its own connection; also the most
    lanes seen busy together."""
    requests = {key: {"messages": list(transcript.messages[key]), "max_tokens": max_tokens, "logits": True, **fields}
                for key in transcript.keys}
    results, most_busy = await run_together(socket, requests)
    return {key: Step.of(result) for key, result in results.items()}, most_busy  # type: ignore[misc]


def outputs(steps: dict[TurnKey, Step]) -> dict[TurnKey, tuple[tuple[int, ...], tuple[str, ...]]]:
    """What exactness compares: token ids and logits digests of every step, per turn."""
    return {key: (step.ids, step.digests) for key, step in sorted(steps.items())}


def check_usage(steps: dict[TurnKey, Step], cold: Transcript) -> None:
    """Every turn's usage adds up: same prompt as cold, cached + prefilled = prompt."""
    for key, step in steps.items():
        usage = step.usage
        assert usage.prompt_tokens == cold.steps[key].usage.prompt_tokens, key
        assert usage.prefilled_tokens + usage.cached_tokens == usage.prompt_tokens, key
        assert usage.completion_tokens == len(step.ids), key


def check_runs_equal_cold(runs: list[tuple[TurnKey, Step, dict[str, Any]]], cold: Transcript) -> list[dict[str, Any]]:
    """Each run's ids and logits digests equal the cold turn's, its usage adds up and every turn
    after the first reused something; returns the store stats taken after each turn."""
    for key, step, _ in runs:
        assert (step.ids, step.digests) == (cold.steps[key].ids, cold.steps[key].digests), key
        check_usage({key: step}, cold)
    assert all(step.usage.cached_tokens > 0 for _, step, _ in runs[1:])
    return [store for _, _, store in runs]
