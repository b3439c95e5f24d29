"""bin/start when a service ends for good on its own: it is named, the rest stopped, exit status 1.

(Ctrl-C, a quiet stop with status 0, and a dead worker started again: tests/test_start_supervisor_e2e.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from .conftest import REPO, free_port, wait_for
from .test_start_supervisor_e2e import started_by
from .worker_env import redis_url_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_a_web_server_that_dies_is_named_and_the_rest_stopped(controller_env, tmp_path):
    data = str(tmp_path / "data")
    # its own Redis db on this run's server (bin/test's): this bin/start's worker must not take other tests' tasks
    env = dict(controller_env, UGRO_DATA_DIR=data, UGRO_PORT=str(free_port()), UGRO_ADMIN_PASSWORD="pw-x-12345678",
               REDIS_URL=redis_url_for(os.environ["REDIS_URL"], 12))  # fmt: skip
    out = tmp_path / "start.out"
    start = subprocess.Popen([str(REPO / "bin" / "start")], cwd=REPO, env=env, stdout=open(out, "wb"),
                             stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:

        def web() -> list[int]:
            return [pid for pid, cmd in started_by(data).items() if b"daphne" in cmd]

        wait_for(lambda: "UGRO is up" in out.read_text() and web(), timeout=90, what="the web server")
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
