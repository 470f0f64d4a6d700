"""A multi-turn tool-using agent loop against `prefixd serve --http 127.0.0.1:8000`.

    python examples/agent_loop.py --base-url http://127.0.0.1:8000/v1 "What is 17 times 23?"

Each turn sends the whole conversation (tool definitions, earlier calls and results); the
daemon continues it from its cache, so later turns report most of their prompt as
`prompt_tokens_details.cached_tokens`. The first turn forces a tool call
(`tool_choice: required`, enforced by a grammar); later turns let the model answer.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import openai

TOOLS = [{
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}]


def call_tool(name: str, arguments: str) -> str:
    """Run one tool call; a call the model got wrong becomes an error message for it to read."""
    try:
        args = json.loads(arguments)
        if name == "multiply":
            return str(int(args["a"]) * int(args["b"]))
        return f"error: no tool named {name!r}"
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e!r}"


def run(client: openai.OpenAI, model: str, question: str, *, max_turns: int = 4,
        max_tokens: int = 96) -> list[dict[str, Any]]:
    """Play the loop; returns one record per turn: tool calls made, text, cached tokens."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    turns = []
    for turn in range(max_turns):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="required" if turn == 0 else "auto",
            max_tokens=max_tokens, temperature=0.0, user="agent-loop-example")
        message = reply.choices[0].message
        calls = message.tool_calls or []
        turns.append({"calls": [(c.function.name, c.function.arguments) for c in calls], "text": message.content,
                      "prompt_tokens": reply.usage.prompt_tokens,
                      "cached_tokens": reply.usage.prompt_tokens_details.cached_tokens})
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [c.model_dump() for c in calls] or None})
        if not calls:
            break
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": call_tool(call.function.name, call.function.arguments)})
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What is 17 times 23?")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="default")
    parser.add_argument("--api-key", default="unused", help="the token of --http-token-file, if the daemon has one")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    for i, turn in enumerate(run(client, args.model, args.question)):
        print(f"turn {i}: cached {turn['cached_tokens']}/{turn['prompt_tokens']} prompt tokens; "
              f"calls {turn['calls']}; text {turn['text']!r}")


if __name__ == "__main__":
    main()
