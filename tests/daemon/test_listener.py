"""The listening socket: permissions, stale replacement, live socket never stolen, peer policy."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from prefixd.front.listener import (
    PeerCred,
    PeerPolicy,
    SocketInUseError,
    SocketPathError,
    bind_listening_socket,
    peer_cred,
    peer_groups,
)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_socket_is_0600_in_a_new_0700_directory(tmp_path):
    path = tmp_path / "run" / "prefixd" / "prefixd.sock"
    with bind_listening_socket(path):
        assert _mode(path.parent) == 0o700
        assert _mode(path) == 0o600
        assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_stale_socket_file_is_replaced(tmp_path):
    path = tmp_path / "d" / "s.sock"
    old = bind_listening_socket(path)
    old.close()  # the file stays, nobody accepts: stale
    with bind_listening_socket(path) as sock:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))
        conn, _ = sock.accept()
        conn.close()
        client.close()


def test_live_socket_is_never_stolen(tmp_path):
    path = tmp_path / "d" / "s.sock"
    with bind_listening_socket(path):
        inode = os.lstat(path).st_ino
        with pytest.raises(SocketInUseError, match="already listening"):
            bind_listening_socket(path)
        assert os.lstat(path).st_ino == inode


def test_a_regular_file_at_the_path_is_not_replaced(tmp_path):
    path = tmp_path / "s.sock"
    path.write_text("data")
    with pytest.raises(SocketPathError, match="not a socket"):
        bind_listening_socket(path)
    assert path.read_text() == "data"


def test_existing_shared_directory_mode_is_left_alone(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with bind_listening_socket(shared / "s.sock"):
        assert _mode(shared) == 0o1777
        assert _mode(shared / "s.sock") == 0o600


def test_world_writable_directory_without_sticky_bit_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(SocketPathError, match="writable by everyone"):
        bind_listening_socket(d / "s.sock")


def test_allow_group_widens_socket_to_0660_and_dir_to_0710(tmp_path):
    path = tmp_path / "g" / "s.sock"
    gid = os.getegid()
    with bind_listening_socket(path, group_gid=gid):
        assert _mode(path) == 0o660
        assert _mode(path.parent) == 0o710
        assert os.lstat(path).st_gid == gid


def test_peer_cred_reports_this_process():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert peer_cred(a) == PeerCred(os.getpid(), os.geteuid(), os.getegid())


def test_peer_policy_same_uid_only_by_default():
    policy = PeerPolicy(uid=1000)
    assert policy.allows(PeerCred(1, 1000, 1000))
    assert not policy.allows(PeerCred(1, 1001, 1000))


def test_peer_policy_without_a_socket_falls_back_to_primary_gid_and_listed_members():
    policy = PeerPolicy(uid=1000, allowed_gid=50, allowed_members=frozenset({"root"}))
    assert policy.allows(PeerCred(1, 1234, 50))
    assert policy.allows(PeerCred(1, 0, 0))  # uid 0 is "root", listed as a member
    assert not policy.allows(PeerCred(1, 1234, 51))


def test_peer_groups_are_the_peers_own_supplementary_groups():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert peer_groups(a) == frozenset(os.getgroups())


_CHILD = """
import os, socket, sys
os.setgroups([int(g) for g in sys.argv[2].split(",")])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.recv(1)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="setting a peer's groups needs root")
@pytest.mark.parametrize(("groups", "allowed"), [("4242,77", True), ("77", False)])
def test_allow_group_decides_on_the_peers_groups_not_the_group_database(tmp_path, groups, allowed):
    import pwd
    import subprocess
    import sys

    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), groups])
        conn, _ = listener.accept()
        with conn:
            cred = PeerCred(1, 65534, 31337)  # neither the daemon's uid nor the group's gid
            # the group database lists this uid's name as a member: it must not matter
            name = pwd.getpwuid(65534).pw_name
            policy = PeerPolicy(uid=os.geteuid() + 1, allowed_gid=4242, allowed_members=frozenset({name}))
            assert peer_groups(conn) == frozenset(int(g) for g in groups.split(","))
            assert policy.allows(cred, conn) is allowed
            conn.send(b"x")
        assert child.wait(timeout=30) == 0


def test_unknown_allow_group_is_a_clear_error():
    with pytest.raises(SocketPathError, match="no such group"):
        PeerPolicy.for_this_process("no-such-group-prefixd")
