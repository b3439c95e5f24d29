"""bin/start: "UGRO is up" only once the web server answers; a second bin/start on the same data directory
refuses at once and touches nothing of the first; a worker that dies on its own is started again; a port in use
is named before anything starts; a service that ends for good on its own is named, the rest stopped, exit
status 1.

(Ctrl-C, a quiet stop with status 0 and no process left: the last step of tests/test_newcomer_e2e.py.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from .conftest import REPO, free_port, started_by, wait_for
from .worker_env import redis_url_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def web_answers(port: int) -> bool:
    """Whether an HTTP server answers on the port (any status)."""
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def holding(path: str, pids) -> list[int]:
    """Which of these processes have the file open."""
    path = os.path.realpath(path)
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.path.realpath(f"/proc/{pid}/fd/{fd}") == path for fd in fds):
                found.append(pid)
        except OSError:
            continue
    return found


def test_a_web_server_that_dies_is_named_and_the_rest_stopped(controller_env, tmp_path):
    """Over 10 s: the one path that runs bin/start whole, beside it a second bin/start on its data directory,
    then its worker's death, then its web server's (the port-in-use refusal below starts nothing).

    Covers: bin/start whole: "UGRO is up" once the web answers, a second bin/start refused on its data directory, a
    worker that dies on its own started again, the web server's death named and the rest stopped.
    """
    data = str(tmp_path / "data")
    port = free_port()
    # its own Redis db on this run's server (bin/test's): this bin/start's worker must not take other tests' tasks
    env = dict(controller_env, UGRO_DATA_DIR=data, UGRO_PORT=str(port), UGRO_ADMIN_PASSWORD="pw-x-12345678",
               REDIS_URL=redis_url_for(os.environ["REDIS_URL"], 12))  # fmt: skip
    out = tmp_path / "start.out"
    start = subprocess.Popen([str(REPO / "bin" / "start")], cwd=REPO, env=env, stdout=open(out, "wb"),
                             stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:

        def web() -> list[int]:
            return [pid for pid, cmd in started_by(data).items() if b"daphne" in cmd]

        def workers() -> list[int]:
            return [pid for pid, cmd in started_by(data).items() if b"celery -A ugro_site worker" in cmd]

        wait_for(lambda: "UGRO is up" in out.read_text() and len(workers()) == 1, timeout=90, what="UGRO is up")
        # "UGRO is up" is said once the web server answers, not when it is only started
        assert web_answers(port), out.read_text()
        first_web = web()
        # when a second bin/start is run on the same data directory
        second = subprocess.run([str(REPO / "bin" / "start")], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=120)  # fmt: skip
        # then it refuses at once in one line naming the running one, and leaves that one as it was
        assert second.returncode == 1 and second.stdout == "", second.stdout + second.stderr
        assert second.stderr.count("\n") == 1 and "already runs on data directory" in second.stderr
        assert f"pid {start.pid}, port {port}" in second.stderr
        assert start.poll() is None and first_web and web() == first_web and web_answers(port)
        # and only bin/start holds the lock: a service or database left behind by a crash never would
        assert holding(f"{data}/run/start.lock", started_by(data)) == [start.pid]
        first_worker = workers()
        assert len(first_worker) == 1, (out.read_text(), (tmp_path / "data" / "run" / "worker.log").read_text())
        # when the worker dies on its own
        os.kill(first_worker[0], signal.SIGKILL)
        # then bin/start starts another and says so, and the web server is left as it was
        wait_for(lambda: (now := workers()) and now[0] != first_worker[0], timeout=30, what="a new worker")
        assert len(workers()) == 1 and "worker exited (rc 137); starting it again" in out.read_text()
        assert start.poll() is None and web() == first_web
        # when the web server dies by itself (not a Ctrl-C)
        os.kill(web()[0], signal.SIGKILL)
        # then bin/start names it and its log, stops worker and beat, and exits non-zero
        assert start.wait(timeout=40) == 1, out.read_text()
        text = out.read_text()
        assert "bin/start: web exited for good" in text and "web.log" in text
        assert "a UGRO process exited; see" not in text
        wait_for(lambda: not started_by(data), timeout=20, what="every service to stop")
    finally:
        if start.poll() is None:
            os.killpg(start.pid, signal.SIGKILL)
        for pid in started_by(data):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def test_a_port_in_use_is_named_before_anything_starts(controller_env, tmp_path):
    """Covers: bin/start refusing a port in use, and one that is no number, before it starts anything (seconds)."""
    data = str(tmp_path / "data")
    # given another program listens on the port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(controller_env, UGRO_DATA_DIR=data, UGRO_PORT=str(port), UGRO_ADMIN_PASSWORD="pw-x-12345678",
                   REDIS_URL=redis_url_for(os.environ["REDIS_URL"], 12))  # fmt: skip
        # when bin/start is run on it
        done = subprocess.run([str(REPO / "bin" / "start")], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    # then one line names the port, and nothing was started
    assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and f"127.0.0.1:{port}" in done.stderr and "in use" in done.stderr
    assert not started_by(data) and not (tmp_path / "data" / "run" / "web.log").exists()
    # and a port that is no number is one line too
    bad = subprocess.run([str(REPO / "bin" / "start")], cwd=REPO, env=dict(env, UGRO_PORT="80a"), capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr == "bin/start: UGRO_PORT=80a is not a port number (1-65535)\n"
