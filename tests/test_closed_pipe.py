"""Read commands piped into a reader that stops early (`ugro status | head -1`) end quietly: no traceback, the
exit status of a program whose reader went away (141, as the shell reports SIGPIPE), for the `ugro` client
and for manage.py's commands (accounts/commands.py: every UserCommand)."""

from __future__ import annotations

import os
import subprocess

import pytest

from jobs.models import Job

from .conftest import REPO
from .test_client import NO_DJANGO_PYTHON, server, ugro_script  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)
MANAGE = [str(REPO / ".venv" / "bin" / "python"), str(REPO / "manage.py")]


def run_into_closed_pipe(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run argv with its stdout a pipe into `head -c1`, which has read its byte and exited before argv writes:
    what `argv | head -c1` gives whenever the reader is first (deterministic here)."""
    read, write = os.pipe()
    head = subprocess.Popen(["head", "-c1"], stdin=read, stdout=subprocess.DEVNULL)
    os.close(read)
    try:
        os.write(write, b"x")
        assert head.wait(timeout=10) == 0
        return subprocess.run(argv, env=env, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
        if head.poll() is None:
            head.kill()


def test_the_client_piped_into_a_reader_that_left_ends_quietly(ugro_script, server):  # noqa: F811
    # given a job to show
    Job.objects.create(name="p1", script="x.py", owner=server["user"])
    path, site = ugro_script
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "PYTHON"))}
    env.update(PYTHONPATH=str(site), UGRO_URL=server["url"], UGRO_TOKEN=server["token"], HOME="/nonexistent")
    # when `ugro status NAME`, `ugro status` and `ugro queue` write into a pipe whose reader is gone
    for args in (["status", "p1"], ["status"], ["queue"], ["launch", "--help"]):
        done = run_into_closed_pipe([NO_DJANGO_PYTHON, str(path), *args], env)
        # then each ends with no word on stderr and the status of a program stopped by SIGPIPE
        assert (done.returncode, done.stderr) == (141, ""), args


def test_a_manage_py_read_command_piped_into_a_reader_that_left_ends_quietly(controller_env):
    # given a job to show
    Job.objects.create(name="p2", script="x.py")
    # when `manage.py status` writes into a pipe whose reader is gone
    done = run_into_closed_pipe([*MANAGE, "status"], controller_env)
    # then no traceback, and the status of a program stopped by SIGPIPE
    assert (done.returncode, done.stderr) == (141, "")
