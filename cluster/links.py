"""Warm links to nodes: one connection per node, one small agent at its end, JSON lines between.

A link starts the node agent (cluster/node/agent.py, sent as source) once, over SSH through Fabric
or as a local subprocess, and then every probe, rank start, tail and kill is one request on it.
No user value is ever interpolated into a shell string: the only shell command sent is the
agent's bootstrap, built from the node's python path through shlex.quote.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import select
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NODE_CODE_DIR = Path(__file__).resolve().parent / "node"
# Files that make up the agent, in order; the last one serves requests.
AGENT_FILES = ("probe.py", "agent.py")
BOOTSTRAP = (
    "import sys;b=sys.stdin.buffer;n=int(b.readline());g={'__name__':'__ugro_agent__'};"
    "exec(compile(b.read(n),'ugro-agent','exec'),g)"
)


class LinkError(Exception):
    """The node could not be reached, or the link broke: the message says which and why."""


class AgentRequestError(Exception):
    """The agent was reached but refused or failed the request; the message is the agent's."""


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

    def describe(self) -> str:
        if self.transport == "local":
            return f"{self.name} (local)"
        who = f"{self.user}@" if self.user else ""
        return f"{self.name} ({who}{self.address}:{self.port})"


def agent_source() -> bytes:
    parts = []
    for name in AGENT_FILES:
        path = NODE_CODE_DIR / name
        if path.exists():
            parts.append(path.read_bytes())
    return b"\n\n".join(parts)


class _Pipe:
    """A byte stream in each direction with a select-able read side."""

    def __init__(self, send, recv, fileno, close, stderr) -> None:
        self.send, self.recv, self.fileno, self._close, self.stderr = send, recv, fileno, close, stderr

    def close(self) -> None:
        try:
            self._close()
        except Exception:  # closing a broken link must never raise
            pass


def _open_local(ep: Endpoint, timeout: float) -> _Pipe:
    proc = subprocess.Popen(
        [ep.python, "-u", "-c", BOOTSTRAP],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )

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

    fd = proc.stdout.fileno()
    return _Pipe(send, lambda n: os.read(fd, n), lambda: fd, close, stderr)


def _open_ssh(ep: Endpoint, timeout: float) -> _Pipe:
    from fabric import Connection
    from paramiko.ssh_exception import SSHException

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
    try:
        conn.open()
        transport = conn.client.get_transport()
        transport.set_keepalive(15)
        chan = transport.open_session(timeout=timeout)
        chan.exec_command(f"exec {shlex.quote(ep.python)} -u -c {shlex.quote(BOOTSTRAP)}")
    except (OSError, SSHException, EOFError) as exc:
        conn.close()
        raise LinkError(f"cannot reach {ep.describe()}: {exc or type(exc).__name__}") from None

    def send(data: bytes) -> None:
        chan.sendall(data)

    def stderr() -> str:
        out = b""
        while chan.recv_stderr_ready():
            out += chan.recv_stderr(65536)
        return out.decode("utf-8", "replace")[-2000:]

    def close() -> None:
        chan.close()
        conn.close()

    return _Pipe(send, chan.recv, chan.fileno, close, stderr)


class NodeLink:
    """One warm agent on one node. Requests are serialised per link; links run side by side."""

    def __init__(self, ep: Endpoint, connect_timeout: float = 5.0) -> None:
        self.ep = ep
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._pipe: _Pipe | None = None
        self._buf = b""
        self._ids = itertools.count(1)
        self.hello: dict[str, Any] | None = None
        self.connect_seconds: float | None = None

    # -- connection -------------------------------------------------------------------------
    def _connect(self) -> None:
        t0 = time.monotonic()
        opener = _open_local if self.ep.transport == "local" else _open_ssh
        try:
            pipe = opener(self.ep, self.connect_timeout)
        except LinkError:
            raise
        except OSError as exc:
            raise LinkError(f"cannot start the agent on {self.ep.describe()}: {exc}") from None
        src = agent_source()
        self._pipe, self._buf = pipe, b""
        try:
            pipe.send(b"%d\n" % len(src) + src)
            self.hello = self._roundtrip({"op": "hello"}, self.connect_timeout)
        except LinkError as exc:
            detail = pipe.stderr().strip()
            self._drop()
            if detail:
                raise LinkError(f"agent failed to start on {self.ep.describe()}: {detail.splitlines()[-1]}") from None
            raise LinkError(str(exc)) from None
        self.connect_seconds = time.monotonic() - t0

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

    # -- requests ---------------------------------------------------------------------------
    def _readline(self, deadline: float) -> bytes:
        assert self._pipe is not None
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LinkError(f"{self.ep.describe()} did not answer in time")
            ready, _, _ = select.select([self._pipe.fileno()], [], [], left)
            if not ready:
                continue
            try:
                chunk = self._pipe.recv(1 << 20)
            except OSError as exc:
                raise LinkError(f"link to {self.ep.describe()} broke: {exc}") from None
            if not chunk:
                raise LinkError(f"link to {self.ep.describe()} closed")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _roundtrip(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self._pipe is not None
        rid = next(self._ids)
        payload = {**payload, "id": rid}
        try:
            self._pipe.send(json.dumps(payload).encode() + b"\n")
        except OSError as exc:
            raise LinkError(f"link to {self.ep.describe()} broke: {exc}") from None
        deadline = time.monotonic() + timeout
        while True:
            resp = json.loads(self._readline(deadline))
            if resp.get("id") == rid:
                break
        if not resp.get("ok"):
            raise AgentRequestError(resp.get("error") or "agent error")
        return resp["result"]

    def request(self, op: str, timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        """Send one request; reconnect once if the warm link had gone stale."""
        with self._lock:
            for attempt in (1, 2):
                fresh = self._pipe is None
                if fresh:
                    self._connect()
                try:
                    return self._roundtrip({"op": op, **fields}, timeout)
                except LinkError:
                    self._drop()
                    if fresh or attempt == 2:
                        raise
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
                    self._links.pop(k).close()
                link = self._links[ep] = NodeLink(ep, connect_timeout)
            return link

    def close_all(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()


pool = LinkPool()
