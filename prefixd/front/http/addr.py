"""`--http HOST:PORT` and `--http-token-file`: parsed and checked at start-up."""

from __future__ import annotations

import ipaddress
from pathlib import Path


def split_http_addr(addr: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" ("[::1]:8080" for IPv6); ValueError when malformed."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--http {addr!r}: expected HOST:PORT (e.g. 127.0.0.1:8000)")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(path: Path) -> str:
    """The bearer token in `path` (surrounding whitespace dropped); ValueError if empty."""
    token = path.read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"--http-token-file {path}: the file is empty")
    return token


def check_http_addr(addr: str, token_file: Path | None) -> None:
    """Raise ConfigError unless the address parses and, off loopback, a token file is readable."""
    from prefixd.daemon.config import ConfigError

    try:
        host, _ = split_http_addr(addr)
        if token_file is not None:
            read_token(token_file)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None
    if token_file is None and not is_loopback(host):
        raise ConfigError(f"--http {addr}: listening beyond loopback needs --http-token-file")
