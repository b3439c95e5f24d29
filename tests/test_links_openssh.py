"""Bulk streams to an SSH node (code sync's tar) go through the OpenSSH client, held to the host key the link
checked; on the link's own connection when there is no client, or when it cannot log in. Real loopback sshd
nodes; the OpenSSH client is the real one, wrapped by a script that notes each call."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster import links
from cluster.links import HostKeyError, NodeLink

from .test_links_retry import endpoint

WRITE_TO = ["sh", "-c", 'cat > "$1"', "sh"]  # argv on the node: stdin into the file named next


def client(tmp_path: Path, body: str) -> tuple[str, Path]:
    """An executable standing in for `ssh` that notes its arguments, then runs body; (its path, its notes)."""
    notes = tmp_path / "ssh-calls"
    path = tmp_path / "ssh"
    path.write_text(f'#!/bin/sh\necho "$@" >> "{notes}"\n{body}\n')
    path.chmod(0o755)
    return str(path), notes


@pytest.fixture
def link(loopback):
    link = NodeLink(endpoint(loopback), connect_timeout=10)
    yield link
    link.close()


def test_a_stream_goes_through_the_openssh_client_holding_the_node_to_its_checked_key(link, tmp_path, monkeypatch):
    # given a node the link has met, and the real OpenSSH client (noted)
    link.request("hello")
    path, notes = client(tmp_path, f'exec {links.SSH_CLIENT} "$@"')
    monkeypatch.setattr(links, "SSH_CLIENT", path)
    # when 3 MB go to a file whose name a shell would split and unquote
    data = [os.urandom(1 << 20) for _ in range(3)]
    target = tmp_path / "it's a $HOME; file.bin"
    rc, err = link.run_with_input([*WRITE_TO, str(target)], data, timeout=30)
    # then every byte arrived, through one OpenSSH client held to the key the link checked
    assert rc == 0, err
    assert target.read_bytes() == b"".join(data)
    calls = notes.read_text().splitlines()
    assert len(calls) == 1 and "StrictHostKeyChecking=yes" in calls[0] and "ControlPath=none" in calls[0]
    assert "HostKeyAlias=ugro-node" in calls[0] and "GlobalKnownHostsFile=/dev/null" in calls[0]
    assert "Ciphers=aes128-gcm@openssh.com," in calls[0]  # the cheaper cipher first, OpenSSH's defaults after it


def test_a_node_offering_the_openssh_client_another_key_is_refused_in_one_line(link, loopback, tmp_path):
    # given a link that holds a key other than the one the node now offers (as after the node's key changed
    # between the link's check and the stream): a valid key, but the client's
    link.request("hello")
    other = Path(f"{loopback.client_key}.pub").read_text().split()
    link.host_key = f"{other[0]} {other[1]}"
    target = tmp_path / "never.bin"
    # when a stream is sent, it is refused in one line naming the node, and nothing ran there
    with pytest.raises(HostKeyError) as info:
        link.run_with_input([*WRITE_TO, str(target)], [b"secret"], timeout=30)
    message = str(info.value)
    assert message.startswith("node1 (") and "host key changed" in message and "\n" not in message
    assert links.fingerprint(link.host_key) in message and "ugro trust node1" in message
    assert not target.exists()


def test_without_the_openssh_client_a_stream_goes_on_the_links_own_connection(link, tmp_path, monkeypatch):
    monkeypatch.setattr(links, "SSH_CLIENT", None)
    target = tmp_path / "paramiko.bin"
    rc, err = link.run_with_input([*WRITE_TO, str(target)], [b"a" * 70000, b"b" * 10], timeout=30)
    assert rc == 0, err
    assert target.read_bytes() == b"a" * 70000 + b"b" * 10


def test_an_openssh_client_that_cannot_log_in_hands_the_stream_to_the_links_connection(link, tmp_path,
                                                                                      monkeypatch):  # fmt: skip
    # given an OpenSSH client that cannot log in where the link (paramiko) did
    path, notes = client(tmp_path, 'echo "user@node: Permission denied (publickey)." >&2; exit 255')
    monkeypatch.setattr(links, "SSH_CLIENT", path)
    # when two streams are sent (chunks that can be read again from their start)
    for name in ("first.bin", "second.bin"):
        rc, err = link.run_with_input([*WRITE_TO, str(tmp_path / name)], [b"x" * 5000], timeout=30)
        assert rc == 0, err
        assert (tmp_path / name).read_bytes() == b"x" * 5000
    # then both arrived over the link's connection, and the client was tried once only
    assert len(notes.read_text().splitlines()) == 1
    # and a one-shot iterator, which cannot be sent again, is not: its failure is the answer
    fresh = NodeLink(link.ep, connect_timeout=10)
    try:
        rc, err = fresh.run_with_input([*WRITE_TO, str(tmp_path / "third.bin")], iter([b"y"]), timeout=30)
    finally:
        fresh.close()
    assert rc == 255 and "Permission denied" in err and not (tmp_path / "third.bin").exists()


class _File:
    """A stream held in a file, as jobs.sync.StreamFile is: a fileno() and, iterated, its bytes."""

    def __init__(self, path: Path) -> None:
        self.fh = path.open("rb")

    def fileno(self) -> int:
        return self.fh.fileno()

    def __iter__(self):
        self.fh.seek(0)
        return iter(lambda: self.fh.read(1 << 16), b"")


@pytest.mark.parametrize("sendfile", ["kernel", "refused"])
def test_a_stream_held_in_a_file_arrives_whole_through_the_openssh_client(link, tmp_path, monkeypatch, sendfile):
    # given a node the link has met, 3 MB in a file, and (or not) a kernel that copies a file into a pipe
    link.request("hello")
    path, notes = client(tmp_path, f'exec {links.SSH_CLIENT} "$@"')
    monkeypatch.setattr(links, "SSH_CLIENT", path)
    if sendfile == "refused":

        def no_sendfile(*args):
            raise OSError(22, "Invalid argument")

        monkeypatch.setattr(links.os, "sendfile", no_sendfile)
    source = tmp_path / "stream.bin"
    source.write_bytes(os.urandom(3 * (1 << 20) + 12345))
    stream = _File(source)
    # when it is sent twice (the file is read from its start each time)
    for name in ("first.bin", "second.bin"):
        rc, err = link.run_with_input([*WRITE_TO, str(tmp_path / name)], stream, timeout=30)
        # then every byte arrived, through the OpenSSH client
        assert rc == 0, err
        assert (tmp_path / name).read_bytes() == source.read_bytes()
    assert len(notes.read_text().splitlines()) == 2


@pytest.mark.parametrize("openssh", [True, False], ids=["openssh", "the link's own connection"])
def test_a_forwarded_connection_carries_a_stream_and_its_answer_and_nothing_listening_is_an_error(
    link, tmp_path, monkeypatch, openssh
):
    import socket
    import threading

    if not openssh:
        monkeypatch.setattr(links, "SSH_CLIENT", None)
    # given a process on the node listening on 127.0.0.1, which answers with how many bytes it read
    server = socket.create_server(("127.0.0.1", 0))
    got = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            data = b""
            while chunk := conn.recv(1 << 16):
                data += chunk
            got.append(data)
            conn.sendall(b"read %d\n" % len(data))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    # when a head and 2 MB go there through SSH, the stream arrives whole and its answer comes back
    data = [os.urandom(1 << 20) for _ in range(2)]
    assert link.forward(port, b"head\n", data, timeout=30) == (0, f"read {5 + (2 << 20)}\n")
    thread.join(10)
    assert got == [b"head\n" + b"".join(data)]
    server.close()
    # and a port where nothing listens is an error that says so, not an sshd that forwards nothing
    rc, why = link.forward(port, b"head\n", data, timeout=30)
    assert rc != 0 and "could not connect to port" in why and not link.forward_refused
