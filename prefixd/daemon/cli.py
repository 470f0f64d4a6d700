"""`prefixd` command line: serve, chat, generate, status."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from prefixd.daemon.config import DEFAULT_METRICS_ADDR, ConfigError, config_from_args


def _add_socket(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", metavar="PATH", default=None,
                   help="daemon socket (default: $PREFIXD_SOCKET or $XDG_RUNTIME_DIR/prefixd/prefixd.sock)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixd", description="Local LLM daemon with exact prompt-prefix reuse.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    _add_socket(serve)
    serve.add_argument("--model", default=None, help='"default", a FILE.gguf or a Hugging Face model dir')
    serve.add_argument("--device", default=None, help="cpu (default) or cuda[:N]")
    serve.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="compute dtype (default bf16)")
    serve.add_argument("--mode", default=None, choices=("auto", "invariant", "int4"),
                       help="numeric mode: int4 = 4-bit weights (CPU bf16); auto (default): int4 where it exists on CPU bf16")
    serve.add_argument("--lanes", type=int, default=None, help="concurrent streams (default 8 on CPU)")
    serve.add_argument("--allow-group", default=None, metavar="GROUP", help="also accept peers of this group")
    serve.add_argument("--metrics-addr", default=None, metavar="HOST:PORT",
                       help=f'Prometheus exporter (default {DEFAULT_METRICS_ADDR}; "" disables)')
    serve.add_argument("--cache-budget", default=None, metavar="BYTES|auto", help="prefix cache allowance")
    serve.add_argument("--no-cache", action="store_true", help="turn the prefix cache off")
    serve.add_argument("--page-size", type=int, default=None, help="KV rows per page (default 16)")
    serve.add_argument("--grid", type=int, default=None, help="prefill chunk length G (default 256)")
    serve.add_argument("--max-context", type=int, default=None, help="context cap (default: the model's; 4096 on CPU)")
    serve.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                       help="on SIGTERM, time in-flight streams get to finish (default 10)")
    serve.add_argument("--disk-cache", default=None, metavar="DIR",
                       help="disk tier below the prefix cache (default: $STATE_DIRECTORY under systemd, else "
                            '$XDG_CACHE_HOME/prefixd, else ~/.cache/prefixd; "" turns it off)')
    serve.add_argument("--disk-budget", default=None, metavar="BYTES",
                       help="bytes the disk tier may hold (default 8GiB; 0 turns it off)")
    serve.add_argument("--idle-exit", default=None, type=float, metavar="SECONDS",
                       help="flush the disk tier and exit after this long with no client and no request "
                            "(default: never; for socket-activated units)")
    serve.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"))
    serve.add_argument("--http", default=None, metavar="HOST:PORT",
                       help="also serve the OpenAI-compatible HTTP API here (off by default; see docs/http.md)")
    serve.add_argument("--http-token-file", default=None, metavar="FILE",
                       help="bearer token HTTP clients must send; required to listen beyond loopback")

    chat = sub.add_parser("chat", help="interactive chat (/reset, /exit)")
    _add_socket(chat)
    chat.add_argument("--system", default=None, help="a system message to start with")
    _add_sampling(chat)

    gen = sub.add_parser("generate", help="one request; prints the text (or --json)")
    _add_socket(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a text prompt (sent as one user chat message)")
    src.add_argument("--messages", metavar="FILE.json", help="a JSON list of {role, content} messages")
    gen.add_argument("--raw", action="store_true", help="send --prompt as plain text, not as a chat message")
    _add_sampling(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, finish_reason, usage")

    status = sub.add_parser("status", help="what the daemon is doing")
    _add_socket(status)
    status.add_argument("--json", action="store_true", help="print the raw status map as JSON")
    return parser


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--greedy", action="store_true", help="greedy decoding, no penalty (overrides the defaults below)")
    p.add_argument("--temperature", type=float, default=None, help="default 0.7")
    p.add_argument("--top-p", type=float, default=None, help="default 0.9")
    p.add_argument("--top-k", type=int, default=None, help="default 40")
    p.add_argument("--min-p", type=float, default=None, help="default 0 (off)")
    p.add_argument("--repeat-penalty", type=float, default=None, help="default 1.1")
    p.add_argument("--seed", type=int, default=None, help="default: drawn, and printed so a reply can be reproduced")
    p.add_argument("--tools", metavar="FILE.json", default=None, help="a JSON list of OpenAI function tools")
    p.add_argument("--schema", metavar="FILE.json", default=None, help="a JSON schema the reply must match")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="each token's logprob and K alternatives (shown with --json)")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--no-cache", action="store_true", help="do not use or fill the prefix cache")
    p.add_argument("--namespace", default="", help="cache namespace (nothing is shared across namespaces)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    from prefixd.daemon import client_cli

    return {"chat": client_cli.chat, "generate": client_cli.generate, "status": client_cli.status}[args.command](args)


def _serve(args: argparse.Namespace) -> int:
    from prefixd.daemon.listener import SocketInUseError, SocketPathError
    from prefixd.daemon.systemd import ActivationError

    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"prefixd: {e}", file=sys.stderr)
        return 2
    from prefixd.daemon.server import serve
    from prefixd.gpu.loading import ModelLoadError

    try:
        return serve(cfg)
    except (SocketInUseError, SocketPathError, ActivationError) as e:
        print(f"prefixd: {e}", file=sys.stderr)
        return 1
    except ModelLoadError as e:
        print(f"prefixd: cannot load model: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
