"""Two workers side by side on one database and Redis, as a controller grows past one worker process: they
share the work (both run tasks), and no job is handled twice: each rank started once, each log line and
metric point kept once, one teardown per cancel, one alert per failure."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import Counter

import pytest

from cluster.models import Alert
from jobs.models import Job, Rank
from metrics.models import MetricPoint

from .conftest import REPO, SLOW_TRAIN, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.no_test_worker]
SHORT = ["--max-steps", "30", "--seq-len", "16", "--batch-size", "4", "--log-every", "1", "--step-sleep", "0.1"]


def start_worker(env: dict, tmp_path, name: str) -> subprocess.Popen:
    """A worker exactly as bin/start runs it (beat on a thread inside, one fires at a time), logging each task."""
    return subprocess.Popen(
        [str(REPO / "bin" / "worker"), "-n", f"{name}@%h"], cwd=REPO,
        env={**env, "UGRO_WORKER_THREADS": "4", "UGRO_LOG_LEVEL": "info"},
        stdout=open(tmp_path / f"{name}.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def stop(worker: subprocess.Popen) -> None:
    if worker.poll() is None:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)


def manage(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "manage.py"), *args], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_two_workers_share_the_work_and_handle_no_job_twice(lab, controller_env, tmp_path):
    """Covers: two bin/worker processes sharing one queue on real jobs: each rank started once, each line and point kept
    once, one teardown per stop, one alert per failure.
    """
    from ugro_site.celery import worker_alive

    workers = [start_worker(controller_env, tmp_path, name) for name in ("w1", "w2")]
    try:
        wait_for(worker_alive, timeout=60, what="the workers' heartbeat")
        # given three jobs handed to the workers by commands, one after the other (the loopback nodes share one
        # machine's ports: two jobs' rendezvous would collide): one to succeed, one to fail, one to be cancelled
        for name, args in (("ok", SHORT), ("crash", [*SHORT, "--fail-at-step", "12"]), ("stopped", SLOW_TRAIN)):
            done = manage(controller_env, "launch", "--name", name, "--nodes", "2", "--detach", "--", *args)
            assert done.returncode == 0, done.stderr
            if name != "stopped":
                wait_for(lambda n=name: Job.objects.get(name=n).is_ended, timeout=120, what=f"job {name} to end")
        stopped = Job.objects.get(name="stopped")
        wait_for(lambda: sum(r.log_lines for r in stopped.ranks.all()) >= 5, timeout=90, what="'stopped' to train")
        done = manage(controller_env, "cancel", "stopped")
        assert done.returncode == 0, done.stderr
        # when the workers run them to their ends
        wait_for(lambda: all(j.is_ended for j in Job.objects.all()) and Job.objects.count() == 3, timeout=150,
                 what="every job to end")  # fmt: skip
        wait_for(lambda: not Rank.objects.filter(state="running").exists(), timeout=30, what="every rank's end")
    finally:
        for worker in workers:
            stop(worker)
    states = dict(Job.objects.values_list("name", "state"))
    assert states == {"ok": "succeeded", "crash": "failed", "stopped": "cancelled"}
    for job in Job.objects.all():
        for rank in job.ranks.all():
            # then each rank started once (its node's log holds step 1 once), and its log was copied once
            node_bytes = open(rank.remote_log, "rb").read()
            assert node_bytes.count(b'{"step": 1, ') == 1 and rank.local_log.read_bytes() == node_bytes
            assert rank.log_lines == node_bytes.count(b"\n")
        points = Counter(MetricPoint.objects.filter(job=job).values_list("rank", "step", "name", "attempt"))
        assert points and max(points.values()) == 1, job.name
    # and the failure was announced once; each stopping job (the failed one, the cancelled one) torn down once
    assert Alert.objects.filter(key="job_failed:crash").count() == 1
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in ("w1", "w2")}
    teardowns = sum(len(re.findall(r"jobs\.tasks\.teardown_job\[[^\]]+\] succeeded", text)) for text in logs.values())
    assert teardowns == 2 and "Traceback" not in "".join(logs.values())  # one each for 'crash' and 'stopped'
    # and both workers took tasks from the shared queue
    for name, text in logs.items():
        assert re.search(r"Task jobs\.tasks\.\w+\[[^\]]+\] received", text), f"{name} ran no task"
