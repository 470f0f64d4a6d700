"""The listening UNIX socket: safe creation, stale-file replacement, and the peer check."""

from __future__ import annotations

import errno
import grp
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

_LISTEN_BACKLOG = 128


class SocketInUseError(RuntimeError):
    """Another live daemon answers on the socket path; it is never stolen."""


class SocketPathError(RuntimeError):
    """The socket path or its directory cannot be used safely (wrong owner, not a socket...)."""


def _ensure_private_dir(directory: Path) -> bool:
    """Create `directory` 0700 (under umask 077: never briefly wider) if missing.

    An existing directory is left as it is unless others could swap the socket in it.
    Returns True when the directory is private to this user (created now, or already 0700).
    """
    old = os.umask(0o077)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    finally:
        os.umask(old)
    st = directory.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise SocketPathError(f"{directory} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise SocketPathError(f"{directory} belongs to uid {st.st_uid}; choose another --socket")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o002 and not mode & stat.S_ISVTX:
        raise SocketPathError(f"{directory} is writable by everyone; choose another --socket")
    return st.st_uid == os.geteuid() and mode & 0o077 in (0, 0o010)


def _is_live(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        return True


def _remove_stale(path: Path) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(f"{path} exists and is not a socket; refusing to replace it")
    if _is_live(path):
        raise SocketInUseError(
            f"a prefixd daemon is already listening on {path}; stop it first or pass another --socket"
        )
    path.unlink()


def bind_listening_socket(path: Path, *, group_gid: int | None = None) -> socket.socket:
    """A listening socket at `path`: directory 0700, socket 0600, created under umask 077.

    A stale socket file (nothing accepts on it) is replaced; a live one raises SocketInUseError.
    With `group_gid` (--allow-group) the directory becomes 0710 and the socket 0660, both owned
    by that group, only after creation, so they are never wider than asked.
    """
    path = Path(path)
    private_dir = _ensure_private_dir(path.parent)
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    os.chmod(path, 0o600)  # explicit: the mode must not depend on the umask alone
    if group_gid is not None:
        if private_dir:  # the group needs to traverse the daemon's own directory
            os.chown(path.parent, -1, group_gid)
            os.chmod(path.parent, 0o710)
        os.chown(path, -1, group_gid)
        os.chmod(path, 0o660)
    sock.listen(_LISTEN_BACKLOG)
    return sock


@dataclass(frozen=True, slots=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """SO_PEERCRED of a connected UNIX socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13
_MAX_PEER_GROUPS = 256  # what fits the 1024-byte getsockopt buffer Python allows


def peer_groups(sock: socket.socket) -> frozenset[int] | None:
    """The peer's supplementary groups as the kernel recorded them at connect (SO_PEERGROUPS).

    None where the kernel lacks the option, or the peer is in more than `_MAX_PEER_GROUPS`
    groups; the caller then falls back to the group database."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, _MAX_PEER_GROUPS * 4)
    except OSError as e:
        if e.errno in (errno.ENOPROTOOPT, errno.EINVAL, errno.ERANGE):
            return None
        raise
    return frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))


@dataclass(frozen=True, slots=True)
class PeerPolicy:
    """Who may talk to the daemon: its own uid, plus members of `allowed_gid` when set.

    Membership is the peer's own credentials: its gid (SO_PEERCRED) and its supplementary
    groups (SO_PEERGROUPS). Only where the kernel cannot tell the groups does the policy
    fall back to the group database's members of `allowed_gid` (`allowed_members`).
    """

    uid: int
    allowed_gid: int | None = None
    allowed_members: frozenset[str] = frozenset()

    @classmethod
    def for_this_process(cls, allow_group: str | None) -> PeerPolicy:
        if allow_group is None:
            return cls(os.geteuid())
        try:
            group = grp.getgrnam(allow_group) if not allow_group.isdigit() else grp.getgrgid(int(allow_group))
        except KeyError:
            raise SocketPathError(f"--allow-group {allow_group!r}: no such group") from None
        return cls(os.geteuid(), group.gr_gid, frozenset(group.gr_mem))

    def allows(self, cred: PeerCred, sock: socket.socket | None = None) -> bool:
        """Whether the peer `cred` (connected on `sock`, whose groups are read) may talk."""
        if cred.uid == self.uid:
            return True
        if self.allowed_gid is None:
            return False
        if cred.gid == self.allowed_gid:
            return True
        groups = peer_groups(sock) if sock is not None else None
        if groups is not None:
            return self.allowed_gid in groups
        return _user_name(cred.uid) in self.allowed_members


def _user_name(uid: int) -> str | None:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None
