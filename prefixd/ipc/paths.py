"""Where the daemon's socket lives by default."""

from __future__ import annotations

import os
from pathlib import Path

SOCKET_NAME = "prefixd.sock"


def default_socket_path() -> Path:
    """$PREFIXD_SOCKET if set; else $XDG_RUNTIME_DIR/prefixd/prefixd.sock; else
    /run/prefixd/prefixd.sock for root; else /tmp/prefixd-$UID/prefixd.sock."""
    override = os.environ.get("PREFIXD_SOCKET")
    if override:
        return Path(override)
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return Path(runtime_dir) / "prefixd" / SOCKET_NAME
    uid = os.getuid()
    if uid == 0:
        return Path("/run/prefixd") / SOCKET_NAME
    return Path(f"/tmp/prefixd-{uid}") / SOCKET_NAME
