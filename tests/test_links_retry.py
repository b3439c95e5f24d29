"""NodeLink sends a request again only when it provably never reached the agent: tested on real
loopback sshd nodes with agents that answer late or die after acting (test source sent ahead of
agent.py through NodeLink's extra_source)."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from cluster.links import BOOTSTRAP, Endpoint, LinkError, NodeLink, agent_source

from .conftest import job_pids, wait_for

SLEEPER = ["/usr/bin/python3", "-c", "import time; time.sleep(120)"]
# The agent starts the rank, then answers only after the controller has given up waiting.
REPLY_LATE = b"""
import time as _test_time
def _test_start_replying_late(req):
    with open(os.path.join(req["cwd"], "calls-" + req["env"]["UGRO_JOB"]), "a") as fh:  # each start that arrived
        fh.write("start\\n")
    result = op_start(req)
    _test_time.sleep(4.0)
    return result
EXTRA_OPS = dict(globals().get("EXTRA_OPS", {}), start=_test_start_replying_late)
"""
# The agent starts the rank, then dies before answering: the link breaks after the request was written.
DIE_AFTER_START = b"""
def _test_start_then_die(req):
    op_start(req)
    os._exit(1)
EXTRA_OPS = dict(globals().get("EXTRA_OPS", {}), start=_test_start_then_die)
"""


def endpoint(loopback, index: int = 0, **over) -> Endpoint:
    node = loopback.nodes[index]
    fields = dict(name=node.name, address=node.address, port=node.port, user=loopback.user,
                  key_path=str(loopback.client_key))  # fmt: skip
    return Endpoint(**{**fields, **over})


@pytest.fixture
def tags():
    """Job tags of this test; their processes are killed at the end (only this test started them)."""
    made: list[str] = []

    def new() -> str:
        made.append(f"t{uuid.uuid4().hex[:10]}")
        return made[-1]

    yield new
    for tag in made:
        for pid in job_pids(tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def links():
    opened: list[NodeLink] = []

    def new(ep: Endpoint, **kwargs) -> NodeLink:
        opened.append(NodeLink(ep, connect_timeout=10, **kwargs))
        return opened[-1]

    yield new
    for link in opened:
        link.close()


def start_fields(node, tag: str) -> dict:
    base = node.workdir / f"job-{tag}"
    return dict(
        argv=SLEEPER, env={"UGRO_JOB": tag, "UGRO_NODE": node.name}, cwd=str(node.workdir),
        log=str(base / "rank_0.log"), exit_file=str(base / "rank_0.exit"), record=str(base / "rank_0.start"),
        key=f"{tag}:0:1",
    )  # fmt: skip


def test_a_start_answered_after_the_timeout_is_not_sent_again(loopback, links, tags):
    tag, node = tags(), loopback.nodes[0]
    link = links(endpoint(loopback), extra_source=REPLY_LATE)
    link.request("hello")  # a warm link: the old code resent on it
    # when the agent starts the rank but answers after the controller stopped waiting
    with pytest.raises(LinkError) as err:
        link.request("start", timeout=1.0, **start_fields(node, tag))
    # then the controller hears so, the request was not resent, and one process runs
    assert err.value.delivered is True
    assert "start was sent" in str(err.value) and "not sent again" in str(err.value)
    assert not link.connected
    first = wait_for(lambda: job_pids(tag), what="the rank")
    assert (node.workdir / f"calls-{tag}").read_text() == "start\n"
    # and the same key again (the caller's retry) returns that same process
    again = link.request("start", timeout=30, **start_fields(node, tag))
    assert again["duplicate"] is True and [again["pid"]] == first == job_pids(tag)


def test_a_link_that_breaks_after_the_start_was_written_is_not_sent_again(loopback, links, tags):
    tag, node = tags(), loopback.nodes[1]
    link = links(endpoint(loopback, 1), extra_source=DIE_AFTER_START)
    link.request("hello")
    unkeyed = {k: v for k, v in start_fields(node, tag).items() if k not in ("key", "record")}
    # when the agent starts the rank and dies before answering (no start key: the link alone decides)
    with pytest.raises(LinkError) as err:
        link.request("start", timeout=30, **unkeyed)
    # then the error says it may have run, and it ran once
    assert err.value.delivered is True and "may have run there" in str(err.value)
    assert len(wait_for(lambda: job_pids(tag), what="the rank")) == 1
    assert not link.connected


def test_a_dead_warm_link_is_resent_on_a_fresh_one_and_an_unreachable_node_is_undelivered(loopback, links, tags):
    tag, node = tags(), loopback.nodes[2]
    link = links(endpoint(loopback, 2))
    old_agent = link.request("hello")["pid"]
    os.kill(old_agent, signal.SIGKILL)  # the agent is gone; the warm link does not know yet
    # the agent's exit has reached this end of the link (its channel closed), nothing was sent yet
    wait_for(lambda: not link._pipe.alive(), what="the channel to close")
    # when a start goes out on the dead warm link, it is sent once more, on a fresh connection
    result = link.request("start", timeout=30, **start_fields(node, tag))
    assert result["duplicate"] is False and job_pids(tag) == [result["pid"]]
    assert link.hello["pid"] != old_agent
    # and a node that cannot be reached says the request never left
    closed = links(endpoint(loopback, 2, port=_closed_port()))
    with pytest.raises(LinkError) as err:
        closed.request("hello", timeout=5)
    assert err.value.delivered is False


def test_hello_carries_the_boot_id_and_the_link_keeps_the_last_hello(loopback, links):
    link = links(endpoint(loopback, 3))
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    hello = link.request("hello")
    assert hello["boot_id"] == boot_id and link.boot_id == boot_id
    assert link.hello == hello


def test_a_request_cut_off_before_its_newline_is_never_run(tmp_path, tags):
    """A link that breaks while the request is written leaves a line without its newline: not run."""
    tag = tags()
    src = agent_source()
    line = (
        b'{"id": 1, "op": "start", "argv": ["/usr/bin/python3", "-c", "import time; time.sleep(120)"], '
        b'"env": {"UGRO_JOB": "%s", "UGRO_NODE": "cut"}, "cwd": "%s", "log": "%s/r.log", "exit_file": "%s/r.exit"}'
        % (tag.encode(), str(tmp_path).encode(), str(tmp_path).encode(), str(tmp_path).encode())
    )
    agent = subprocess.run(
        ["/usr/bin/python3", "-u", "-c", BOOTSTRAP], input=b"%d\n" % len(src) + src + line,
        capture_output=True, timeout=30,
    )  # fmt: skip
    assert agent.returncode == 0 and agent.stdout == b""
    assert not (tmp_path / "r.log").exists() and job_pids(tag) == []


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        return s.getsockname()[1]


def test_a_warm_link_from_the_pool_takes_the_connect_timeout_its_caller_passes_now():
    from cluster.links import LinkPool

    pool = LinkPool()
    ep = Endpoint(name="n", address="127.0.0.1", port=1, user="nobody", key_path="")
    # a link made under one CONNECT_TIMEOUT_S, then asked for under another (a setting changed)
    first = pool.get(ep, 5.0)
    again = pool.get(ep, 1.5)
    # then it is the same link, and its next connection waits the new timeout, not the first caller's
    assert again is first and again.connect_timeout == 1.5
    pool.close_all()


def test_a_process_sends_its_nodes_the_node_code_it_started_with(tmp_path, monkeypatch):
    from cluster import links

    # given node code as it was when this process first read it
    for name in links.AGENT_FILES:
        (tmp_path / name).write_bytes((links.NODE_CODE_DIR / name).read_bytes())
    monkeypatch.setattr(links, "NODE_CODE_DIR", tmp_path)
    links.node_file.cache_clear()
    try:
        before = agent_source()
        # when UGRO is updated on disk (a git pull) while the process runs on
        (tmp_path / "codesync.py").write_bytes(b"# a newer receiver and store layout\n")
        # then the agent and the code-sync receiver it sends are still its own version, not a mix
        assert agent_source() == before and links.node_file("codesync.py") != b"# a newer receiver and store layout\n"
    finally:
        links.node_file.cache_clear()
