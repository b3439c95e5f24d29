"""bin/start as a user runs it: Ctrl-C is a quiet, complete stop; a process that dies is named."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from .conftest import REPO, free_port, wait_for

pytestmark = pytest.mark.e2e


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (read from /proc: the script's web, worker and beat)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture
def started(transactional_db, controller_env, tmp_path):
    """bin/start on a free port, the test's database, its own data dir and Redis db (never 8099)."""
    port = free_port()
    env = {**controller_env, "UGRO_PORT": str(port), "REDIS_URL": "redis://127.0.0.1:6379/12"}
    err = tmp_path / "start.err"
    with open(tmp_path / "start.out", "wb") as out, open(err, "wb") as errf:
        # its own session: a Ctrl-C reaches its whole process group, as from a terminal
        proc = subprocess.Popen([str(REPO / "bin" / "start")], cwd=REPO, env=env, stdout=out, stderr=errf,
                                start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: _answers(port) or proc.poll() is not None, timeout=120, what="bin/start's web server")
        assert proc.poll() is None, err.read_text()
        kids = wait_for(lambda: len(_children(proc.pid)) == 3 and _children(proc.pid), 30, what="three processes")
        yield proc, kids, err, port
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_ctrl_c_stops_everything_quietly(started):
    proc, kids, err, port = started
    # when the user presses Ctrl-C (SIGINT to the foreground process group)
    os.killpg(proc.pid, signal.SIGINT)
    # then it exits as an interrupted shell script does, saying nothing about a process that died
    code = proc.wait(timeout=60)
    assert "a UGRO process exited" not in err.read_text()
    assert code == 130
    # and web, worker and beat are gone
    assert [k for k in kids if _alive(k)] == []
    assert not _answers(port)


def test_a_process_that_dies_on_its_own_is_named_and_the_rest_stopped(started, tmp_path):
    proc, kids, err, port = started
    web = next(k for k in kids if "daphne" in Path(f"/proc/{k}/cmdline").read_bytes().decode())
    # when the web server dies by itself (not a Ctrl-C)
    os.kill(web, signal.SIGKILL)
    # then bin/start says which one, where its log is, stops the others and exits non-zero
    assert proc.wait(timeout=60) == 1
    text = err.read_text()
    assert "a UGRO process exited: web" in text and "web.log" in text
    assert [k for k in kids if _alive(k)] == []
