"""Real OpenSSH nodes on loopback addresses (127.0.0.2, 127.0.0.3, ...) for tests and benchmarks.

Each node is its own `sshd -D` process listening on its own address, so a test can stop one node
the way a machine drops off the LAN. Keys are generated fresh in a scratch directory.
"""

from __future__ import annotations

import getpass
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SSH_KEYGEN = shutil.which("ssh-keygen") or "/usr/bin/ssh-keygen"


def _port_free(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def _wait_listening(address: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=0.5) as s:
                if s.recv(4).startswith(b"SSH"):
                    return True
        except OSError:
            time.sleep(0.05)
    return False


@dataclass
class LoopbackNode:
    name: str
    address: str
    port: int
    workdir: Path
    config: Path
    proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        if self.running:
            return
        self.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(self.config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if not _wait_listening(self.address, self.port, timeout):
            self.stop()
            raise RuntimeError(f"sshd for {self.name} did not listen on {self.address}:{self.port}")

    def stop(self) -> None:
        """Stop listening and cut every open session, as if the machine fell off the network."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # sshd's per-connection children outlive the listener; end the ones serving this node.
        _kill_session_children(self.address, self.port)
        self.proc = None


def on_node(pids: Iterable[int], node: str) -> list[int]:
    """Those of `pids` that run on loopback node `node` (their environment says UGRO_NODE=<node>): the
    nodes share one machine, so a job's processes on every node are all here."""
    want = f"UGRO_NODE={node}".encode()
    out = []
    for pid in pids:
        try:
            if want in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                out.append(pid)
        except OSError:
            continue
    return out


def _kill_session_children(address: str, port: int) -> None:
    """End sshd connection processes bound to address:port (they survive the listener's exit)."""
    marker = f"{address}:{port}".encode()
    try:
        out = subprocess.run(
            ["ss", "-tnpH", "state", "established", "src", f"{address}:{port}"], capture_output=True, timeout=5
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    for line in out.splitlines():
        if marker not in line:
            continue
        for part in line.split(b"pid=")[1:]:
            pid = int(part.split(b",")[0])
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@dataclass
class LoopbackCluster:
    """N sshd nodes sharing one client key; `endpoint_kwargs` says how to reach each."""

    root: Path
    count: int
    first_octet: int = 2
    subnet: str = "127.0.0"
    nodes: list[LoopbackNode] = field(default_factory=list)
    port: int = 0

    @property
    def client_key(self) -> Path:
        return self.root / "client_ed25519"

    @property
    def user(self) -> str:
        return getpass.getuser()

    def _addresses(self) -> list[str]:
        return [f"{self.subnet}.{self.first_octet + i}" for i in range(self.count)]

    def _pick_port(self) -> int:
        for _ in range(200):
            port = random.randint(20000, 40000)
            if all(_port_free(a, port) for a in self._addresses()):
                return port
        raise RuntimeError("no free port for loopback sshd nodes")

    def start(self) -> LoopbackCluster:
        if not Path(SSHD).exists():
            raise RuntimeError("sshd is not installed (apt-get install openssh-server)")
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        host_key = self.host_key
        for key in (host_key, self.client_key):
            if not key.exists():
                subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        auth = self.root / "authorized_keys"
        shutil.copy(str(self.client_key) + ".pub", auth)
        auth.chmod(0o600)
        self.port = self.port or self._pick_port()
        for i, address in enumerate(self._addresses()):
            name = f"node{i + 1}"
            workdir = self.root / name
            workdir.mkdir(exist_ok=True)
            config = self.root / f"sshd_{name}.conf"
            config.write_text(
                f"ListenAddress {address}:{self.port}\n"
                f"HostKey {host_key}\n"
                f"AuthorizedKeysFile {auth}\n"
                f"PidFile {self.root / (name + '.pid')}\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "PubkeyAuthentication yes\nPermitRootLogin prohibit-password\n"
                "StrictModes no\nUsePAM no\nLogLevel ERROR\n"
                "MaxStartups 200:30:400\nMaxSessions 100\nUseDNS no\n"
            )
            self.nodes.append(LoopbackNode(name, address, self.port, workdir, config))
        for node in self.nodes:
            node.start()
        return self

    @property
    def host_key(self) -> Path:
        return self.root / "host_ed25519"

    def replace_host_key(self) -> None:
        """Give every node a new host key, as a reinstalled machine (or an impostor) would have:
        stop each sshd, generate a fresh key, start them again on the same addresses."""
        for node in self.nodes:
            node.stop()
        for path in (self.host_key, Path(f"{self.host_key}.pub")):
            path.unlink(missing_ok=True)
        subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-f", str(self.host_key)], check=True)
        for node in self.nodes:
            node.start()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
