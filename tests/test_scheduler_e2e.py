"""GPUs as the unit on real sshd nodes and real torchrun: two jobs share a node on different GPUs, and a
job past its time limit is stopped (SIGTERM first) with kind TIMEOUT."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from django.utils import timezone

from cluster.models import Node
from jobs.follow import follow
from jobs.launch import LaunchRequest, create_job
from jobs.models import Allocation, Job
from jobs.reconcile import reconcile
from jobs.scheduler import schedule

from .conftest import REPO, job_pids, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def gpu_lab(lab):
    """node1 declares 2 GPUs read from a fixture file (the ranks still run on CPU), the test scripts in its
    workdir; the other nodes are disabled."""
    workdir = lab.nodes[0].workdir
    shutil.copytree(REPO / "tests" / "data" / "scripts", workdir / "scripts", dirs_exist_ok=True)
    gpu = {"name": "NVIDIA GeForce RTX 4070", "util_percent": 0, "mem_used_mb": 300, "mem_total_mb": 8188,
           "temp_c": 40, "power_w": 20.0}  # fmt: skip
    (workdir / "gpus.json").write_text(json.dumps([{**gpu, "index": i, "uuid": f"GPU-{i}"} for i in range(2)]))
    node = Node.objects.get(name=lab.nodes[0].name)
    node.gpu_reader = f"fixture:{workdir / 'gpus.json'}"
    node.gpu_count = 2
    node.save()
    Node.objects.exclude(pk=node.pk).update(enabled=False)
    return node


def run_to_end(jobs: list[Job], timeout: float = 90) -> None:
    ids = [j.pk for j in jobs]

    def ended() -> bool:
        follow(1.0, job_ids=ids)
        reconcile(ids, orphans=False)
        return all(j.is_ended for j in Job.objects.filter(pk__in=ids))

    wait_for(ended, timeout=timeout, interval=0.1, what="jobs to end")


def test_two_jobs_run_side_by_side_on_one_node_each_on_its_own_gpu(gpu_lab):
    """Covers: two jobs on one real node, each torchrun worker seeing only its own GPU (CUDA_VISIBLE_DEVICES); the
    placement alone is tests/test_scheduler.py's.
    """
    # given a node with 2 GPUs; when two 1-GPU jobs are queued
    jobs = [create_job(LaunchRequest(name=f"share{i}", gpus=1, script="scripts/gpus_seen.py",
                                     extra_args=["--hold", "2"])) for i in range(2)]  # fmt: skip
    launched = schedule()
    # then both start at once on the same node, each holding its own GPU
    assert sorted(j.name for j in launched) == ["share0", "share1"]
    states = {j.name: (j.state, j.failure_reason) for j in Job.objects.filter(pk__in=[j.pk for j in jobs])}
    assert all(s == Job.State.RUNNING for s, _ in states.values()), states
    held = sorted(Allocation.objects.filter(active=True).values_list("job__name", "gpu_index"))
    assert held == [("share0", 0), ("share1", 1)]
    run_to_end(jobs)
    # and each worker saw only its own GPU, one worker per GPU
    for job, gpu in zip(jobs, (0, 1), strict=True):
        job.refresh_from_db()
        assert job.state == Job.State.SUCCEEDED, job.failure_reason
        log = job.ranks.get().local_log.read_text()
        assert f"rank 0 local 0/1 CUDA_VISIBLE_DEVICES={gpu}" in log, log
    assert not Allocation.objects.filter(active=True).exists()


def test_a_job_past_its_time_limit_gets_sigterm_then_ends_failed_timeout(gpu_lab):
    """Covers: a real script getting SIGTERM when its time limit passes (time for a last checkpoint), then FAILED with
    kind TIMEOUT and its GPUs freed.
    """
    # given a running job whose script would run for a minute and has printed its first line
    job = create_job(LaunchRequest(name="overtime", gpus=2, time_limit_s=3600, script="scripts/gpus_seen.py",
                                   extra_args=["--hold", "60"]))  # fmt: skip
    schedule()
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING, job.failure_reason

    def printed() -> bool:
        follow(1.0, job_ids=[job.pk])
        log = job.ranks.get().local_log
        return log.exists() and log.read_text().count("CUDA_VISIBLE_DEVICES") == 2

    wait_for(printed, timeout=60, interval=0.2, what="both workers to start")
    # when its time limit is found passed (a 1 s limit, the job started longer ago than that)
    Job.objects.filter(pk=job.pk).update(time_limit_s=1)
    run_to_end([job], timeout=60)
    job.refresh_from_db()
    # then it was stopped with kind TIMEOUT, the script got SIGTERM (time for a last checkpoint)
    assert job.state == Job.State.FAILED and job.failure_kind == "TIMEOUT", job.failure_reason
    assert "past its time limit of 0m01s" in job.failure_reason
    log = job.ranks.get().local_log.read_text()
    assert "CUDA_VISIBLE_DEVICES=0,1" in log and "local 1/2" in log
    assert "got SIGTERM: saving a last checkpoint" in log, log
    assert "done" not in log.split()
    assert job_pids(job.tag) == [] and not job.allocations.filter(active=True).exists()


def test_a_job_starts_beside_another_jobs_busy_gpu_on_the_same_node(gpu_lab):
    """Covers: a 1-GPU job placed beside another job's nearly full GPU: its pre-flight, through the agent, looks at its
    own GPU only, and it runs there.
    """
    # given node1's GPU 0 nearly full, held by another job
    workdir = Path(gpu_lab.workdir)
    readings = json.loads((workdir / "gpus.json").read_text())
    readings[0]["mem_used_mb"] = 8000
    (workdir / "gpus.json").write_text(json.dumps(readings))
    other = Job.objects.create(name="other", script="x.py", state=Job.State.RUNNING, started_at=timezone.now())
    Allocation.objects.create(job=other, node=gpu_lab, gpu_index=0)
    # when a 1-GPU job is scheduled, it gets GPU 1 and its pre-flight looks at GPU 1 only
    job = create_job(LaunchRequest(name="beside", gpus=1, script="scripts/gpus_seen.py"))
    schedule()
    job.refresh_from_db()
    assert job.state != Job.State.FAILED, job.failure_reason
    run_to_end([job])
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    assert "CUDA_VISIBLE_DEVICES=1" in job.ranks.get().local_log.read_text()
