"""bin/start keeps its services up: a worker that dies on its own is started again, Ctrl-C stops all."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from .conftest import REPO, free_port, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def started_by(data_dir: str) -> dict[int, bytes]:
    """pid -> command line of every process whose environment names this UGRO data dir."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
        except OSError:
            continue
        if f"UGRO_DATA_DIR={data_dir}".encode() in env:
            found[int(pid)] = cmd
    return found


def workers(data_dir: str) -> list[int]:
    return [pid for pid, cmd in started_by(data_dir).items() if b"celery -A ugro_site worker" in cmd]


def test_a_dead_worker_is_started_again_and_ctrl_c_stops_everything(controller_env, tmp_path):
    """Covers: bin/start's supervision: a worker that dies on its own started again, then Ctrl-C stopping every process
    with exit status 0.
    """
    data = str(tmp_path / "data")
    env = dict(controller_env, UGRO_DATA_DIR=data, UGRO_PORT=str(free_port()), UGRO_ADMIN_PASSWORD="pw-x-12345678")
    out = tmp_path / "start.out"
    start = subprocess.Popen(
        [str(REPO / "bin" / "start")], cwd=REPO, env=env, stdout=open(out, "wb"), stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a terminal gives it; Ctrl-C = SIGINT to the group
    )  # fmt: skip
    try:
        wait_for(lambda: "UGRO is up" in out.read_text() and len(workers(data)) == 1, timeout=90, what="the worker")
        time.sleep(1)
        first = workers(data)
        assert len(first) == 1, (out.read_text(), (tmp_path / "data" / "run" / "worker.log").read_text())
        first = first[0]
        # when the worker dies on its own
        os.kill(first, signal.SIGKILL)
        # then bin/start starts another and says so
        wait_for(lambda: (now := workers(data)) and now[0] != first, timeout=30, what="a new worker")
        assert "worker exited (rc 137); starting it again" in out.read_text()
        # and Ctrl-C stops every process it started, with exit status 0 and no "exited" complaint
        os.killpg(start.pid, signal.SIGINT)
        assert start.wait(timeout=40) == 0
        wait_for(lambda: not started_by(data), timeout=20, what="every service to stop")
        assert "a UGRO process exited" not in out.read_text()
    finally:
        if start.poll() is None:
            os.killpg(start.pid, signal.SIGKILL)
        for pid in started_by(data):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
