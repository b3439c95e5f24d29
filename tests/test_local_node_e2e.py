"""A node with the local transport runs without SSH: one machine, no sshd, works."""

from __future__ import annotations

import io
import shutil

import pytest
from django.core.management import call_command

from cluster.config_yaml import import_cluster
from jobs.models import Job

from .conftest import FAST_TRAIN, NODE_ENV, REPO

pytestmark = pytest.mark.e2e


def test_local_node_trains_without_ssh(test_worker, fast_settings, tmp_path):
    """Covers: a job trained on a node with the local transport (the agent a local process, no sshd), and the reading
    commands on that real job.
    """
    workdir = tmp_path / "local"
    shutil.copytree(REPO / "train", workdir / "train")
    import_cluster(
        "cluster:\n  master_ip: 127.0.0.1\nnodes:\n  this-box:\n    ip: 127.0.0.1\n    transport: local\n"
        f"    role: master\n    gpus: 0\n    torchrun: {NODE_ENV}/bin/torchrun\n    workdir: {workdir}\n"
        "training:\n  script: train/train_production.py\n"
    )
    out = io.StringIO()
    call_command("launch", "--name", "solo", "--", *FAST_TRAIN, stdout=out)
    job = Job.objects.get(name="solo")
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    assert '[rank 0] {"step": 2' in out.getvalue()
    assert b"training complete" in job.ranks.get().local_log.read_bytes()

    # and the reading commands show what happened
    def run(*args):
        buf = io.StringIO()
        call_command(*args, stdout=buf)
        return buf.getvalue()

    assert "solo" in run("status") and "succeeded" in run("status")
    detail = run("status", "solo")
    assert "rank 0 on this-box" in detail and "exit      0" in detail
    merged = run("logs", "solo")
    assert merged.splitlines()[0].startswith("[rank 0] ")
    only = run("logs", "solo", "--rank", "0", "--tail", "2")
    assert only.splitlines()[-1].startswith("training complete") and len(only.splitlines()) == 2
    results = run("results", "solo")
    assert "(last loss logged by rank 0)" in results
    assert "checkpoints: 2" in results and "checkpoint_step12.pt" in results
    assert run("queue").strip() == "queue is empty"
    assert "this-box:" in run("export_cluster")


def test_reading_commands_fail_with_one_line_for_unknown_jobs(transactional_db):
    """Covers: no node: the reading commands' refusal of an unknown job reads the database only; e2e only by its
    module's pytestmark: it belongs in a fast file.
    """
    from django.core.management import CommandError

    for cmd in ("status", "logs", "results", "cancel"):
        with pytest.raises(CommandError, match="no job named 'ghost'"):
            call_command(cmd, "ghost")
