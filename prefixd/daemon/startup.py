"""Start-up checks that fail cheaply, run before the model loads.

Each failure is a `StartupError` whose message is the one line `prefixd serve` prints: it
names the flag or variable at fault and what to do. Order: metrics address, socket, device.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Any

from prefixd.daemon.config import DaemonConfig
from prefixd.front.listener import SocketInUseError, SocketPathError, bind_listening_socket
from prefixd.daemon.systemd import ActivationError, take_activation_socket


class StartupError(RuntimeError):
    """The daemon cannot start as configured; the message is one line for the user."""


def open_exporter(registry: Any, metrics_addr: str) -> Any | None:
    """The HTTP exporter bound to `--metrics-addr`, or None when it is ""."""
    from prefixd.metrics import MetricsExporter, parse_metrics_addr

    addr = parse_metrics_addr(metrics_addr)
    if addr is None:
        return None
    try:
        return MetricsExporter(registry, addr)
    except OSError as e:
        hint = "pass another --metrics-addr, or --metrics-addr '' to turn the exporter off"
        if e.errno == errno.EADDRINUSE:
            raise StartupError(f"--metrics-addr {metrics_addr}: the address is in use; {hint}") from None
        raise StartupError(f"--metrics-addr {metrics_addr}: cannot bind: {e.strerror or e}; {hint}") from None


def activation_socket(env: dict[str, str] | os._Environ[str]) -> socket.socket | None:
    """The socket systemd passed in, or None."""
    try:
        return take_activation_socket(env)  # type: ignore[arg-type]
    except ActivationError as e:
        raise StartupError(str(e)) from None


def bind_socket(path: Path, group_gid: int | None) -> socket.socket:
    """The daemon's own listening socket at `path` (see `bind_listening_socket`)."""
    try:
        return bind_listening_socket(path, group_gid=group_gid)
    except (SocketInUseError, SocketPathError) as e:
        raise StartupError(str(e)) from None
    except OSError as e:
        raise StartupError(f"--socket {path}: {_why(e, path)}") from None


def _why(e: OSError, path: Path) -> str:
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        return "a parent of the path is not a directory"
    if e.errno == errno.EROFS:
        return "the filesystem is read-only; choose a path on a writable one (e.g. under $XDG_RUNTIME_DIR)"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied ({e.filename or path.parent}); choose a directory you own"
    if e.errno == errno.ENAMETOOLONG or "too long" in str(e):
        return "the path is too long for a UNIX socket (108 bytes); choose a shorter one"
    return f"cannot create the socket: {e.strerror or e}"


def check_device(cfg: DaemonConfig) -> None:
    """`--device cuda` on a torch without CUDA, or without a visible GPU, fails here."""
    if cfg.device == "cpu":
        return
    from prefixd.gpu.backend import DeviceError
    from prefixd.gpu.backend import check_device as gpu_check_device

    try:
        gpu_check_device(cfg.device)
    except DeviceError as e:
        raise StartupError(str(e)) from None
