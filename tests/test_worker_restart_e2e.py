"""A Celery worker killed, or stopped, and another started mid-run loses no log line and repeats none."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from django.core.management import call_command

from jobs.models import Job, Rank
from metrics.models import MetricPoint
from ugro_site.celery import worker_alive

from .conftest import REPO, ranks_logged, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.no_test_worker]
TRAIN = ["--max-steps", "120", "--seq-len", "16", "--batch-size", "4", "--log-every", "1", "--step-sleep", "0.2"]


def start_worker(env: dict, tmp_path, name: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "ugro_site", "worker", "-P", "threads", "-c", "4",
         "-n", f"{name}@%h", "--loglevel=warning"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def kill_worker(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_a_worker_killed_or_stopped_mid_run_loses_and_repeats_no_line(lab, controller_env, tmp_path):
    """Covers: the Celery worker killed, then another stopped, while following a real job: each successor goes on from
    the database's offsets, no line lost or repeated, the lease handed back on a stop.
    """
    env = controller_env  # follow tasks run ten minutes (jobs.tasks.FOLLOW_SECONDS): the kill comes mid-task
    first = start_worker(env, tmp_path, "w1")
    try:
        wait_for(worker_alive, timeout=60, what="w1's heartbeat")
        call_command("launch", "--name", "durable", "--nodes", "2", "--detach", "--", *TRAIN, stdout=io.StringIO())
        job = Job.objects.get(name="durable")
        assert job.state == Job.State.RUNNING
        # given the worker is following the job; when it is killed without warning
        wait_for(lambda: ranks_logged(job, 10), timeout=90, what="w1 to follow")
    finally:
        kill_worker(first)
    seen = {r.index: r.log_lines for r in job.ranks.all()}
    second = start_worker(env, tmp_path, "w2")
    try:
        # then a new worker picks up where the DB says; when it is stopped as bin/start's Ctrl-C does
        wait_for(lambda: all(r.log_lines >= seen[r.index] + 10 for r in job.ranks.all()), timeout=90, what="w2")
        os.killpg(second.pid, signal.SIGTERM)
        # then its follow task hands the job back (its lease released, not left to lapse) and the
        # worker exits, long before the task's 600 s were up
        second.wait(timeout=60)
        assert Job.objects.get(pk=job.pk).follower == "" and not Job.objects.get(pk=job.pk).is_ended
    finally:
        if second.poll() is None:
            kill_worker(second)
    third = start_worker(env, tmp_path, "w3")
    try:
        # and the next worker takes it at once and follows it to its end
        wait_for(lambda: Job.objects.get(pk=job.pk).is_ended, timeout=150, what="the job to end under w3")
    finally:
        kill_worker(third)
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    for r in job.ranks.all():
        node_bytes = open(r.remote_log, "rb").read()
        assert r.local_log.read_bytes() == node_bytes
        assert r.log_lines == node_bytes.count(b"\n") and r.log_lines > seen[r.index]
    dupes = Counter(MetricPoint.objects.filter(job=job).values_list("rank", "step", "name"))
    assert dupes and max(dupes.values()) == 1
    steps = set(MetricPoint.objects.filter(job=job, name="loss", rank=0).values_list("step", flat=True))
    assert steps == set(range(1, 121))


def test_a_worker_alone_as_bin_worker_runs_it_ends_a_detached_job_whose_processes_vanished(lab, controller_env,
                                                                                             tmp_path):  # fmt: skip
    """Covers: bin/worker alone with its beat inside: a detached job whose every process vanished on real nodes (no
    exit record: the agent's rank status says so) failed by the worker's own reconcile schedule, its ranks lost.
    """
    from .conftest import SLOW_TRAIN, job_pids

    # given a detached job and the worker exactly as bin/start runs it: no beat beside it (its schedule is in it)
    worker = subprocess.Popen([str(REPO / "bin" / "worker"), "-n", "alone@%h"], cwd=REPO,
                              env={**controller_env, "UGRO_WORKER_THREADS": "4"},
                              stdout=open(tmp_path / "alone.log", "wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)  # fmt: skip
    try:
        wait_for(worker_alive, timeout=60, what="the worker's heartbeat")
        call_command("launch", "--name", "vanish", "--nodes", "2", "--detach", "--", *SLOW_TRAIN, stdout=io.StringIO())
        job = Job.objects.get(name="vanish")  # may still be queued: the worker, just started, had 5 s to start it
        wait_for(lambda: ranks_logged(job, 2), timeout=120, what="the worker to follow")
        # when every process of the job is killed at once, the wrappers first (so none records an exit code)
        wrappers = [json.loads(Path(r.start_record).read_text())["wrapper_pid"] for r in job.ranks.all()]
        # the tag read now: `job` was fetched before its start, and its cached attempt may still have none
        tag = Job.objects.get(pk=job.pk).tag
        assert tag
        for pid in [*wrappers, *job_pids(tag)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # then the job does not sit RUNNING: its ranks are judged lost and it fails within a few of the
        # worker's reconcile intervals (5 s) plus the follower's lease (4 s here), with room for a busy machine
        wait_for(lambda: Job.objects.get(pk=job.pk).is_ended, timeout=90, what="the job to end")
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_worker(worker)
    job.refresh_from_db()
    assert job.state == Job.State.FAILED, job.state
    # the ranks judged lost say so, and the job names one of them (which rank alone vanished: tests/test_loops.py)
    lost = {r.index: r.lost_reason for r in job.ranks.filter(state=Rank.State.LOST)}
    assert lost and all("without recording an exit code" in why for why in lost.values()), lost
    assert job.failure_rank in lost and "without recording an exit code" in job.failure_reason, job.failure_reason
    assert "Traceback" not in (tmp_path / "alone.log").read_text()
