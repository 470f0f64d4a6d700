"""systemd glue in pure Python: sd_notify datagrams, the watchdog interval, socket activation."""

from __future__ import annotations

import os
import socket
import stat

SD_LISTEN_FDS_START = 3  # the first passed fd, by systemd's convention


class Notifier:
    """Sends sd_notify messages to $NOTIFY_SOCKET; a no-op when the variable is unset.

    Abstract socket addresses ("@name") are supported. The variable is read once at
    construction; send failures are reported by `notify`'s return value, never raised,
    because a missing supervisor must not stop the daemon.
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        self._addr: str | bytes | None = None
        if raw.startswith("@"):
            self._addr = b"\0" + raw[1:].encode()
        elif raw.startswith("/"):
            self._addr = raw
        self.watchdog_interval_s = watchdog_interval_s(env)

    @property
    def enabled(self) -> bool:
        return self._addr is not None

    def notify(self, message: str) -> bool:
        """Send one datagram ("READY=1", "STATUS=...", ...); True when it was sent."""
        if self._addr is None:
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            try:
                sock.sendto(message.encode(), self._addr)
            except OSError:
                return False
        return True

    def ready(self, status: str) -> bool:
        return self.notify(f"READY=1\nSTATUS={status}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")


def watchdog_interval_s(env: dict[str, str] | os._Environ[str]) -> float | None:
    """Half of WATCHDOG_USEC in seconds when the watchdog is meant for this process, else None."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2 / 1_000_000


class ActivationError(RuntimeError):
    """The passed socket cannot be used (wrong type, not listening, too many fds)."""


def take_activation_socket(env: dict[str, str] | None = None) -> socket.socket | None:
    """The listening UNIX socket systemd passed in (LISTEN_FDS/LISTEN_PID, fd 3), or None.

    Unsets LISTEN_FDS, LISTEN_PID and LISTEN_FDNAMES so children never inherit them.
    """
    env = os.environ if env is None else env
    fds_text = env.get("LISTEN_FDS", "")
    pid_text = env.get("LISTEN_PID", "")
    for name in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
        env.pop(name, None)
    if not fds_text.isdigit() or int(fds_text) == 0:
        return None
    if pid_text and pid_text != str(os.getpid()):
        return None
    if int(fds_text) != 1:
        raise ActivationError(f"socket activation passed {fds_text} fds; prefixd takes exactly one")
    fd = SD_LISTEN_FDS_START
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        raise ActivationError(f"LISTEN_FDS=1 but fd {fd} is not open: {e.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise ActivationError(f"fd {fd} from socket activation is not a socket")
    sock = socket.socket(fileno=fd)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        sock.detach()
        raise ActivationError("socket activation passed a socket that is not a UNIX stream socket")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise ActivationError("socket activation passed a socket that is not listening")
    os.set_inheritable(fd, False)
    return sock
