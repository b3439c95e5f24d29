"""The node agent's idempotent start, exit records, rank liveness and tag table, through real agent
processes (the local transport: SSH adds nothing to what the agent does on its node)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import uuid
from pathlib import Path

import pytest

from cluster.links import AgentRequestError, Endpoint, NodeLink

from .conftest import job_pids, wait_for

SLEEPER = ["/usr/bin/python3", "-c", "import time; time.sleep(120)"]
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def new_link(name: str) -> NodeLink:
    return NodeLink(Endpoint(name=name, address="127.0.0.1", transport="local"), connect_timeout=10)


@pytest.fixture
def node():
    """A node name of this test's own (other runs share this machine) and every link opened to it."""
    name = f"agent-{uuid.uuid4().hex[:8]}"
    links: list[NodeLink] = []
    tags: list[str] = []

    class Node:
        def link(self) -> NodeLink:
            links.append(new_link(name))
            return links[-1]

        def tag(self) -> str:
            tags.append(f"t{uuid.uuid4().hex[:10]}")
            return tags[-1]

    Node.name = name
    yield Node()
    for link in links:
        link.close()
    for tag in tags:  # only the processes this test started carry its tags
        for pid in job_pids(tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start(link, tmp_path, tag, node, key=None, argv=SLEEPER, name="rank_0", **extra):
    fields = dict(
        argv=argv,
        env={"UGRO_JOB": tag, "UGRO_NODE": node},
        cwd=str(tmp_path),
        log=str(tmp_path / f"{name}.log"),
        exit_file=str(tmp_path / f"{name}.exit"),
        **extra,
    )
    if key is not None:
        fields["key"] = key
    return link.request("start", timeout=30, **fields)


def rank_status(link, tmp_path, node, tag, key, name="rank_0", **extra):
    item = {"key": key, "exit_file": str(tmp_path / f"{name}.exit"), "tag": tag, "node": node, **extra}
    return link.request("rank_status", timeout=10, ranks=[item])["ranks"][0]


def proc_start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def test_a_second_start_with_the_same_key_starts_nothing_and_returns_the_first_pid(node, tmp_path):
    tag = node.tag()
    first = start(node.link(), tmp_path, tag, node.name, key=f"{tag}:0:1")
    # when the same key comes again, from a new agent process (a reconnect)
    again = start(node.link(), tmp_path, tag, node.name, key=f"{tag}:0:1")
    # then nothing new runs and the first start's result comes back, marked as a duplicate
    assert wait_for(lambda: job_pids(tag), what="the rank") == [first["pid"]]
    assert first["duplicate"] is False and again["duplicate"] is True
    assert {k: again[k] for k in ("pid", "wrapper_pid", "pid_start", "wrapper_start")} == {
        k: first[k] for k in ("pid", "wrapper_pid", "pid_start", "wrapper_start")
    }
    record = json.loads((tmp_path / "rank_0.exit.start").read_text())
    assert record["key"] == f"{tag}:0:1" and record["pid"] == first["pid"]
    assert record["pid_start"] == proc_start_time(first["pid"])
    assert record["wrapper_start"] == proc_start_time(first["wrapper_pid"])
    assert record["boot_id"] == BOOT_ID.read_text().strip() and record["started"] > 0


def test_two_agents_racing_on_one_key_start_exactly_one_process(node, tmp_path):
    links = [node.link(), node.link()]
    for link in links:
        link.request("hello")  # both agents up before the race
    for n in range(4):
        tag, results = node.tag(), [None, None]
        barrier = threading.Barrier(2)

        def race(i, tag=tag, results=results, barrier=barrier, n=n):
            barrier.wait()
            results[i] = start(links[i], tmp_path, tag, node.name, key=f"{tag}:0:1", name=f"rank_{n}")

        threads = [threading.Thread(target=race, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results[0]["pid"] == results[1]["pid"]
        assert sorted(r["duplicate"] for r in results) == [False, True]
        assert wait_for(lambda tag=tag: job_pids(tag), what="the rank") == [results[0]["pid"]]


def test_another_key_over_an_existing_record_is_refused_in_one_line(node, tmp_path):
    tag = node.tag()
    link = node.link()
    start(link, tmp_path, tag, node.name, key=f"{tag}:0:1")
    with pytest.raises(AgentRequestError) as err:
        start(link, tmp_path, tag, node.name, key=f"{tag}:0:2")
    assert "belongs to start key" in str(err.value) and "\n" not in str(err.value)
    assert len(wait_for(lambda: job_pids(tag), what="the rank")) == 1


def test_a_start_that_failed_fails_again_and_never_starts_a_second_time(node, tmp_path):
    tag = node.tag()
    link = node.link()
    script = tmp_path / "train.sh"
    script.write_text("#!/nonexistent/interpreter\n")
    script.chmod(0o755)
    with pytest.raises(AgentRequestError, match="could not start") as first:
        start(link, tmp_path, tag, node.name, key=f"{tag}:0:1", argv=[str(script)])
    # when the script is fixed and the same key is sent again
    script.write_text("#!/bin/sh\nexec sleep 120\n")
    with pytest.raises(AgentRequestError) as again:
        start(link, tmp_path, tag, node.name, key=f"{tag}:0:1", argv=[str(script)])
    # then the first failure is reported and nothing runs
    assert str(again.value) == str(first.value)
    assert job_pids(tag) == []


def test_a_start_whose_agent_died_before_the_rank_began_is_not_started_again(node, tmp_path):
    tag = node.tag()
    gone = subprocess.Popen(["/usr/bin/true"])
    gone.wait()
    (tmp_path / "rank_0.exit.start").write_text(
        json.dumps({"key": f"{tag}:0:1", "state": "starting", "agent_pid": gone.pid, "agent_start": 1,
                    "boot_id": BOOT_ID.read_text().strip()})
    )  # fmt: skip
    with pytest.raises(AgentRequestError, match="did not finish"):
        start(node.link(), tmp_path, tag, node.name, key=f"{tag}:0:1")
    assert job_pids(tag) == []


def test_the_exit_record_names_the_signal_that_killed_the_rank(node, tmp_path):
    tag = node.tag()
    link = node.link()
    killed = start(link, tmp_path, tag, node.name, key=f"{tag}:0:1", name="killed")
    start(link, tmp_path, tag, node.name, key=f"{tag}:1:1", name="failed", argv=["/bin/sh", "-c", "exit 3"])
    os.kill(killed["pid"], signal.SIGTERM)
    read = lambda name: json.loads((tmp_path / f"{name}.exit").read_text())  # noqa: E731
    wait_for(lambda: (tmp_path / "killed.exit").exists() and (tmp_path / "failed.exit").exists(), what="exits")
    assert {k: read("killed")[k] for k in ("rc", "signal", "key")} == {"rc": -15, "signal": 15, "key": f"{tag}:0:1"}
    assert {k: read("failed")[k] for k in ("rc", "signal")} == {"rc": 3, "signal": None}


def test_rank_status_tells_a_running_rank_from_a_lost_one_and_a_finished_one(node, tmp_path):
    tag = node.tag()
    link = node.link()
    key = f"{tag}:0:1"
    first = start(link, tmp_path, tag, node.name, key=key)
    wait_for(lambda: job_pids(tag), what="the rank")
    running = rank_status(link, tmp_path, node.name, tag, key)
    assert running["record"] and running["key_matches"] and running["exit"] is None
    assert running["wrapper_alive"] and running["torchrun_alive"]
    assert running["tagged_pids"] == [first["pid"]]
    assert running["boot_id_at_start"] == running["boot_id"] == BOOT_ID.read_text().strip()
    assert not running["rebooted"]

    # when the wrapper dies without writing an exit record (the rank itself still runs)
    os.kill(first["wrapper_pid"], signal.SIGKILL)
    lost = wait_for(lambda: (s := rank_status(link, tmp_path, node.name, tag, key))["wrapper_alive"] is False and s)
    assert lost["exit"] is None and lost["torchrun_alive"] and lost["tagged_pids"] == [first["pid"]]

    # and a rank that ended normally has its exit record, with nothing left alive
    done = start(link, tmp_path, tag, node.name, key=f"{tag}:1:1", name="rank_1", argv=["/bin/sh", "-c", "exit 0"])
    ended = wait_for(lambda: rank_status(link, tmp_path, node.name, tag, f"{tag}:1:1", name="rank_1")["exit"])
    status = rank_status(link, tmp_path, node.name, tag, f"{tag}:1:1", name="rank_1")
    assert ended["rc"] == 0 and ended["signal"] is None
    assert not status["wrapper_alive"] and not status["torchrun_alive"] and status["pid"] == done["pid"]


def test_rank_status_trusts_a_pid_only_with_its_start_time_and_boot(node, tmp_path):
    tag = node.tag()
    link = node.link()
    key = f"{tag}:0:1"
    start(link, tmp_path, tag, node.name, key=key)
    record_path = tmp_path / "rank_0.exit.start"
    record = json.loads(record_path.read_text())
    me = os.getpid()  # a live process standing in for a wrapper whose pid was reused

    record_path.write_text(json.dumps({**record, "wrapper_pid": me}))
    assert rank_status(link, tmp_path, node.name, tag, key)["wrapper_alive"] is False
    record_path.write_text(json.dumps({**record, "wrapper_pid": me, "wrapper_start": proc_start_time(me)}))
    assert rank_status(link, tmp_path, node.name, tag, key)["wrapper_alive"] is True

    # when the node has rebooted since the start
    record_path.write_text(json.dumps({**record, "boot_id": "0" * 8}))
    rebooted = rank_status(link, tmp_path, node.name, tag, key)
    assert rebooted["rebooted"] and not rebooted["wrapper_alive"] and not rebooted["torchrun_alive"]
    assert rebooted["boot_id_at_start"] == "0" * 8

    # and a record of another key is not this rank's
    record_path.write_text(json.dumps({**record, "key": "other"}))
    other = rank_status(link, tmp_path, node.name, tag, key)
    assert other["record"] and not other["key_matches"] and other["record_key"] == "other"
    assert not other["wrapper_alive"]

    missing = rank_status(link, tmp_path, node.name, tag, key, name="never_started")
    assert not missing["record"] and not missing["wrapper_alive"] and missing["exit"] is None


def test_tagged_lists_every_job_with_live_processes_on_this_node_only(node, tmp_path):
    a, b, elsewhere = node.tag(), node.tag(), node.tag()
    link = node.link()
    pa = start(link, tmp_path, a, node.name, key=f"{a}:0:1", name="a")["pid"]
    pb = start(link, tmp_path, b, node.name, key=f"{b}:0:1", name="b")["pid"]
    start(link, tmp_path, elsewhere, f"{node.name}-other", key=f"{elsewhere}:0:1", name="c")
    wait_for(lambda: job_pids(a) and job_pids(b) and job_pids(elsewhere), what="three ranks")
    assert link.request("tagged", node=node.name)["tags"] == {a: [pa], b: [pb]}
    # the existing kill op ends a stray job by its tag
    link.request("kill", tag=a, node=node.name, signal=signal.SIGKILL)
    wait_for(lambda: a not in link.request("tagged", node=node.name)["tags"], what="job a gone")
    assert link.request("tagged", node=node.name)["tags"] == {b: [pb]}
