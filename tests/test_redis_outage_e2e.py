"""Redis stopped and started again under a running job: the worker (as bin/start runs it, bin/worker)
stays up, follows the job to its end, and no log line is lost or repeated."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jobs.models import Job

from .conftest import REPO, free_port, ranks_logged, redis_server, wait_for, wait_port

pytestmark = [pytest.mark.e2e, pytest.mark.no_test_worker]
TRAIN = ["--max-steps", "60", "--seq-len", "16", "--batch-size", "4", "--log-every", "1", "--step-sleep", "0.2"]


def start_redis(port: int, cwd) -> subprocess.Popen:
    proc = subprocess.Popen(
        [redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd,
    )  # fmt: skip
    wait_port(port)
    return proc


def test_worker_follows_a_job_through_a_redis_restart(lab, controller_env, tmp_path):
    """Covers: a `manage.py launch` process handing the start to a live bin/worker (recorded as the job's launcher),
    then Redis stopped for 5 s and started empty under that worker following the real job: the worker stays up, no
    log line lost or repeated.
    """
    port = free_port()
    redis = start_redis(port, tmp_path)
    env = dict(controller_env, REDIS_URL=f"redis://127.0.0.1:{port}/0", UGRO_WORKER_THREADS="4")
    log_path = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [str(REPO / "bin" / "worker")],
        cwd=REPO, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        # the launch command speaks to the worker's Redis: as a process of its own, with the worker's environment
        import redis as redis_client

        beat = redis_client.Redis(port=port)
        wait_for(lambda: beat.exists("ugro:worker-alive"), timeout=60, what="the worker's heartbeat")
        argv = [sys.executable, str(REPO / "manage.py"), "launch", "--name", "outage", "--nodes", "2", "--detach", "--",
                *TRAIN]  # fmt: skip
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        # the command handed the start to the live worker, whose warm links started the ranks
        job = Job.objects.get(name="outage")
        assert job.launcher.split(":")[:2] == [socket.gethostname(), str(worker.pid)], job.launcher
        assert "job outage running: rank 0 on node1" in done.stdout
        wait_for(lambda: ranks_logged(job, 5), timeout=60, what="the worker to follow")
        # when Redis stops for 5 s while the job runs, and comes back empty (it keeps nothing on disk)
        redis.terminate()
        redis.wait(timeout=10)
        time.sleep(5)
        redis = start_redis(port, tmp_path)
        # then the worker is still there and follows the job to its end
        wait_for(lambda: Job.objects.get(pk=job.pk).is_ended, timeout=120, what="the job to end")
        assert worker.poll() is None, log_path.read_text()[-2000:]
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
        if redis.poll() is None:
            redis.terminate()
            redis.wait(timeout=10)
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    for r in job.ranks.all():
        assert r.local_log.read_bytes() == open(r.remote_log, "rb").read()
    assert not job.ranks.filter(active=True).exists()
    log = log_path.read_text()
    assert "Unrecoverable error" not in log and "Error on restarting" not in log, log[-3000:]
