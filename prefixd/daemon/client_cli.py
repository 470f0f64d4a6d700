"""The client side of the CLI: chat, generate, status and why over the daemon socket."""

from __future__ import annotations

import argparse
import json
import secrets
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


# Sampling for a model that ships no settings of its own. No repetition penalty: it pushes the
# model off text it must copy (quoted code, a file to edit), where drafting gains most; a model
# that ships one, or --repeat-penalty, sets it. --greedy is one flag away.
CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.0}
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _sampling(args: argparse.Namespace, model_defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """Flags, else the model's own settings (hello's model.sampling_defaults), else CHAT_DEFAULTS."""
    if args.greedy:
        return {"temperature": 0.0}
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
             "repetition_penalty": args.repeat_penalty}
    shipped = {k: v for k, v in (model_defaults or {}).items() if k in _SAMPLING_KEYS}
    chosen = {**CHAT_DEFAULTS, **shipped, **{k: v for k, v in given.items() if v is not None}}
    sampling = {k: chosen[k] for k in _SAMPLING_KEYS if k in chosen}
    sampling["seed"] = args.seed if args.seed is not None else secrets.randbits(63)
    return sampling


def _model_defaults(client: SyncClient) -> dict[str, Any]:
    defaults = client.hello(client="prefixd-cli").model.get("sampling_defaults")
    return defaults if isinstance(defaults, dict) else {}


def _fields(args: argparse.Namespace, sampling: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_tokens": args.max_tokens, "sampling": sampling,
                              "cache": not args.no_cache}
    if args.namespace:
        fields["namespace"] = args.namespace
    if args.stop:
        fields["stop"] = list(args.stop)
    if args.tools:
        fields["tools"] = _load_json_list(args.tools, "--tools")
    if args.schema:
        schema = _load_json(args.schema, "--schema")
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
    if args.logprobs is not None:
        fields["logprobs"] = args.logprobs
    return fields


def _load_json(path: str, flag: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ClientError("bad_request", f"{flag} {path}: {e}") from None


def _load_json_list(path: str, flag: str) -> list[dict[str, Any]]:
    value = _load_json(path, flag)
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ClientError("bad_request", f"{flag} {path}: expected a JSON list of maps")
    return value


def _report_seed(fields: dict[str, Any]) -> None:
    seed = fields["sampling"].get("seed")
    if seed is not None:
        print(f"(seed {seed}: pass --seed {seed} to reproduce this reply)", file=sys.stderr)


def _report_end(done: Any, max_tokens: int) -> None:
    if done is not None and done.finish_reason == "length":
        print(f"[cut at --max-tokens {max_tokens}]", file=sys.stderr)
    for call in (done.tool_calls or ()) if done is not None else ():
        print(json.dumps({"tool_call": call}))


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


def why(args: argparse.Namespace) -> int:
    return _run(_why, args, sys.stderr)


def chat(args: argparse.Namespace) -> int:
    return _run(_chat, args, sys.stderr)


def _load_messages(path: str) -> list[dict[str, Any]]:
    return _load_json_list(path, "--messages")


def _generate(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        fields = _fields(args, _sampling(args, _model_defaults(client)))
        if args.messages:
            fields["messages"] = _load_messages(args.messages)
        elif args.raw:
            fields["prompt"] = args.prompt
        else:
            fields["messages"] = [{"role": "user", "content": args.prompt}]
        if args.json:
            result = client.generate(**fields).collect()
            out = {"text": result.text, "tokens": list(result.ids), "finish_reason": result.finish_reason,
                   "usage": asdict(result.usage), "sampling": fields["sampling"]}
            for name in ("note", "tool_calls", "logprobs"):
                if getattr(result, name):
                    out[name] = getattr(result, name)
            print(json.dumps(out))
            return 0
        _report_seed(fields)
        ended: list[Any] = []
        for text in _stream_text(client, fields, ended):
            sys.stdout.write(text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        _report_end(ended[0] if ended else None, args.max_tokens)
    return 0


def _stream_text(client: SyncClient, fields: dict[str, Any], ended: list[Any] | None = None) -> Iterator[str]:
    """The reply's text as it streams; the done event is appended to `ended`."""
    with client.generate(**fields) as stream:
        for event in stream:
            text = getattr(event, "text", "")
            if text:
                yield text
        if ended is not None:
            ended.append(stream.done)


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
    graphs = model.get("cuda_graphs")
    if isinstance(graphs, dict):
        print(f"graphs    {graphs.get('captured', 0)} decode programs captured in {graphs.get('startup_s', 0):.1f}s"
              if not graphs.get("failed") else f"graphs    not captured ({graphs['failed']}): rounds run op by op")
    if model.get("overlap"):
        print("overlap   on: requests are seated for the next round while a round runs")
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
        sampling = _sampling(args, _model_defaults(client))  # one seed for the session, reported once
        _report_seed({"sampling": sampling})
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
            reply = _chat_turn(client, {**_fields(args, sampling), "messages": messages}, args.max_tokens)
            messages.append({"role": "assistant", "content": reply})


def _chat_turn(client: SyncClient, fields: dict[str, Any], max_tokens: int) -> str:
    parts: list[str] = []
    ended: list[Any] = []
    try:
        for text in _stream_text(client, fields, ended):
            parts.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C stops this reply (leaving the stream cancels it), not the chat
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")
    _report_end(ended[0] if ended else None, max_tokens)
    return "".join(parts)


def _why(args: argparse.Namespace) -> int:
    """The cache reports of the daemon's last `args.last` finished requests, oldest first."""
    with _connect(args) as client:
        reports = client.status().get("cache_reports") or []
    reports = list(reports)[-args.last:] if args.last > 0 else []
    if args.json:
        print(json.dumps(reports, indent=2))
        return 0
    if not reports:
        print("no finished requests yet")
    for report in reports:
        print("\n".join(why_lines(report)))
    return 0


_REASONS = {
    "cache_off": "the cache is off for this request",
    "namespace_empty": "nothing is cached in its namespace",
    "evicted": "an earlier prompt's longer prefix was evicted",
    "other_schedule": "its rows are cached, but not at a cut of this prompt's chunk schedule",
    "too_short": "the shared prefix is shorter than the first resume point (a page or a chunk)",
    "diverged": "the prompt differs from the cache below any further resume point",
}


def why_lines(report: dict[str, Any]) -> list[str]:
    """One request's cache report in words: a head line, then the excerpt with the differing
    token in brackets, prompt above cache."""
    namespace = f" namespace {report['namespace']!r}" if report.get("namespace") else ""
    head = (f"request {report.get('stream_id')}{namespace}: {report.get('cache')}, "
            f"{report.get('cached_tokens', 0)} of {report.get('prompt_tokens', 0)} prompt tokens cached")
    reason = report.get("cache_reason")
    if reason:
        head += f"; {reason}: {_REASONS.get(reason, reason)}"
    lines = [head]
    div = report.get("divergence")
    if isinstance(div, dict):
        at, new_id, cached_id = div.get("at"), div.get("new_id"), div.get("cached_id")
        if cached_id is None:
            lines.append(f"  diverged at token {at}: the cached rows end there (prompt token {new_id})")
        else:
            lines.append(f"  diverged at token {at}: prompt token {new_id}, cached token {cached_id}")
        ex = div.get("excerpt")
        if isinstance(ex, dict):
            before = _shown(ex.get("before", ""))
            lines.append(f"  prompt  ...{before}[{_shown(ex.get('new_token', ''))}]{_shown(ex.get('new_rest', ''))}")
            cached = f"[{_shown(ex.get('cached_token', ''))}]{_shown(ex.get('cached_rest', ''))}" \
                if div.get("cached_id") is not None else "[]"
            lines.append(f"  cached  ...{before}{cached}")
        else:
            lines.append(f"  prompt ids {div.get('before_ids')} | {div.get('new_ids')}")
            lines.append(f"  cached ids {div.get('before_ids')} | {div.get('cached_ids')}")
    return lines


def _shown(text: str) -> str:
    """Text on one line: newlines and tabs escaped."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
