"""`prefixd` command line: serve, chat, generate, status."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import Sequence

import prefixd
from prefixd.front.abandon import HOLD_BASE_S, AbandonLimits
from prefixd.daemon.config import (DEFAULT_ABANDON_GRACE, DEFAULT_ABANDON_HOLD_MAX_S, DEFAULT_CLIENT_FRAME_BURST,
                                   DEFAULT_CLIENT_FRAME_RATE, DEFAULT_CONNECT_FRAME_COST, DEFAULT_CPU_LANES,
                                   DEFAULT_CPU_MAX_CONTEXT, DEFAULT_CUDA_LANES, DEFAULT_ERROR_FRAME_COST,
                                   DEFAULT_GRACE_S, DEFAULT_GRID, DEFAULT_METRICS_ADDR, DEFAULT_PAGE_SIZE, LOG_LEVELS,
                                   ConfigError, config_from_args)


def _add_socket(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", metavar="PATH", default=None,
                   help="daemon socket (default: $PREFIXD_SOCKET, else $XDG_RUNTIME_DIR/prefixd/prefixd.sock)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixd", description="Local LLM daemon with exact prompt-prefix reuse.")
    parser.add_argument("--version", action="version", version=f"prefixd {prefixd.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon in the foreground",
                           description="Flags left unset are read from PREFIXD_* variables (docs/operations.md).")
    _add_socket(serve)
    serve.add_argument("--model", default=None,
                       help='"default" (SmolLM2-135M-Instruct), a FILE.gguf or a Hugging Face model dir (default: default)')
    serve.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cpu)")
    serve.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="compute dtype (default: bf16)")
    serve.add_argument("--mode", default=None, choices=("auto", "invariant", "int4"),
                       help="numeric mode: int4 = 4-bit weights (CPU bf16); auto: int4 where it exists on CPU bf16, "
                            "else invariant (default: auto)")
    serve.add_argument("--lanes", type=int, default=None,
                       help=f"concurrent streams (default: {DEFAULT_CPU_LANES} on CPU, {DEFAULT_CUDA_LANES} on CUDA)")
    serve.add_argument("--allow-group", default=None, metavar="GROUP",
                       help="also accept peers of this group (default: only this user)")
    serve.add_argument("--metrics-addr", default=None, metavar="HOST:PORT",
                       help=f'Prometheus exporter (default: {DEFAULT_METRICS_ADDR}; "" disables)')
    serve.add_argument("--cache-budget", default=None, metavar="BYTES|auto",
                       help="prefix cache allowance, e.g. 2GiB (default: auto)")
    serve.add_argument("--no-cache", action="store_true", help="turn the prefix cache off (default: on)")
    serve.add_argument("--page-size", type=int, default=None, help=f"KV rows per page (default: {DEFAULT_PAGE_SIZE})")
    serve.add_argument("--grid", type=int, default=None, help=f"prefill chunk length G (default: {DEFAULT_GRID})")
    serve.add_argument("--max-context", type=int, default=None,
                       help=f"context cap (default: the model's; at most {DEFAULT_CPU_MAX_CONTEXT} on CPU)")
    serve.add_argument("--draft", default=None, choices=("auto", "mtp", "ngram", "off"),
                       help="draft tokens to verify in each decode round: ngram (prompt lookup), mtp (the "
                            "model's own multi-token-prediction head; qwen3_5 checkpoints that ship one), off, "
                            "or auto: the drafter measured to pay for the model and mode, else off (default: auto)")
    serve.add_argument("--draft-max", type=int, default=None, help="most drafted tokens per lane and round (default: 4)")
    serve.add_argument("--cuda-graphs", default=None, choices=("auto", "eager", "off"),
                       help="auto: decode rounds replay CUDA graphs captured at start-up (CUDA; the hybrid "
                            "family: rounds of one decode row per lane); eager: the same fixed programs run "
                            "uncaptured, on any device (a check of them); off: every round runs op by op "
                            "(default: auto)")
    serve.add_argument("--overlap", default=None, choices=("auto", "on", "off"),
                       help="run each round's device call on a thread of its own while the engine takes new "
                            "requests and seats them for the next round; auto: on for CUDA, off on the CPU, "
                            "where the host work is small beside the round (default: auto)")
    serve.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                       help=f"on SIGTERM, time in-flight streams get to finish (default: {DEFAULT_GRACE_S:g})")
    serve.add_argument("--disk-cache", default=None, metavar="DIR",
                       help="disk tier below the prefix cache (default: $STATE_DIRECTORY under systemd, else "
                            '$XDG_CACHE_HOME/prefixd, else ~/.cache/prefixd; "" turns it off)')
    serve.add_argument("--disk-budget", default=None, metavar="BYTES",
                       help="bytes the disk tier may hold (default: 8GiB; 0 turns it off)")
    serve.add_argument("--idle-exit", default=None, type=float, metavar="SECONDS",
                       help="flush the disk tier and exit after this long with no client and no request "
                            "(default: never; for socket-activated units)")
    serve.add_argument("--log-level", default=None, choices=LOG_LEVELS, help="log verbosity (default: info)")
    serve.add_argument("--client-frame-rate", type=float, default=None, metavar="FRAMES",
                       help="frames a second one client (peer process, all its connections) is read at, "
                            f"beyond its burst; 0: unpaced (default: {DEFAULT_CLIENT_FRAME_RATE:g})")
    serve.add_argument("--client-frame-burst", type=int, default=None, metavar="FRAMES",
                       help=f"frames a client may send at once (default: {DEFAULT_CLIENT_FRAME_BURST})")
    serve.add_argument("--error-frame-cost", type=int, default=None, metavar="FRAMES",
                       help=f"what a frame refused with an error costs a client (default: {DEFAULT_ERROR_FRAME_COST})")
    serve.add_argument("--connect-frame-cost", type=int, default=None, metavar="FRAMES",
                       help=f"what a new connection costs a client (default: {DEFAULT_CONNECT_FRAME_COST})")
    serve.add_argument("--abandon-grace", type=int, default=None, metavar="N",
                       help="generates a client may abandon (cancel, or hang up on) before its next "
                            f"ones wait while other clients are served; one is forgiven every "
                            f"{1 / AbandonLimits().drain_per_s:g} s (default: {DEFAULT_ABANDON_GRACE})")
    serve.add_argument("--abandon-hold-max", type=float, default=None, metavar="SECONDS",
                       help=f"the longest such wait, doubling from {HOLD_BASE_S:g} s past the grace; 0: never wait "
                            f"(default: {DEFAULT_ABANDON_HOLD_MAX_S:g})")
    serve.add_argument("--http", default=None, metavar="HOST:PORT",
                       help="also serve the OpenAI-compatible HTTP API here (default: off; see docs/http.md)")
    serve.add_argument("--http-token-file", default=None, metavar="FILE",
                       help="bearer token HTTP clients must send; required to listen beyond loopback (default: none)")

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

    units = sub.add_parser("install-units", help="write the systemd units with ExecStart pointing at this prefixd")
    units.add_argument("--user", action="store_true",
                       help="the user units, for systemctl --user (default: the system units)")
    units.add_argument("--dir", type=Path, default=None, metavar="DIR",
                       help="where to write them (default: /etc/systemd/system, or with --user "
                            "$XDG_CONFIG_HOME/systemd/user)")
    units.add_argument("--exec", dest="exec_start", default=None, metavar="COMMAND",
                       help="the program ExecStart runs (default: the prefixd script beside this Python)")
    return parser


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--greedy", action="store_true",
                   help="greedy decoding, no penalty; overrides the defaults below (default: off)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the model's, else 0.7)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: the model's, else 0.9)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest (default: the model's, else 40)")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens under this share of the likeliest (default: the model's, else 0: off)")
    p.add_argument("--repeat-penalty", type=float, default=None, help="penalty on repeated tokens (default: the model's, else 1.1)")
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

    return {"chat": client_cli.chat, "generate": client_cli.generate, "status": client_cli.status}[args.command](args)


def _serve(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the server logs it: imports and config take a while
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"prefixd: {e}", file=sys.stderr)
        return 2
    from prefixd.daemon.server import serve
    from prefixd.daemon.startup import StartupError
    from prefixd.gpu.loading import ModelLoadError

    try:
        return serve(cfg)
    except StartupError as e:
        print(f"prefixd: {e}", file=sys.stderr)
        return 1
    except ModelLoadError as e:
        print(f"prefixd: cannot load model: {e}", file=sys.stderr)
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
