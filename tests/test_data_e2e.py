"""A dataset on three real sshd nodes (two of them sharing one working directory) by the one transfer path: sent
from the controller once, a node cut off mid-way resumed node to node from the chunks it held, and a job launched
with --data that finds it in its directory, sending nothing."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import threading
from pathlib import Path

import pytest
from django.core.management import call_command

from cluster.models import ClusterSettings, Node
from jobs import data, transfer
from jobs.models import Job, JobCode

from .conftest import cluster_yaml, end_leftovers, wait_for

pytestmark = pytest.mark.e2e

FILES, SIZE = 4, 48 << 20  # 192 MB of real bytes
CHECK = """import hashlib, os, sys
root = sys.argv[-1]  # after the cluster's own arguments
for name in sorted(os.listdir(root)):
    with open(os.path.join(root, name), "rb") as fh:
        print("DATA", name, hashlib.sha256(fh.read()).hexdigest(), flush=True)
"""


def run(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


@pytest.fixture
def data_lab(loopback, transactional_db, fast_settings, tmp_path, monkeypatch):
    from cluster.config_yaml import import_cluster
    from cluster.links import pool

    from .worker_here import worker_here

    end_leftovers(loopback.root)
    pool.close_all()
    shared = loopback.root / "data-shared-workdir"
    shared.mkdir(exist_ok=True)
    text = cluster_yaml(loopback, 3)
    for node in loopback.nodes[1:3]:  # node2 and node3: one working directory (NFS)
        text = text.replace(f'workdir: "{node.workdir}"', f'workdir: "{shared}"')
    import_cluster(text)
    ds = tmp_path / "datasets" / "corpus"
    ds.mkdir(parents=True)
    for i in range(FILES):
        (ds / f"shard{i}.bin").write_bytes(os.urandom(SIZE))
    cs = ClusterSettings.load()
    cs.paths = {**(cs.paths or {}), "sync_roots": [str(tmp_path / "datasets")]}
    cs.save()
    for workdir in (Path(loopback.nodes[0].workdir), shared):
        (workdir / "check_data.py").write_text(CHECK)
    with worker_here():
        yield ds, shared
    pool.close_all()


def test_a_dataset_reaches_three_nodes_once_resumes_after_a_node_is_cut_off_and_a_job_finds_it(
    data_lab, loopback, monkeypatch
):
    """Covers: the transfer path between real nodes' agents over SSH and node-to-node TCP: a node killed
    mid-transfer resumed from a peer with only the chunks it lacked, a shared workdir receiving once, and --data
    placed before a real torchrun job's ranks start.
    """
    ds, shared = data_lab
    nodes = list(Node.objects.order_by("name"))
    cs = ClusterSettings.load()
    _, objs = data.stage_controller(data.Item(str(ds), "corpus"), cs)
    total = sum(o.size for o in objs)
    # the controller's stream slowed (10 ms a MiB) so that the cut lands mid-way, whatever this machine's speed
    real = transfer.controller_chunks

    def slow(*args):
        for block in real(*args):
            threading.Event().wait(0.01)
            yield block

    monkeypatch.setattr(transfer, "controller_chunks", slow)
    victim = nodes[1]  # node2: the shared directory's receiver, second in the chain
    agent_pid = victim.link().request("hello")["pid"]
    parts = shared / ".ugro" / "objects" / ".xfer"
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(got=transfer.deliver(objs, nodes, what="corpus")))
    thread.start()

    def verified() -> int:
        held = 0
        for ok in parts.glob("*.ok"):
            try:
                held += int(ok.read_text() or 0)
            except (OSError, ValueError):
                pass
        return held

    # when node2's agent is killed once it holds 24 MB checked
    wait_for(lambda: verified() >= 24 << 20, timeout=60, interval=0.02, what="node2 midway")
    os.kill(agent_pid, signal.SIGKILL)
    held_at_cut = verified() + sum(o.size for o in objs if (shared / ".ugro" / "objects" / o.sha).exists())
    thread.join(timeout=300)
    got = result["got"]
    # then every byte left the controller once, node1 passed node2 what it lacked (a second round, node to node),
    # resending under 5% of the data, and node3 (node2's directory) received nothing of its own
    assert got.controller_bytes == total and got.rounds == 2, got
    assert 0 <= got.peer_bytes - (total - held_at_cut) < 0.05 * total, (got.peer_bytes, total, held_at_cut)
    for workdir in (Path(nodes[0].workdir), shared):
        for o in objs:
            obj = workdir / ".ugro" / "objects" / o.sha
            assert obj.stat().st_size == o.size
    assert hashlib.sha256((shared / ".ugro" / "objects" / objs[0].sha).read_bytes()).hexdigest() == objs[0].sha

    # when a job on the three is launched with the dataset as --data
    monkeypatch.setattr(transfer, "controller_chunks", real)
    run("launch", "--name", "dj", "--nodes", "3", "--script", "check_data.py", "--data", f"{ds}:corpus",
        "--detach", "--", "{job_dir}/corpus")  # fmt: skip
    job = Job.objects.get(name="dj")
    wait_for(lambda: Job.objects.get(pk=job.pk).state in (Job.State.SUCCEEDED, Job.State.FAILED), timeout=120,
             what="the job's end")  # fmt: skip
    job.refresh_from_db()
    # then its ranks read every shard, whole, from {job_dir}/corpus, and the delivery sent nothing
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    logs = run("logs", "dj")
    for o, name in zip(objs, sorted(p.name for p in ds.iterdir()), strict=True):
        assert logs.count(f"DATA {name} {o.sha}") == 3, logs[-2000:]
    code = JobCode.objects.get(job=job)
    assert code.transfer["controller_bytes"] == 0 and code.transfer["peer_bytes"] == 0, code.transfer
    assert f"data: {ds} -> corpus (201.3 MB), delivered in " in run("status", "dj")
    placed = shared / "outputs" / "dj" / "corpus" / "shard0.bin"
    assert placed.stat().st_nlink >= 2 and not placed.stat().st_mode & 0o222
