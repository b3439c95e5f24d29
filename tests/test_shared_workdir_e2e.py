"""Three real sshd nodes whose working directory is ONE directory (an NFS-mounted home, the usual lab setup):
the job's code is built there once, its checkpoints are one checkpoint, and a synced job checkpoints, is
cancelled and resumes from its checkpoint on all three, with real torchrun."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.core.management import CommandError, call_command

from cluster.models import ClusterSettings, Node
from jobs import checkpoints
from jobs.models import Checkpoint, Job, JobCode
from metrics.models import MetricPoint
from ugro_client import manifest

from .conftest import REPO, cluster_yaml, end_leftovers, job_pids, wait_for

pytestmark = pytest.mark.e2e

# 40 short steps (6 s: time to cancel after the first checkpoint), a checkpoint every 10, a metric line every 5
TRAIN = ["--max-steps", "60", "--seq-len", "16", "--batch-size", "4", "--log-every", "5", "--save-every", "10",
         "--step-sleep", "0.15"]  # fmt: skip


def run(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


@pytest.fixture(scope="module")
def shared_workdir(loopback) -> Path:
    """One working directory for every node, under the loopback cluster's root (its leftovers are ended there)."""
    shared = loopback.root / "shared-workdir"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture
def shared_lab(loopback, shared_workdir, transactional_db, fast_settings, tmp_path, monkeypatch):
    """node1-3 imported from a cluster.yaml whose nodes all have the shared working directory, a project to sync
    (the reference training script, under a sync root) and a worker on a thread of this process."""
    from cluster.config_yaml import import_cluster
    from cluster.links import pool

    from .worker_here import worker_here

    monkeypatch.setattr("jobs.follow.CHECKPOINT_SCAN_S", 0.5)
    end_leftovers(loopback.root)
    pool.close_all()
    text = cluster_yaml(loopback, 3)
    for node in loopback.nodes[:3]:
        text = text.replace(f'workdir: "{node.workdir}"', f'workdir: "{shared_workdir}"')
    import_cluster(text)
    assert set(Node.objects.values_list("workdir", flat=True)) == {str(shared_workdir)}
    project = tmp_path / "code" / "proj"
    shutil.copytree(REPO / "train", project, ignore=shutil.ignore_patterns("__pycache__"))
    (project / "assets").mkdir()
    (project / "assets" / "vocab.bin").write_bytes(os.urandom(1_200_000))  # over a megabyte: it streams
    cs = ClusterSettings.load()
    cs.paths = {**(cs.paths or {}), "sync_roots": [str(tmp_path / "code")]}
    cs.save()
    health = io.StringIO()
    with contextlib.suppress(CommandError):  # (loopback nodes have no GPU: health may say so)
        call_command("health", "--json", stdout=health)  # a poll, as the worker's: each node names its workdir's id
    nodes = {n["node"]: n for n in json.loads(health.getvalue())["nodes"]}
    with worker_here():
        yield SimpleNamespace(project=project, health=nodes)


def test_a_synced_job_on_three_nodes_sharing_a_workdir_is_built_once_checkpoints_once_and_resumes(
    shared_lab, shared_workdir
):
    """The only path that runs sync, the follower's checkpoint recording, cancel and resume with the nodes' agents
    on one real shared directory (tests/test_sync.py covers each rule on its own, in a second).

    Covers: sync, checkpoint recording, cancel and resume on three sshd nodes sharing one real working directory: one
    copy, one checkpoint, no file written by two agents.
    """
    project = shared_lab.project
    # given three nodes that share one working directory, and a job synced to all three that checkpoints
    run("launch", "--name", "sh1", "--nodes", "3", "--sync", str(project), "--script", "train_production.py",
        "--detach", "--", *TRAIN)  # fmt: skip
    job = Job.objects.get(name="sh1")
    wait_for(lambda: checkpoints.offered(job) and Job.objects.get(pk=job.pk).state == Job.State.RUNNING,
             timeout=120, interval=0.1, what="a checkpoint")  # fmt: skip
    # (cancelled at once, and looked at after: a loaded machine must not let it train to its last step first)
    run("cancel", "sh1")
    job.refresh_from_db()
    # then the copy was built once for the three of them (the store was empty: each object sent once)
    code = JobCode.objects.get(job=job)
    sizes = {f["sha256"]: f["size"] for f in manifest.build(str(project)).files}
    assert code.sync_sent_bytes == sum(sizes.values()), (code.sync_sent_bytes, sum(sizes.values()))
    assert not list(shared_workdir.glob("outputs/sh1/code.ugro-*"))
    # and the nodes know they share it, from one marker each of them read back, as `health --json` says
    marker = (shared_workdir / ".ugro" / "workdir-id").read_text().strip()
    assert set(Node.objects.values_list("workdir_id", flat=True)) == {marker} and len(marker) == 32
    assert shared_lab.health["node1"]["workdir_shared_with"] == ["node2", "node3"]
    # and each checkpoint the three ranks see is recorded once
    paths = list(Checkpoint.objects.filter(job=job).values_list("path", flat=True))
    assert paths and len(paths) == len(set(paths)), paths

    # when it is cancelled and resumed from its latest checkpoint, on the same three nodes
    assert job.state == Job.State.CANCELLED and job_pids(job.tag) == []
    out = run("resume", "sh1")
    assert "queued as attempt 2" in out, out
    job.refresh_from_db()
    ckpt = job.resume_checkpoint
    run("logs", "sh1", "--follow")
    job.refresh_from_db()
    # then attempt 2 ran on the three, from that checkpoint (not copied anywhere: every node sees it), to the end
    assert job.state == Job.State.SUCCEEDED and job.attempt == 2, job.failure_reason
    assert sorted(job.ranks.values_list("node__name", flat=True)) == ["node1", "node2", "node3"]
    assert f"resuming from {checkpoints.path_for_rank0(ckpt)}" in run("logs", "sh1")
    assert Checkpoint.objects.get(pk=ckpt.pk).sha256 == ""
    steps = sorted(set(MetricPoint.objects.filter(job=job, name="loss", attempt=2).values_list("step", flat=True)))
    assert steps[0] == ckpt.step + 5 and steps[-1] == 60, steps
    # and the second sync sent nothing: the copy of attempt 1 is the copy of every node
    assert JobCode.objects.get(job=job).sync_sent_bytes == 0
    config = json.loads((job.job_dir / "config.json").read_text())
    logs = {r["remote_log"] for r in config["ranks"]}
    assert len(logs) == 3 and all(Path(p).is_file() for p in logs)
    assert not subprocess.run(["find", str(shared_workdir), "-name", "*.ugro-part*"], capture_output=True,
                              text=True).stdout  # fmt: skip
