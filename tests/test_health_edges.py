"""Health's rough edges: a first poll of a node that is down, and an sshd that accepts but never speaks."""

from __future__ import annotations

import json
import socket
import subprocess
import threading

import pytest

from cluster import links, monitor
from cluster.models import Alert, Node

from .conftest import REPO, free_port
from .controller import with_constants

pytestmark = [pytest.mark.e2e, pytest.mark.no_test_worker]  # each test drives the monitor itself
UGRO = [str(REPO / ".venv" / "bin" / "python"), str(REPO / "manage.py")]  # the admin commands (ugro-admin)


@pytest.fixture
def silent_sshd():
    """A TCP listener that accepts every connection and never sends a byte (a hung sshd)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():  # bounded by the fixture's teardown
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(timeout=5)
    for conn in held:
        conn.close()
    listener.close()


def _ssh_node(name: str, port: int) -> Node:
    return Node.objects.create(name=name, address="127.0.0.1", ssh_port=port, user="nobody", gpu_count=0)


def test_first_poll_of_a_node_never_reached_says_down_with_the_reason(transactional_db, fast_settings):
    """Covers: the first poll of a node where nothing listens: the OS's own refusal of the SSH connection turned into
    DOWN with its reason (a second; no fake link refuses like the OS).
    """
    # given a node nobody has reached yet, where nothing listens
    node = _ssh_node("ghost", free_port())
    # when the first poll runs
    (out,) = monitor.poll_once(force=True)
    # then it is DOWN (not UNKNOWN) with the reason, and a DOWN alert is open
    node.refresh_from_db()
    assert node.status == Node.Status.DOWN, (node.status, node.status_reason)
    assert node.status_reason.startswith("unreachable") and "refused" in node.status_reason.lower()
    assert out.went_down and Alert.objects.filter(node=node, key="down", resolved_at__isnull=True).exists()


def test_silent_sshd_gives_one_line_naming_the_node_and_the_timeout(transactional_db, controller_env, silent_sshd):
    """Covers: `health` as a process against a listener that never sends an SSH banner: the connect timeout's one line
    and exit 1, no paramiko traceback.
    """
    # given a node whose sshd accepts the connection but never sends its banner
    _ssh_node("mute", silent_sshd)
    env = with_constants(controller_env, {"cluster.links.CONNECT_TIMEOUT_S": 1.5})
    # when `ugro health` runs (first call after start)
    done = subprocess.run([*UGRO, "health"], env=env, capture_output=True, text=True, timeout=120)
    # then it exits 1 with the node DOWN and the plain reason, no paramiko traceback
    assert done.returncode == 1
    assert "node mute: SSH did not answer within 1.5 s" in done.stdout, done.stdout + done.stderr
    assert "✗ mute" in done.stdout and "DOWN" in done.stdout
    assert "Traceback" not in done.stderr and "No existing session" not in done.stdout + done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
    # and --json carries the same reason
    again = subprocess.run([*UGRO, "health", "--json"], env=env, capture_output=True, text=True, timeout=120)
    (entry,) = json.loads(again.stdout)["nodes"]
    assert entry["status"] == "down" and "SSH did not answer within 1.5 s" in entry["reason"]


def test_health_says_unreachable_for_a_known_node_that_stops_answering(lab):
    """Covers: `health` right after a real sshd stopped: UNREACHABLE with the failed-probe count while the breaker still
    says healthy.
    """
    import io

    from django.core.management import CommandError, call_command

    # given three nodes that answered a first poll
    monitor.poll_once(force=True)
    try:
        # when node3's sshd stops and `health` runs once (one poll: 2 failures, not DOWN yet)
        lab.nodes[2].stop()
        out = io.StringIO()
        with pytest.raises(CommandError, match="not healthy: node3"):
            call_command("health", stdout=out)
        # then node3 is not shown with its old good reading but as unreachable, with the count
        line = next(x for x in out.getvalue().splitlines() if "node3" in x)
        assert line.startswith("✗ node3") and "UNREACHABLE" in line and "2 of 3 failed probes" in line
        assert Node.objects.get(name="node3").status == Node.Status.HEALTHY  # the breaker's rule stands
    finally:
        lab.nodes[2].start()


def _freeze(node) -> list[int]:
    """SIGSTOP a loopback node's sshd and its sessions: the warm link goes silent, new ones get no banner."""
    import os
    import signal

    out = subprocess.run(["ss", "-tnpH", "state", "established", "src", f"{node.address}:{node.port}"],
                         capture_output=True, text=True, timeout=10).stdout  # fmt: skip
    pids = [node.proc.pid] + [int(p.split(",")[0]) for line in out.splitlines() for p in line.split("pid=")[1:]]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def _thaw(pids: list[int]) -> None:
    import os
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_preflight_fails_a_silent_node_within_the_connect_timeout(lab, fast_settings, silent_sshd, monkeypatch):
    """Covers: pre-flight over a warm link whose sshd is frozen (SIGSTOP), and to a node that never speaks: the hello
    bounded by the connect timeout, as only real sockets show.
    """
    import io

    from django.core.management import CommandError, call_command

    monkeypatch.setattr(links, "CONNECT_TIMEOUT_S", 1.5)
    # given node1 answered over a warm link, then froze; and a node whose sshd never speaks
    monitor.poll_once(force=True)
    _ssh_node("mute", silent_sshd)
    frozen = _freeze(lab.nodes[0])
    try:
        # when pre-flight runs on them
        out = io.StringIO()
        with pytest.raises(CommandError, match="pre-flight failed"):
            call_command("preflight", "--nodes", "node1", "mute", stdout=out)
    finally:
        _thaw(frozen)
    lines = out.getvalue().splitlines()
    # then the silent one is one plain line, and the frozen one failed on the hello bounded by the
    # connect timeout (not on a longer request's own timeout)
    assert any(x.startswith("mute: SSH did not answer within 1.5 s") for x in lines), lines
    frozen_line = next(x for x in lines if x.startswith("node1: "))
    assert "hello was sent, then no answer in time (timeout 1.5s)" in frozen_line, frozen_line


@pytest.fixture
def sshd_that_stalls_on_exec(tmp_path):
    """A real SSH server (paramiko's) that lets anyone in but never answers a request to run a command."""
    import paramiko

    release = threading.Event()
    host_key = paramiko.RSAKey.generate(2048)
    client_key = paramiko.RSAKey.generate(2048)
    key_file = tmp_path / "client_key"
    client_key.write_private_key_file(str(key_file))

    class Server(paramiko.ServerInterface):
        def get_allowed_auths(self, username):
            return "publickey"

        def check_auth_publickey(self, username, key):
            return paramiko.AUTH_SUCCESSFUL

        def check_channel_request(self, kind, chanid):
            return paramiko.OPEN_SUCCEEDED

        def check_channel_exec_request(self, channel, command):
            release.wait(60)  # bounded: the fixture releases it at teardown
            return False

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.2)
    transports = []

    def serve() -> None:
        while not release.is_set():  # bounded by the teardown
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            t = paramiko.Transport(conn)
            t.add_server_key(host_key)
            t.start_server(server=Server())
            transports.append(t)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1], str(key_file)
    release.set()
    thread.join(timeout=5)
    for t in transports:
        t.close()
    listener.close()


def test_a_session_that_never_starts_fails_within_the_timeout_and_frees_the_link(sshd_that_stalls_on_exec):
    """Covers: a real SSH server (paramiko's) that never answers the exec request: the link's timeout, and its lock
    freed for the next request.
    """
    from cluster.links import Endpoint, LinkError, NodeLink

    port, key = sshd_that_stalls_on_exec
    link = NodeLink(Endpoint("stuck", "127.0.0.1", port, user="nobody", key_path=key), connect_timeout=1.0)
    # when the agent is started over a session whose exec request is never answered
    with pytest.raises(LinkError, match=r"node stuck: SSH did not answer within 3 s \(starting the agent\)"):
        link.request("hello", timeout=1.5)
    # then the link is free for the next request (it would block forever on the link's lock otherwise)
    with pytest.raises(LinkError, match="did not answer within 3 s"):
        link.request("hello", timeout=1.5)


def test_preflight_json_names_the_unreachable_node(transactional_db, fast_settings):
    """Covers: `preflight --json` with a node where nothing listens: the report as JSON and exit 1 (a refused
    connection, a second).
    """
    import io

    from django.core.management import CommandError, call_command

    # given a node where nothing listens
    _ssh_node("ghost", free_port())
    out = io.StringIO()
    # when pre-flight runs with --json: still exit 1 with one line, and the report as JSON
    with pytest.raises(CommandError, match="pre-flight failed on 1 node"):
        call_command("preflight", "--json", stdout=out)
    report = json.loads(out.getvalue())
    assert report["ok"] is False and report["nodes"] == ["ghost"]
    (problem,) = report["problems"]
    assert problem.startswith("ghost: cannot reach ghost") and "refused" in problem.lower()


def test_an_idle_node_that_goes_silent_is_down_on_the_next_tick_not_after_its_interval(lab, fast_settings, monkeypatch):
    """Covers: the monitor's next tick after a warm link's sshd froze: hello fails, fresh connections see no banner,
    DOWN in one tick; the breaker's rule alone is tests/test_health.py's.
    """
    monkeypatch.setattr(links, "CONNECT_TIMEOUT_S", 1.5)
    # given three idle nodes just polled over warm links (none due again for 40 s)
    monitor.poll_once(force=True)
    assert monitor.poll_once() == []
    frozen = _freeze(lab.nodes[0])
    try:
        # when node1 goes silent and beat ticks: its warm link's hello fails (failure 1), so it is
        # probed at once, and the two fresh connections that see no SSH banner make 2 and 3
        outcomes = {o.node: o for o in monitor.poll_once()}
    finally:
        _thaw(frozen)
    # then only node1 was probed, and it is DOWN, saying why
    assert list(outcomes) == ["node1"] and outcomes["node1"].went_down
    node1 = Node.objects.get(name="node1")
    assert node1.status == Node.Status.DOWN and node1.breaker["failures"] == 3
    assert "SSH did not answer within 1.5 s" in node1.status_reason
    assert {n.name: n.status for n in Node.objects.exclude(name="node1")} == {"node2": "healthy", "node3": "healthy"}


NOISY_AGENT = b"import sys\nsys.stderr.write('a warning on stderr\\n')\nsys.stderr.flush()\n"


def test_a_warm_link_whose_agent_wrote_to_stderr_keeps_answering(loopback):
    """Covers: a real agent writing to stderr on a paramiko channel (which then selects readable) while the next request
    waits: only a real channel behaves so.
    """
    import time

    from cluster.links import NodeLink

    from .test_links_retry import endpoint

    # given a warm link whose agent printed a line on stderr (paramiko's channel then selects as readable)
    link = NodeLink(endpoint(loopback), connect_timeout=10, extra_source=NOISY_AGENT)
    link.request("hello", timeout=10)
    time.sleep(0.5)
    # when the next request is sent (the link first checks whether its far end is gone)
    answered: list[dict] = []
    worker = threading.Thread(target=lambda: answered.append(link.request("hello", timeout=10)), daemon=True)
    worker.start()
    worker.join(30)
    # then it is answered (it used to wait forever for stdout in the check, holding the link's lock)
    assert answered, "the request hung"
    assert "a warning on stderr" in link._pipe.stderr()
    link.close()
