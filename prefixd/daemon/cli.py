"""`prefixd` command line: serve, chat, generate, status, why."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import Sequence

import prefixd
from prefixd.daemon.config import ConfigError, config_from_args
from prefixd.daemon.options import OPTIONS


def _add_socket(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", metavar="PATH", default=None,
                   help="daemon socket (default: $PREFIXD_SOCKET, else $XDG_RUNTIME_DIR/prefixd/prefixd.sock)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixd", description="Local LLM daemon with exact prompt-prefix reuse.")
    parser.add_argument("--version", action="version", version=f"prefixd {prefixd.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon in the foreground",
                           description="Flags left unset are read from PREFIXD_* variables (docs/operations.md).")
    _add_serve_options(serve)

    chat = sub.add_parser("chat", help="interactive chat (/reset, /exit)")
    _add_socket(chat)
    chat.add_argument("--system", default=None, help="a system message to start with (default: none)")
    _add_sampling(chat)

    gen = sub.add_parser("generate", help="one request; prints the text (or --json)")
    _add_socket(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a text prompt, sent as one user chat message (default: none; this or --messages)")
    src.add_argument("--messages", metavar="FILE.json", help="a JSON list of {role, content} messages (default: none; this or --prompt)")
    gen.add_argument("--raw", action="store_true", help="send --prompt as plain text, not as a chat message (default: off)")
    _add_sampling(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, finish_reason, usage (default: off)")

    status = sub.add_parser("status", help="what the daemon is doing")
    _add_socket(status)
    status.add_argument("--json", action="store_true", help="print the raw status map as JSON (default: off)")

    why = sub.add_parser("why", help="why the last requests hit or missed the prefix cache")
    _add_socket(why)
    why.add_argument("--last", type=int, default=5, metavar="N",
                     help="how many of the latest finished requests to show (default: 5; the daemon keeps 32)")
    why.add_argument("--json", action="store_true", help="print the reports as JSON (default: off)")

    units = sub.add_parser("install-units", help="write the systemd units with ExecStart pointing at this prefixd")
    units.add_argument("--user", action="store_true",
                       help="the user units, for systemctl --user (default: the system units)")
    units.add_argument("--dir", type=Path, default=None, metavar="DIR",
                       help="where to write them (default: /etc/systemd/system, or with --user "
                            "$XDG_CONFIG_HOME/systemd/user)")
    units.add_argument("--exec", dest="exec_start", default=None, metavar="COMMAND",
                       help="the program ExecStart runs (default: the prefixd script beside this Python)")
    return parser


def _add_serve_options(serve: argparse.ArgumentParser) -> None:
    """One flag per row of OPTIONS; unset flags stay None, so config_from_args reads the variable."""
    for opt in OPTIONS:
        help_text = opt.help_text().replace("%", "%%")
        if opt.is_switch:
            serve.add_argument(opt.flag, action="store_true", default=None, help=help_text)
            continue
        typed = opt.parse if opt.parse in (int, float) else None  # other texts are parsed by config_from_args
        metavar = opt.metavar or (opt.dest.upper() if opt.choices else None)
        serve.add_argument(opt.flag, default=None, type=typed, choices=opt.choices or None, metavar=metavar,
                           help=help_text)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--greedy", action="store_true",
                   help="greedy decoding, no penalty; overrides the defaults below (default: off)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the model's, else 0.7)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: the model's, else 0.9)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest (default: the model's, else 40)")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens under this share of the likeliest (default: the model's, else 0: off)")
    p.add_argument("--repeat-penalty", type=float, default=None, help="penalty on repeated tokens (default: the model's, else 1: off)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: drawn, and printed so a reply can be reproduced)")
    p.add_argument("--tools", metavar="FILE.json", default=None,
                   help="a JSON list of OpenAI function tools (default: none)")
    p.add_argument("--schema", metavar="FILE.json", default=None,
                   help="a JSON schema the reply must match (default: none)")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="each token's logprob and K alternatives, shown with --json (default: none)")
    p.add_argument("--stop", action="append", default=[], help="a stop string, repeatable (default: none)")
    p.add_argument("--no-cache", action="store_true", help="do not use or fill the prefix cache (default: use it)")
    p.add_argument("--namespace", default="",
                   help='cache namespace; nothing is shared across namespaces (default: "")')


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "install-units":
        return _install_units(args)
    from prefixd.daemon import client_cli

    return {"chat": client_cli.chat, "generate": client_cli.generate, "status": client_cli.status,
            "why": client_cli.why}[args.command](args)


def _serve(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the server logs it: imports and config take a while
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"prefixd: {e}", file=sys.stderr)
        return 2
    from prefixd.daemon.server import serve
    from prefixd.daemon.startup import StartupError

    try:
        return serve(cfg)
    except StartupError as e:  # the engine's too: "cannot load model: ..." where the model file is at fault
        print(f"prefixd: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # a bug: one line for the user, the traceback at debug level
        logging.getLogger("prefixd").debug("serve failed", exc_info=True)
        print(f"prefixd: internal error: {e!r} (--log-level debug shows the traceback)", file=sys.stderr)
        return 70  # EX_SOFTWARE


def _install_units(args: argparse.Namespace) -> int:
    from prefixd.daemon.units import UnitsError, install_units, next_steps

    try:
        installed = install_units(user=args.user, directory=args.dir, exec_start=args.exec_start)
    except UnitsError as e:
        print(f"prefixd: {e}", file=sys.stderr)
        return 1
    for path in installed.paths:
        print(f"wrote {path}")
    print(f"ExecStart runs {installed.exec_start}; then:")
    for step in next_steps(installed, args.user):
        print(f"  {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
