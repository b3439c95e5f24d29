"""Warm links to nodes: one connection per node, one small agent at its end, JSON lines between.

A link starts the node agent (cluster/node/agent.py, sent as source) once, over SSH through Fabric
or as a local subprocess, and then every probe, rank start, tail and kill is one request on it.
No user value is ever interpolated into a shell string: the only shell command sent is the
agent's bootstrap, built from the node's python path through shlex.quote.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import itertools
import json
import logging
import os
import select
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NODE_CODE_DIR = Path(__file__).resolve().parent / "node"
# Files that make up the agent, in order; the last one serves requests.
AGENT_FILES = ("probe.py", "codesync.py", "transfer.py", "cache.py", "envs.py", "agent.py")
# how long connecting to a node and its first answer may take: a LAN sshd answers in well under a second,
# and a silent node must fail a probe, a pre-flight or a follower's read fast
CONNECT_TIMEOUT_S = 5.0
EXEC_TIMEOUT_FACTOR = 3  # x the connect timeout: how long starting the agent in a new session may take
READ_RECHECK_S = 0.25  # a wait for an answer looks at the channel's buffer at least this often (see _readline)
LOCK_POLL_S = 0.2  # how often a request waiting for a taken link looks whether its node went silent
# The OpenSSH client, when installed: bulk streams to an SSH node go through it, one process per stream, instead
# of through this process's paramiko (Python packetizing every byte under one GIL). None: paramiko only.
SSH_CLIENT = shutil.which("ssh")
HOST_ALIAS = "ugro-node"  # the one name in a bulk stream's own known_hosts file
# A bulk stream's ciphers, best first: AES-GCM runs on the AES and carry-less multiply instructions of most x86 and
# ARM servers, at about 70% of the CPU of OpenSSH's default chacha20-poly1305 on both ends; then OpenSSH's own
# defaults, so that a node whose sshd allows only those still takes the stream.
STREAM_CIPHERS = ("aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,"
                  "aes128-ctr,aes192-ctr,aes256-ctr")  # fmt: skip
LOCAL_PIPE_BYTES = 1 << 20  # Linux's default pipe-max-size for an unprivileged process
BOOTSTRAP = (
    "import sys;b=sys.stdin.buffer;n=int(b.readline());g={'__name__':'__ugro_agent__'};"
    "exec(compile(b.read(n),'ugro-agent','exec'),g)"
)


class LinkError(Exception):
    """The node could not be reached, or the link broke: the message says which and why.

    `delivered` is False only when the request provably never reached the agent (connecting
    failed, or the link was dead before the request was fully written): only then is it safe to
    send again. True means it may have run on the node.
    """

    def __init__(self, message: str, delivered: bool = False) -> None:
        super().__init__(message)
        self.delivered = delivered


class LinkBusy(LinkError):
    """The request was not sent: another request held the link for all of this one's timeout while the
    node kept answering (a long request, not a silent node)."""


class _NoAnswer(LinkError):
    """Nothing came back in time on a link that had not closed: the node (or the path to it) is silent."""


class AgentRequestError(Exception):
    """The agent was reached but refused or failed the request; the message is the agent's."""


class HostKeyError(LinkError):
    """The node offered a host key other than the one pinned for it (or in known_hosts): nothing was
    sent to it, not even our credentials' signature."""


def fingerprint(key_line: str) -> str:
    """SHA256 fingerprint of a host key given as 'type base64', the way OpenSSH prints it."""
    try:
        blob = base64.b64decode(key_line.split()[1], validate=True)
    except (IndexError, ValueError):
        return "(unreadable key)"
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def key_line(key) -> str:
    """A paramiko key as 'type base64' (the known_hosts form without the host)."""
    return f"{key.get_name()} {key.get_base64()}"


# Set by the cluster app: records a node's first-seen host key in the database and returns the key
# pinned for it afterwards (another process may have pinned a different one first). None: links
# pin in memory only, for the life of the link.
host_key_recorder: Callable[[Endpoint, str, str], str] | None = None


@dataclass(frozen=True)
class Endpoint:
    """How to reach one node; the key for reusing a warm link."""

    name: str
    address: str
    port: int = 22
    user: str = ""
    key_path: str = ""
    transport: str = "ssh"  # "ssh" or "local"
    python: str = "/usr/bin/python3"
    host_key: str = ""  # the pinned host key, 'type base64'; "" = none pinned yet
    known_hosts: str = ""  # an OpenSSH known_hosts file consulted when no key is pinned

    @property
    def host_key_name(self) -> str:
        """The name known_hosts uses for this endpoint."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"

    def describe(self) -> str:
        if self.transport == "local":
            return f"{self.name} (local)"
        who = f"{self.user}@" if self.user else ""
        return f"{self.name} ({who}{self.address}:{self.port})"


@functools.cache
def node_file(name: str) -> bytes | None:
    """A file of the code UGRO runs on nodes, as it was when this process first read it: what a process sends
    its nodes (the agent, the code-sync receiver) matches its own code, even after UGRO was updated on disk
    and before the process was restarted."""
    path = NODE_CODE_DIR / name
    return path.read_bytes() if path.exists() else None


def agent_source(extra: bytes = b"") -> bytes:
    """The agent's files in order, with `extra` source placed just before the last (serving) one."""
    parts = [src for src in map(node_file, AGENT_FILES) if src is not None]
    if extra:
        parts.insert(len(parts) - 1, extra)
    return b"\n\n".join(parts)


class _Pipe:
    """A byte stream in each direction with a select-able read side; `alive()` is False once the
    far end is known to be gone (the agent exited or the channel closed)."""

    def __init__(self, send, recv, fileno, close, stderr, alive, host_key: str = "", host_key_source: str = "",
                 pending=None, run_with_input=None, forward=None) -> None:  # fmt: skip
        self.send, self.recv, self.fileno, self._close, self.stderr = send, recv, fileno, close, stderr
        self.alive = alive
        # run_with_input(argv, chunks, timeout) -> (exit code, stderr tail): a command beside the agent on the
        # same connection, its stdin the chunks as raw bytes (bulk data without the requests' JSON framing)
        self.run_with_input = run_with_input
        # forward(port, chunks, timeout) -> (0, what came back) or (-1, why); None where the node's sshd
        # forwards no connections: the chunks to 127.0.0.1:port on the node, then its answer until it closes
        self.forward = forward
        # Whether recv() has something (or the end) to return now, without blocking; by default, whether the read
        # side is readable (a plain pipe's is exactly that).
        self.pending = pending or self._readable
        self.host_key, self.host_key_source = host_key, host_key_source

    def _readable(self) -> bool:
        return bool(select.select([self.fileno()], [], [], 0)[0])

    def close(self) -> None:
        try:
            self._close()
        except Exception:  # closing a broken link must never raise
            pass


def _open_local(ep: Endpoint, timeout: float, pinned: str = "") -> _Pipe:
    proc = subprocess.Popen(
        [ep.python, "-u", "-c", BOOTSTRAP],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:  # the agent's source (about 64 KiB) goes in one write before any answer: room for all of it, so that a
        # local python that never reads (hung) is found silent by the connect's timeout, not blocked on a full pipe
        fcntl.fcntl(proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, LOCAL_PIPE_BYTES)
    except (OSError, AttributeError):  # not Linux, or above the system's pipe-max-size
        pass

    def send(data: bytes) -> None:
        proc.stdin.write(data)
        proc.stdin.flush()

    def close() -> None:
        proc.stdin.close()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()

    def stderr() -> str:
        if proc.poll() is None:
            return ""
        return proc.stderr.read().decode("utf-8", "replace")[-2000:]

    def run_with_input(argv: list[str], chunks, timeout: float) -> tuple[int, str]:
        side = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            try:
                for chunk in chunks:
                    side.stdin.write(chunk)
                side.stdin.close()
            except BrokenPipeError:  # the command ended early: its exit code and stderr say why
                with contextlib.suppress(OSError):
                    side.stdin.close()
            err = side.stderr.read(65536)
            return side.wait(timeout=timeout), err.decode("utf-8", "replace")[-2000:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            side.kill()
            side.wait()
            return -1, str(exc) or type(exc).__name__

    def forward(port: int, chunks, timeout: float) -> tuple[int, str]:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
                for chunk in chunks:
                    sock.sendall(chunk)
                sock.shutdown(socket.SHUT_WR)
                return 0, _read_to_end(sock.recv)
        except OSError as exc:
            return -1, str(exc) or type(exc).__name__

    fd = proc.stdout.fileno()
    return _Pipe(send, lambda n: os.read(fd, n), lambda: fd, close, stderr, lambda: proc.poll() is None,
                 run_with_input=run_with_input, forward=forward)  # fmt: skip


def _read_to_end(recv, limit: int = 65536) -> str:
    """What a forwarded connection sends back, until it closes (at most `limit` bytes kept)."""
    out = b""
    while data := recv(65536):
        out = (out + data)[-limit:]
    return out.decode("utf-8", "replace")


def ssh_socket(ep: Endpoint, host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to the node's sshd on which its banner has begun to arrive, within `timeout`.

    Paramiko would wait for the banner itself, but a silent sshd (a hung or frozen machine whose
    kernel still accepts connections) then surfaces as "No existing session" plus a logged
    traceback; here each way of not answering becomes one plain line, and fails within the timeout.
    """
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        raise _NoAnswer(
            f"node {ep.name}: SSH did not answer within {timeout:g} s (no connection to {host}:{port})"
        ) from None
    except OSError as exc:
        raise LinkError(f"cannot reach {ep.describe()}: {exc.strerror or exc}") from None
    try:
        ready, _, _ = select.select([sock], [], [], timeout)
        first = sock.recv(1, socket.MSG_PEEK) if ready else None  # peeked: paramiko still reads the banner
    except OSError as exc:
        sock.close()
        raise LinkError(f"cannot reach {ep.describe()}: {exc.strerror or exc}") from None
    if not first:
        sock.close()
        if first is None:
            raise _NoAnswer(
                f"node {ep.name}: SSH did not answer within {timeout:g} s "
                f"({host}:{port} accepted the connection but sent no SSH banner)"
            )
        raise LinkError(f"cannot reach {ep.describe()}: the connection was closed before SSH answered")
    sock.settimeout(None)
    return sock


def _expected_keys(ep: Endpoint, pinned: str) -> tuple[list, str]:
    """The keys the node must offer and where they come from: the pinned key, else known_hosts."""
    from paramiko.hostkeys import HostKeyEntry, HostKeys

    if pinned:
        entry = HostKeyEntry.from_line(f"{ep.host_key_name} {pinned}")
        if entry is None or entry.key is None:
            raise HostKeyError(f"{ep.describe()}: the pinned host key cannot be read; run `ugro trust {ep.name}`")
        return [entry.key], "pinned"
    path = os.path.expanduser(ep.known_hosts) if ep.known_hosts else ""
    if path and os.path.isfile(path):
        try:
            found = HostKeys(path).lookup(ep.host_key_name)
        except (OSError, ValueError) as exc:
            raise LinkError(f"{ep.describe()}: cannot read {ep.known_hosts}: {exc}") from None
        if found:
            return list(found.values()), "known_hosts"
    return [], "first use"


def _changed_key_message(ep: Endpoint, offered: str, expected: list[str], source: str) -> str:
    want = " or ".join(fingerprint(k) for k in expected)
    where = f"the key in {ep.known_hosts}" if source == "known_hosts" else "the pinned key"
    return (
        f"{ep.describe()}: host key changed: the node offers {fingerprint(offered)} but {where} is {want}; "
        f"refused (someone may be answering for it). If {ep.name} was reinstalled, check the key on it and run "
        f"`ugro trust {ep.name}`"
    )


def _open_ssh(ep: Endpoint, timeout: float, pinned: str = "") -> _Pipe:
    from fabric import Connection
    from paramiko import MissingHostKeyPolicy
    from paramiko.ssh_exception import BadHostKeyException, ChannelException, SSHException

    connect_kwargs: dict[str, Any] = {"banner_timeout": timeout, "auth_timeout": timeout}
    if ep.key_path:
        connect_kwargs["key_filename"] = os.path.expanduser(ep.key_path)
    conn = Connection(
        host=ep.address,
        user=ep.user or None,
        port=ep.port,
        connect_timeout=timeout,
        connect_kwargs=connect_kwargs,
    )
    expected, source = _expected_keys(ep, pinned)

    class _FirstUse(MissingHostKeyPolicy):
        # Called only when nothing is expected; the caller records the key it was offered.
        def missing_host_key(self, client, hostname, key) -> None:
            pass

    # paramiko checks the offered key against these before authenticating (and prefers their type).
    conn.client.set_missing_host_key_policy(_FirstUse())
    for key in expected:
        conn.client.get_host_keys().add(ep.host_key_name, key.get_name(), key)
    if conn.gateway is None:
        # Direct connections only (a ProxyJump/ProxyCommand from ~/.ssh/config is Fabric's to open);
        # conn.host and conn.port are after ~/.ssh/config's HostName and Port.
        conn.connect_kwargs["sock"] = ssh_socket(ep, conn.host, int(conn.port), timeout)
    stalled = threading.Event()
    try:
        conn.open()
        transport = conn.client.get_transport()
        transport.set_keepalive(15)
        chan = transport.open_session(timeout=timeout)
        offered = key_line(transport.get_remote_server_key())

        # paramiko waits for exec's reply with no time limit, under this link's lock: a node that froze
        # right here would hold every later request. Closing the transport ends that wait. The bound is
        # generous (the session's fork and login run on a node that may be busy); it only has to exist.
        def give_up() -> None:
            stalled.set()
            transport.close()

        timer = threading.Timer(EXEC_TIMEOUT_FACTOR * timeout, give_up)
        timer.daemon = True
        timer.start()
        try:
            chan.exec_command(f"exec {shlex.quote(ep.python)} -u -c {shlex.quote(BOOTSTRAP)}")
        finally:
            timer.cancel()
        if stalled.is_set():
            raise EOFError
    except BadHostKeyException as exc:
        conn.close()
        message = _changed_key_message(ep, key_line(exc.key), [key_line(k) for k in expected], source)
        raise HostKeyError(message) from None
    except (OSError, SSHException, EOFError) as exc:
        conn.close()
        if stalled.is_set():
            waited = EXEC_TIMEOUT_FACTOR * timeout
            raise _NoAnswer(f"node {ep.name}: SSH did not answer within {waited:g} s (starting the agent)") from None
        raise LinkError(f"cannot reach {ep.describe()}: {exc or type(exc).__name__}") from None

    def send(data: bytes) -> None:
        try:
            chan.sendall(data)
        except (SSHException, EOFError) as exc:
            raise OSError(str(exc) or type(exc).__name__) from None

    def alive() -> bool:
        return not (chan.closed or chan.eof_received or chan.exit_status_ready()) and transport.is_active()

    err_tail = bytearray()

    def take_stderr() -> None:
        while chan.recv_stderr_ready():
            err_tail.extend(chan.recv_stderr(65536))
            del err_tail[:-4000]

    def pending() -> bool:
        # The channel's fileno turns readable for stderr as well; recv() reads stdout and would block
        # with only stderr waiting. Taking the stderr clears that, and says whether stdout (or EOF) is there.
        take_stderr()
        return chan.recv_ready() or chan.eof_received or chan.closed

    def stderr() -> str:
        take_stderr()
        return bytes(err_tail).decode("utf-8", "replace")[-2000:]

    def close() -> None:
        chan.close()
        conn.close()

    def run_with_input(argv: list[str], chunks, timeout: float) -> tuple[int, str]:
        try:
            side = transport.open_session(timeout=timeout)
            side.settimeout(timeout)
            side.exec_command(shlex.join(argv))
            try:
                for chunk in chunks:
                    side.sendall(chunk)
                side.shutdown_write()
            except OSError:  # the command ended early (its exit code and stderr say why), or the channel closed
                pass
            except BaseException:  # the chunks' own error (a stream that could not be built): the command ends
                side.close()
                raise
            if not side.status_event.wait(timeout):  # set by the exit status, or by the channel closing
                side.close()
                return -1, f"no exit status within {timeout:g} s"
            err = b""
            while side.recv_stderr_ready():
                err += side.recv_stderr(65536)
            rc = side.recv_exit_status()
            side.close()
            return rc, err.decode("utf-8", "replace")[-2000:]
        except (OSError, SSHException, EOFError) as exc:
            return -1, str(exc) or type(exc).__name__

    def forward(port: int, chunks, timeout: float) -> tuple[int, str] | None:
        try:
            side = transport.open_channel("direct-tcpip", ("127.0.0.1", port), ("127.0.0.1", 0), timeout=timeout)
        except ChannelException as exc:
            if exc.code == 1:  # SSH_OPEN_ADMINISTRATIVELY_PROHIBITED: the node's sshd forwards no connections
                return None
            return -1, f"the node's sshd could not connect to port {port} there: {exc.text}"
        except (OSError, SSHException, EOFError) as exc:
            return -1, str(exc) or type(exc).__name__
        try:
            side.settimeout(timeout)
            try:
                for chunk in chunks:
                    side.sendall(chunk)
                side.shutdown_write()
            except OSError:  # the far end closed early: what it sent back says why
                pass
            return 0, _read_to_end(side.recv)
        except (OSError, SSHException, EOFError) as exc:
            return -1, str(exc) or type(exc).__name__
        finally:
            side.close()

    return _Pipe(send, chan.recv, chan.fileno, close, stderr, alive, offered, source, pending, run_with_input,
                 forward)  # fmt: skip


def _run_over_openssh(ep: Endpoint, host_key: str, argv: list[str] | None, chunks, timeout: float,
                      connect_timeout: float, port: int | None = None,
                      head: bytes = b"") -> tuple[int, str, str]:  # fmt: skip
    """argv on the node through the OpenSSH client, or with `port` a connection to 127.0.0.1:port on the node
    (`ssh -W`), `head` then the chunks its stdin (of an object with a fileno(), the file's bytes: _send_file);
    (exit code, stderr tail, stdout tail), 255 when ssh itself failed. The node must offer host_key and no other (a
    known_hosts file of that key alone, no shared connection); ~/.ssh/config applies as it does for the link.
    HostKeyError when it offers another. Killed when `timeout` s pass without a chunk written, or after the
    last one without an end."""
    with tempfile.TemporaryDirectory(prefix="ugro-ssh-") as tmp:
        known = os.path.join(tmp, "known_hosts")
        with open(known, "w") as fh:
            fh.write(f"{HOST_ALIAS} {host_key}\n")
        who = ["-l", ep.user] if ep.user else []
        key = ["-i", os.path.expanduser(ep.key_path)] if ep.key_path else []
        options = {
            "UserKnownHostsFile": f'"{known}"', "GlobalKnownHostsFile": "/dev/null", "HostKeyAlias": HOST_ALIAS,
            "StrictHostKeyChecking": "yes", "CheckHostIP": "no", "UpdateHostKeys": "no", "VerifyHostKeyDNS": "no",
            "BatchMode": "yes", "ControlMaster": "no", "ControlPath": "none", "ClearAllForwardings": "yes",
            "PermitLocalCommand": "no", "ConnectTimeout": str(max(1, round(connect_timeout))),
            "ServerAliveInterval": "15", "LogLevel": "ERROR", "Ciphers": STREAM_CIPHERS,
        }  # fmt: skip
        remote = ["-W", f"127.0.0.1:{port}", "--", ep.address] if port else ["--", ep.address, shlex.join(argv)]
        cmd = [SSH_CLIENT, "-T", "-x", "-a", "-p", str(ep.port), *who, *key,
               *(arg for name, value in options.items() for arg in ("-o", f"{name}={value}")), *remote]  # fmt: skip
        with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err)
            last, done = [time.monotonic()], threading.Event()

            def watch() -> None:
                while not done.wait(1.0):
                    if time.monotonic() - last[0] > timeout:
                        proc.kill()
                        return

            threading.Thread(target=watch, daemon=True).start()
            try:
                try:
                    proc.stdin.write(head)
                    if not (hasattr(chunks, "fileno") and _send_file(chunks.fileno(), proc.stdin, last)):
                        for chunk in chunks:
                            proc.stdin.write(chunk)
                            last[0] = time.monotonic()
                    proc.stdin.close()
                except BrokenPipeError:  # ssh or the command ended early: its exit code and stderr say why
                    pass
                rc = proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            finally:
                done.set()
                try:
                    proc.stdin.close()
                except OSError:
                    pass
            err.seek(0)
            tail = err.read()[-4000:].decode("utf-8", "replace")
            out.seek(0)
            answer = out.read()[-4000:].decode("utf-8", "replace")
    if rc < 0:
        return -1, f"no progress within {timeout:g} s", answer
    if rc == 255 and "Host key verification failed" in tail:
        raise HostKeyError(
            f"{ep.describe()}: host key changed: the OpenSSH client was offered a key other than the pinned "
            f"{fingerprint(host_key)}; refused (someone may be answering for it). If {ep.name} was reinstalled, "
            f"check the key on it and run `ugro trust {ep.name}`"
        )
    return rc, tail[-2000:], answer


def _send_file(fd: int, out, last: list[float]) -> bool:
    """A file's bytes from its start to its end into `out` (a pipe) through os.sendfile, the kernel copying
    file to pipe (Linux) with no byte passing through Python, noting the time of each piece in last[0]. False,
    nothing sent, where the kernel cannot (the caller then iterates the stream itself)."""
    size, offset, piece = os.fstat(fd).st_size, 0, 1 << 20
    out.flush()
    while offset < size:
        try:
            sent = os.sendfile(out.fileno(), fd, offset, min(piece, size - offset))
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSOCK, errno.EOPNOTSUPP) or offset:
                raise
            return False
        if sent == 0:
            raise OSError(errno.EIO, "the stream's file ended before its size")
        offset += sent
        last[0] = time.monotonic()
    return True


def fetch_host_key(ep: Endpoint, timeout: float = 10.0) -> str:
    """The host key a node offers now ('type base64'), read from the key exchange alone: nothing
    is authenticated or run. For `trust`."""
    import socket

    from paramiko import Transport
    from paramiko.ssh_exception import SSHException

    try:
        sock = socket.create_connection((ep.address, ep.port), timeout=timeout)
    except OSError as exc:
        raise LinkError(f"cannot reach {ep.describe()}: {exc}") from None
    transport = Transport(sock)
    transport.banner_timeout = timeout
    try:
        transport.start_client(timeout=timeout)
        return key_line(transport.get_remote_server_key())
    except (OSError, SSHException, EOFError) as exc:
        raise LinkError(f"cannot read the host key of {ep.describe()}: {exc or type(exc).__name__}") from None
    finally:
        transport.close()


class NodeLink:
    """One warm agent on one node. Requests are serialised per link; links run side by side.

    A request is sent again (once, on a fresh connection) only when it provably never reached the
    agent; anything that fails after it was written raises LinkError(delivered=True) and drops the
    link, so a slow `start` never runs twice. `extra_source` is agent source sent ahead of
    agent.py (tests use it to wrap ops through EXTRA_OPS).
    """

    def __init__(self, ep: Endpoint, connect_timeout: float = 5.0, extra_source: bytes = b"") -> None:
        self.ep = ep
        self.connect_timeout = connect_timeout
        self.extra_source = extra_source
        self._lock = threading.Lock()
        # Silence: set (monotonic) when a request went unanswered or a connection got no answer (not a refusal),
        # cleared by the next answer. While set, requests that find the link taken fail at once instead of
        # queueing behind it, and after a connection that got no answer the next attempt waits connect_timeout
        # (its error is repeated meanwhile).
        self.silent_since: float | None = None
        self._connect_failed: tuple[float, str] | None = None
        self._tried_at = 0.0  # monotonic: when a request last went to the node (or tried to connect)
        self._pipe: _Pipe | None = None
        self._buf = b""
        self._ids = itertools.count(1)
        self.hello: dict[str, Any] | None = None
        self.connect_seconds: float | None = None
        self.host_key = ep.host_key  # the key this link insists on; learned on first use when none is pinned
        self._openssh_failed: str | None = None  # why the OpenSSH client could not log in where this link did
        self.forward_refused = False  # the node's sshd forwards no connections (forward() said None once)

    def run_with_input(self, argv: list[str], chunks, timeout: float = 60.0) -> tuple[int, str]:
        """Run argv on the node with the chunks (bytes) as its stdin, beside the agent (requests go on
        meanwhile); (exit code, stderr tail). LinkError when the node cannot be reached; HostKeyError when
        the OpenSSH client met another host key than this link's.

        On an SSH node, through the OpenSSH client when it is installed, held to the key this link checked;
        else, or when that client cannot log in where paramiko did, on a second channel of this link's
        connection (chunks then iterated again from the start: an iterator, not an iterable, is not)."""
        pipe = self._connected("run_with_input", f"to run {argv[0]} on")
        if self._use_openssh():
            rc, err, _ = _run_over_openssh(self.ep, self.host_key, argv, chunks, timeout, self.connect_timeout)
            if rc != 255 or iter(chunks) is chunks:
                return rc, err
            self._openssh_failed_with(err)
        return pipe.run_with_input(argv, chunks, timeout)

    def forward(self, port: int, head: bytes, chunks, timeout: float = 60.0) -> tuple[int, str] | None:
        """Send head, then the chunks, to 127.0.0.1:port on the node, through this link's SSH connection or the OpenSSH
        client as run_with_input goes (a forwarded connection: no shell, nothing started on the node), then
        read what comes back until it closes: (0, that), or (exit code, why) when it failed; None where the
        node's sshd forwards no connections (AllowTcpForwarding, PermitOpen, DisableForwarding)."""
        pipe = self._connected("forward", f"to forward to port {port} on")
        if self._use_openssh():
            rc, err, answer = _run_over_openssh(self.ep, self.host_key, None, chunks, timeout, self.connect_timeout,
                                                port=port, head=head)  # fmt: skip
            if rc == 0:
                return 0, answer
            # "stdio forwarding failed": sshd refused to forward, or nothing listened there; ssh does not say
            # which, the link's own connection below does (and nothing was sent)
            if not (rc == 255 and "forwarding failed" in err):
                if rc != 255 or iter(chunks) is chunks:
                    return rc, (err.strip().splitlines() or [f"exit {rc}"])[-1]
                self._openssh_failed_with(err)
        got = pipe.forward(port, itertools.chain([head], chunks), timeout)
        return self._refused() if got is None else got

    def _connected(self, way: str, what: str) -> _Pipe:
        """This link's connection that has `way` (a _Pipe callable), made first if there is none (a `hello`, which
        learns the node's host key)."""
        if self._pipe is None or getattr(self._pipe, way) is None:
            self.request("hello", timeout=self.connect_timeout)
        pipe = self._pipe
        if pipe is None or getattr(pipe, way) is None:
            raise LinkError(f"{self.ep.describe()}: no connection {what}", delivered=False)
        return pipe

    def _refused(self) -> None:
        self.forward_refused = True
        log.warning("%s: its sshd forwards no connections; bulk copies start a process there instead",
                    self.ep.describe())  # fmt: skip

    def _use_openssh(self) -> bool:
        return self.ep.transport == "ssh" and bool(SSH_CLIENT) and bool(self.host_key) and self._openssh_failed is None

    def _openssh_failed_with(self, err: str) -> None:
        self._openssh_failed = (err.strip().splitlines() or ["exit 255"])[-1]
        log.warning("%s: the OpenSSH client failed (%s); bulk copies use the link's own connection",
                    self.ep.describe(), self._openssh_failed)  # fmt: skip

    # -- connection -------------------------------------------------------------------------
    def _connect(self) -> None:
        t0 = time.monotonic()
        opener = _open_local if self.ep.transport == "local" else _open_ssh
        try:
            pipe = opener(self.ep, self.connect_timeout, self.host_key)
        except LinkError:
            raise
        except OSError as exc:
            raise LinkError(f"cannot start the agent on {self.ep.describe()}: {exc}") from None
        if pipe.host_key and not self.host_key:
            self._pin(pipe)
        src = agent_source(self.extra_source)
        self._pipe, self._buf = pipe, b""
        try:
            pipe.send(b"%d\n" % len(src) + src)
            self.hello = self._roundtrip({"op": "hello"}, self.connect_timeout)
        except (LinkError, OSError) as exc:
            detail = pipe.stderr().strip()
            self._drop()
            if detail:
                raise LinkError(f"agent failed to start on {self.ep.describe()}: {detail.splitlines()[-1]}") from None
            raise (_NoAnswer if isinstance(exc, _NoAnswer) else LinkError)(str(exc)) from None
        self.connect_seconds = time.monotonic() - t0

    def _pin(self, pipe: _Pipe) -> None:
        """Trust on first use (or from known_hosts): record the key; refuse if another was pinned meanwhile."""
        pinned = pipe.host_key
        if host_key_recorder is not None:
            try:
                pinned = host_key_recorder(self.ep, pipe.host_key, pipe.host_key_source) or pipe.host_key
            except Exception as exc:  # the key is not kept: the next connection asks again
                log.warning("could not record the host key of %s: %s", self.ep.describe(), exc)
        if pinned != pipe.host_key:
            pipe.close()
            raise HostKeyError(_changed_key_message(self.ep, pipe.host_key, [pinned], "pinned"))
        self.host_key = pinned

    def _drop(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
        self._pipe, self._buf = None, b""

    def close(self) -> None:
        with self._lock:
            self._drop()

    @property
    def connected(self) -> bool:
        return self._pipe is not None

    @property
    def boot_id(self) -> str | None:
        """The node's boot id from the last hello (None before one, or where the node has none)."""
        return (self.hello or {}).get("boot_id")

    def _gone(self) -> bool:
        """True if the warm link is known dead before anything is sent on it (EOF or exited agent)."""
        assert self._pipe is not None
        try:
            for _ in range(64):  # bounded: pending bytes are kept, an EOF ends the loop
                if not self._pipe.pending():
                    break
                chunk = self._pipe.recv(1 << 20)
                if not chunk:
                    return True
                self._buf += chunk
            return not self._pipe.alive()
        except (OSError, ValueError):
            return True

    # -- requests ---------------------------------------------------------------------------
    def _readline(self, deadline: float) -> bytes:
        assert self._pipe is not None
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _NoAnswer("no answer in time")
            # Bounded, and pending() asked even when select() says nothing: paramiko's channel signals stdout and
            # stderr through one pipe, and a stderr read that clears it while an answer is being fed in (the
            # feed signals before it appends) leaves that answer in the buffer with the pipe silent.
            select.select([self._pipe.fileno()], [], [], min(left, READ_RECHECK_S))
            if not self._pipe.pending():
                continue
            try:
                chunk = self._pipe.recv(1 << 20)
            except OSError as exc:
                raise LinkError(f"the link broke: {exc}") from None
            if not chunk:
                raise LinkError("the link closed")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _send(self, payload: dict[str, Any]) -> int:
        """Write one request line; OSError means the agent never got all of it (it ignores a cut line)."""
        assert self._pipe is not None
        rid = next(self._ids)
        self._pipe.send(json.dumps({**payload, "id": rid}).encode() + b"\n")
        return rid

    def _answer(self, rid: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            line = self._readline(deadline)
            try:
                resp = json.loads(line)
            except ValueError:
                raise LinkError(f"a garbled answer: {line[:200]!r}") from None
            if isinstance(resp, dict) and resp.get("id") == rid:
                break
        if not resp.get("ok"):
            raise AgentRequestError(resp.get("error") or "agent error")
        return resp["result"]

    def _roundtrip(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            return self._answer(self._send(payload), timeout)
        except OSError as exc:
            raise LinkError(f"{self.ep.describe()}: the link broke: {exc}") from None
        except LinkError as exc:
            raise type(exc)(f"{self.ep.describe()}: {exc}") from None

    def request(self, op: str, timeout: float = 30.0, *, when_silent: bool = True, **fields: Any) -> dict[str, Any]:
        """Send one request and wait up to `timeout` s for its answer.

        Sent again only if it never reached the agent: the warm link was found dead before or while
        writing it (then once, on a fresh connection). A failure after it was written is not retried:
        LinkError(delivered=True), and the link is dropped (a late answer would be out of step).
        when_silent=False: while the link is silent, fail at once instead of trying, but for one try per
        connect timeout (a loop that must keep its pace for other nodes).
        """
        self._take(op, timeout)
        try:
            # skipped while silent, but tried again once a connect timeout has passed since the last try: no
            # other request may come to clear the silence (a command following its own job, no worker)
            if not when_silent and self.silent_since is not None and (
                time.monotonic() - self._tried_at < self.connect_timeout
            ):  # fmt: skip
                raise self._silence(op)
            self._tried_at = time.monotonic()
            return self._request(op, timeout, fields)
        finally:
            self._lock.release()

    def mark_silent(self) -> None:
        """A request of this link is late by its caller's measure: the link counts as silent until it answers
        (requests with when_silent=False are not tried meanwhile)."""
        self.silent_since = self.silent_since or time.monotonic()

    def heard_again(self) -> None:
        """The node answered a connection of another kind (the health monitor's TCP knock): the next request
        connects at once instead of failing on the last connection's missing answer until
        connect_timeout has passed."""
        self._connect_failed = None

    def _silence(self, op: str) -> LinkError:
        """The error for a request not sent because the link is silent: unreachable once a connection got no
        answer since (confirmed), else only LinkBusy (one late answer: an overloaded controller, perhaps)."""
        silent = self.silent_since or time.monotonic()
        line = f"{self.ep.describe()}: not answering for {time.monotonic() - silent:.0f} s; {op} not sent"
        failed = self._connect_failed
        if failed is not None and failed[0] >= silent:
            return LinkError(f"{line} ({failed[1]})", delivered=False)
        return LinkBusy(line)

    def _take(self, op: str, timeout: float) -> None:
        """Take the link for one request. A silent node's link is held by a request that waits out its
        timeout: a request that finds it so fails at once (not sent) rather than queueing behind it, so one
        silent node never stalls the threads that also serve other nodes."""
        deadline = time.monotonic() + timeout
        while not self._lock.acquire(timeout=LOCK_POLL_S):
            if self.silent_since is not None:
                raise self._silence(op)
            if time.monotonic() >= deadline:
                raise LinkBusy(f"{self.ep.describe()}: busy with another request for {timeout:g} s; {op} not sent")

    def _request(self, op: str, timeout: float, fields: dict[str, Any]) -> dict[str, Any]:
        failed = self._connect_failed
        if self._pipe is None and failed is not None and time.monotonic() - failed[0] < self.connect_timeout:
            raise LinkError(f"{failed[1]} (tried {time.monotonic() - failed[0]:.0f} s ago)", delivered=False)
        for attempt in (1, 2):
            if self._pipe is not None and self._gone():
                self._drop()
            fresh = self._pipe is None
            if fresh:
                try:
                    self._connect()  # LinkError(delivered=False): nothing was sent
                except _NoAnswer as exc:  # not refused: nothing came back (dropped packets, a frozen machine)
                    now = time.monotonic()
                    self._connect_failed = (now, str(exc))
                    self.silent_since = self.silent_since or now
                    raise
                self._connect_failed = None
            try:
                rid = self._send({"op": op, **fields})
            except OSError as exc:
                self._drop()
                if fresh or attempt == 2:
                    raise LinkError(
                        f"{self.ep.describe()}: the link broke before {op} was sent: {exc}", delivered=False
                    ) from None
                continue  # the warm link was dead: the agent never saw the request
            sent = time.monotonic()
            try:
                result = self._answer(rid, timeout)
            except LinkError as exc:
                if isinstance(exc, _NoAnswer):
                    self.silent_since = self.silent_since or sent
                self._drop()
                raise LinkError(
                    f"{self.ep.describe()}: {op} was sent, then {exc} (timeout {timeout:g}s); "
                    "not sent again, it may have run there",
                    delivered=True,
                ) from None
            self.silent_since = None
            if op == "hello":
                self.hello = result
            return result
        raise AssertionError("unreachable")


class LinkPool:
    """Warm links keyed by endpoint: a changed address or user gets a new link."""

    def __init__(self) -> None:
        self._links: dict[Endpoint, NodeLink] = {}
        self._lock = threading.Lock()

    def get(self, ep: Endpoint, connect_timeout: float = 5.0) -> NodeLink:
        with self._lock:
            link = self._links.get(ep)
            if link is None:
                stale = [k for k in self._links if k.name == ep.name]
                for k in stale:
                    old = self._links.pop(k)
                    if link is None and _same_but_pinned(k, ep) and _keeps(old, ep):
                        link, old.ep = old, ep
                    else:
                        old.close()
                link = self._links[ep] = link or NodeLink(ep, connect_timeout)
            link.connect_timeout = connect_timeout  # the caller's current setting, not the first caller's
            return link

    def close_all(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()


def _same_but_pinned(a: Endpoint, b: Endpoint) -> bool:
    return dataclasses.replace(a, host_key="") == dataclasses.replace(b, host_key="")


def _keeps(link: NodeLink, ep: Endpoint) -> bool:
    """Whether a link made for the same node, differing only in the pinned key, may serve `ep`:
    the key it learned on first use is now the pinned one; or nothing is pinned (the node's row is
    new) while the link is connected to a node it checked, whose key is then pinned, as a first
    contact would."""
    if not link.host_key:
        return False
    if link.host_key == ep.host_key:
        return True
    if ep.host_key or not link.connected:
        return False
    if host_key_recorder is None:
        return True
    try:
        return host_key_recorder(ep, link.host_key, "first use") == link.host_key
    except Exception as exc:  # not recorded: a fresh link will meet the node again
        log.warning("could not record the host key of %s: %s", ep.describe(), exc)
        return False


pool = LinkPool()
