"""Pre-flight on real sshd nodes: each failure is one line naming its node, and nothing starts.

GPUs come from the probe's fixture reader (no GPU here). A second torch version cannot exist in
the test node env, so the version-mismatch case gives one node an env whose python reports another.
"""

from __future__ import annotations

import io
import json
import socket
import stat

import pytest
from django.core.management import CommandError, call_command

from cluster.models import ClusterSettings, Node
from jobs.models import Job, Rank
from jobs.preflight import check_nodes

from .conftest import FAST_TRAIN, job_pids

pytestmark = pytest.mark.e2e


@pytest.fixture
def rdzv_port(lab) -> int:
    """A rendezvous port of this test's own (other runs on this machine use 29500)."""
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    ClusterSettings.objects.filter(pk=1).update(rendezvous_port=port)
    return port


def launch_fails(name: str, *args: str) -> Job:
    with pytest.raises(CommandError, match="pre-flight failed"):
        call_command("launch", "--name", name, *args, "--", *FAST_TRAIN, stdout=io.StringIO())
    job = Job.objects.get(name=name)
    # nothing started anywhere: every rank still pending, no process carries the job's tag
    assert job.state == Job.State.FAILED and "Nothing was started" in job.failure_reason
    assert not Rank.objects.filter(job=job).exclude(state=Rank.State.PENDING).exists()
    assert not Rank.objects.filter(job=job, active=True).exists()
    assert job_pids(job.tag) == []
    return job


def fake_env(tmp_path, torch: str, cuda: str | None) -> str:
    """A training env whose python reports the given torch/CUDA versions; returns its torchrun path."""
    bin_dir = tmp_path / "otherenv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(f"#!/bin/sh\necho '{json.dumps({'torch': torch, 'cuda': cuda})}'\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    torchrun = bin_dir / "torchrun"
    torchrun.write_text("#!/bin/sh\nexit 1\n")
    torchrun.chmod(torchrun.stat().st_mode | stat.S_IXUSR)  # pre-flight looks for it as a rank's start would
    return str(torchrun)


def test_preflight_command_passes_on_a_sound_cluster(lab, rdzv_port):
    """Covers: `preflight` passing on three real nodes, every check answered by a real agent over SSH."""
    out = io.StringIO()
    call_command("preflight", stdout=out)
    assert f"pre-flight passed: node1, node2, node3 (rendezvous 127.0.0.2:{rdzv_port})" in out.getvalue()


def test_missing_script_fails_the_launch_naming_each_node(lab, rdzv_port):
    """Covers: a launch refused because the script is missing on two real nodes, named per node, nothing started."""
    job = launch_fails("noscript", "--nodes", "2", "--script", "train/missing.py")
    for name in ("node1", "node2"):
        assert f"{name}: script {lab.nodes[int(name[-1]) - 1].workdir}/train/missing.py not found" in job.failure_reason


def test_missing_gpus_fail_the_launch(lab, rdzv_port):
    """Covers: a launch refused because a node's GPU reader, run by its agent, sees fewer GPUs than declared."""
    # given node2 declares 2 GPUs but its reader sees one
    path = lab.nodes[1].workdir / "gpus.json"
    path.write_text(json.dumps([{"index": 0, "name": "RTX 4070", "mem_used_mb": 10, "mem_total_mb": 8188}]))
    Node.objects.filter(name="node2").update(gpu_count=2, gpu_reader=f"fixture:{path}")
    job = launch_fails("nogpu", "--nodes", "3")
    assert "node2: 1 of 2 declared GPUs visible (reader: fixture)" in job.failure_reason


def test_gpu_without_free_memory_fails_the_preflight(lab, rdzv_port):
    """Covers: `preflight` reading a GPU's free memory through a real agent and refusing under 1024 MB."""
    path = lab.nodes[0].workdir / "gpus.json"
    path.write_text(json.dumps([{"index": 0, "name": "RTX 5070 Ti", "mem_used_mb": 12000, "mem_total_mb": 12227}]))
    Node.objects.filter(name="node1").update(gpu_count=1, gpu_reader=f"fixture:{path}")
    out = io.StringIO()
    with pytest.raises(CommandError):
        call_command("preflight", "--nodes", "node1", stdout=out)
    assert "node1: GPU 0 has 227 MB free (needs 1024 MB)" in out.getvalue()


def test_busy_rendezvous_port_on_rank0_fails_the_launch(lab, rdzv_port):
    """Covers: a real socket on rank 0's rendezvous port found by the agent's port check; the launch refused with where
    to change the port.
    """
    # given something already listening on the rendezvous port of rank 0's node
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.2", rdzv_port))
        squatter.listen()
        job = launch_fails("portbusy", "--nodes", "3")
    assert f"node1: rendezvous port {rdzv_port} is in use on 127.0.0.2" in job.failure_reason
    # and it says where to choose another port
    assert "cluster.master_port in cluster.yaml" in job.failure_reason
    assert "Rendezvous port in admin > Cluster settings" in job.failure_reason


def test_version_mismatch_fails_or_warns_per_setting(lab, rdzv_port, tmp_path, monkeypatch):
    """Covers: torch and CUDA versions read by running each node's env python over SSH: a mismatch fails, or warns when
    set so.
    """
    # given node3's env has another torch and CUDA
    Node.objects.filter(name="node3").update(torchrun_command=fake_env(tmp_path, "2.1.0", "12.1"))
    # when launched: it fails naming every node's versions
    job = launch_fails("mismatch", "--nodes", "3")
    assert "torch/CUDA/NCCL versions differ between nodes:" in job.failure_reason
    assert "node3 torch 2.1.0 CUDA 12.1" in job.failure_reason and "node1 torch 2.13" in job.failure_reason
    # when the setting says warn: the pre-flight passes with a note
    monkeypatch.setattr("jobs.preflight.VERSION_MISMATCH", "warn")
    out = io.StringIO()
    call_command("preflight", stdout=out)
    assert "note: torch/CUDA/NCCL versions differ" in out.getvalue() and "pre-flight passed" in out.getvalue()


def test_unreachable_rendezvous_from_a_worker_fails(lab, rdzv_port):
    """Covers: a worker node's agent trying a real TCP connection to the rendezvous and being refused."""
    # given node2 thinks the rendezvous lives at an address where nothing will listen
    nodes = list(Node.objects.filter(name__in=["node1", "node2"]))
    report = check_nodes(nodes, "train/train_production.py", "127.0.0.9", rdzv_port)
    assert f"node2: cannot reach the rendezvous at 127.0.0.9:{rdzv_port} (Connection refused)" in report.problems


def test_loopback_rendezvous_with_a_node_on_another_host_fails(lab, rdzv_port):
    """Covers: a loopback rendezvous refused for a node on another host, real agents answering the other checks."""
    # given a local node (no SSH needed) whose address is a LAN address, and rank 0 on loopback
    Node.objects.create(name="lan1", address="192.0.2.10", transport="local", workdir=str(lab.nodes[0].workdir),
                        gpu_count=0, agent_python="/usr/bin/python3")  # fmt: skip
    nodes = [Node.objects.get(name="node1"), Node.objects.get(name="lan1")]
    report = check_nodes(nodes, "train/train_production.py", "127.0.0.2", rdzv_port)
    assert any(
        p.startswith("lan1: rendezvous address 127.0.0.2 is loopback but lan1 (192.0.2.10) is another host")
        for p in report.problems
    ), report.problems


def test_preflight_command_names_an_unreachable_node(lab, rdzv_port):
    """Covers: `preflight` with one node's sshd stopped: one line names that node, nothing is blamed on the other."""
    # given node2's sshd is down (and no link to it left warm by an earlier test: one that dies while a request is
    # on it is reported as such, "hello was sent, then the link closed", which is another case than this one)
    from cluster.links import pool

    pool.close_all()
    lab.nodes[1].stop()
    try:
        out = io.StringIO()
        # when the pre-flight runs on node1 and node2
        with pytest.raises(CommandError, match="pre-flight failed"):
            call_command("preflight", "--nodes", "node1", "node2", stdout=out)
    finally:
        lab.nodes[1].start()
        pool.close_all()  # the next test starts from fresh links
    # then one line names node2 as unreachable and nothing else is blamed on node1
    lines = out.getvalue().splitlines()
    assert any(line.startswith("node2: cannot reach node2") for line in lines), lines
    assert not any(line.startswith("node1:") for line in lines), lines


@pytest.mark.no_test_worker
def test_preflight_names_a_node_whose_python_is_not_there_over_ssh(lab, rdzv_port):
    """The missing python as a real sshd and login shell report it (the local transport's case is in
    tests/test_preflight_setup.py).

    Covers: a missing agent python as a real sshd and login shell report it, turned into one line with the fix.
    """
    # given node2's python (its agent's) does not exist
    Node.objects.filter(name="node2").update(agent_python="/opt/nowhere/bin/python3")
    out = io.StringIO()
    # when the pre-flight runs on node1 and node2
    with pytest.raises(CommandError, match="pre-flight failed"):
        call_command("preflight", "--nodes", "node1", "node2", stdout=out)
    # then one line names node2, its python and the fix
    assert out.getvalue().splitlines() == [
        "node2: its python /opt/nowhere/bin/python3 (UGRO's agent runs with it) is not there; set its Agent python in "
        "admin > Nodes or nodes.node2.python in cluster.yaml (then `ugro import_cluster`) to any python >= 3.8 on it"
    ]
