"""The client side of the CLI: chat, generate and status over the daemon socket."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator, TextIO

from prefixd.ipc.errors import ClientError
from prefixd.ipc.paths import default_socket_path
from prefixd.ipc.sync_client import SyncClient


class NoDaemon(Exception):
    """Nothing listens on the socket path."""


def _socket_path(args: argparse.Namespace) -> Path:
    return Path(args.socket) if args.socket else default_socket_path()


def _connect(args: argparse.Namespace) -> SyncClient:
    path = _socket_path(args)
    try:
        return SyncClient(path)
    except OSError as e:
        raise NoDaemon(f"no daemon at {path}: start it with `prefixd serve` ({e.strerror or e})") from None


def _fields(args: argparse.Namespace) -> dict[str, Any]:
    sampling: dict[str, Any] = {"temperature": args.temperature}
    if args.seed is not None:
        sampling["seed"] = args.seed
    fields: dict[str, Any] = {"max_tokens": args.max_tokens, "sampling": sampling, "cache": not args.no_cache}
    if args.namespace:
        fields["namespace"] = args.namespace
    if args.stop:
        fields["stop"] = list(args.stop)
    return fields


def _run(fn: Any, args: argparse.Namespace, err: TextIO) -> int:
    try:
        return fn(args)
    except NoDaemon as e:
        print(f"prefixd: {e}", file=err)
        return 1
    except ClientError as e:
        print(f"prefixd: {e.code}: {e.message}", file=err)
        return 1


def generate(args: argparse.Namespace) -> int:
    return _run(_generate, args, sys.stderr)


def status(args: argparse.Namespace) -> int:
    return _run(_status, args, sys.stderr)


def chat(args: argparse.Namespace) -> int:
    return _run(_chat, args, sys.stderr)


def _load_messages(path: str) -> list[dict[str, Any]]:
    try:
        messages = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ClientError("bad_request", f"--messages {path}: {e}") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ClientError("bad_request", f"--messages {path}: expected a JSON list of {{role, content}} maps")
    return messages


def _generate(args: argparse.Namespace) -> int:
    fields = _fields(args)
    if args.messages:
        fields["messages"] = _load_messages(args.messages)
    elif args.raw:
        fields["prompt"] = args.prompt
    else:
        fields["messages"] = [{"role": "user", "content": args.prompt}]
    with _connect(args) as client:
        if args.json:
            result = client.generate(**fields).collect()
            out = {"text": result.text, "tokens": list(result.ids), "finish_reason": result.finish_reason,
                   "usage": asdict(result.usage)}
            if result.note:
                out["note"] = result.note
            print(json.dumps(out))
            return 0
        for text in _stream_text(client, fields):
            sys.stdout.write(text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _stream_text(client: SyncClient, fields: dict[str, Any]) -> Iterator[str]:
    with client.generate(**fields) as stream:
        for event in stream:
            text = getattr(event, "text", "")
            if text:
                yield text


def _status(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        info = client.status()
    if args.json:
        print(json.dumps(info, default=str))
        return 0
    model = info.get("model", {})
    print(f"prefixd at {info.get('socket') or _socket_path(args)}  ({info.get('server', '?')})")
    print(f"model     {model.get('name', '?')} ({model.get('family', '?')}, {model.get('device', '?')}, "
          f"{model.get('dtype', '?')}, {model.get('mode', '?')}), context {info.get('max_context', '?')}")
    print(f"lanes     {info.get('lanes_busy', 0)} busy, {info.get('lanes_resident', 0)} resident, "
          f"{len(info.get('lanes', []))} total; {info.get('waiting', 0)} waiting")
    print(f"pages     {info.get('pages_used', 0)} used, {info.get('pages_free', 0)} free "
          f"(page size {info.get('page_size', '?')})")
    store = info.get("store")
    if isinstance(store, dict):
        ratio = store.get("hit_tokens", 0) / max(1, store.get("query_tokens", 0))
        print(f"cache     {_mib(store.get('bytes', 0))} of {_mib(store.get('budget_bytes', 0))}, "
              f"{store.get('entries', 0)} entries; {ratio:.0%} of prompt tokens hit")
    else:
        print("cache     off")
    print(f"clients   {info.get('connections', 0)} connected; up {info.get('uptime_s', 0):.0f}s")
    return 0


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _chat(args: argparse.Namespace) -> int:
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, Any]] = list(system)
    with _connect(args) as client:
        print("prefixd chat: /reset starts over, /exit (or Ctrl-D) quits", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            if line.strip() == "/exit":
                return 0
            if line.strip() == "/reset":
                messages = list(system)
                print("(conversation reset)", file=sys.stderr)
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            reply = _chat_turn(client, {**_fields(args), "messages": messages})
            messages.append({"role": "assistant", "content": reply})


def _chat_turn(client: SyncClient, fields: dict[str, Any]) -> str:
    parts: list[str] = []
    try:
        for text in _stream_text(client, fields):
            parts.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C stops this reply (leaving the stream cancels it), not the chat
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")
    return "".join(parts)
