"""`manage.py launch` (the admins' command on the controller) as a real process: live progress, and Ctrl-C
leaves the job running. The thin `ugro` client has its own tests (tests/test_client.py)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from jobs.models import Job, Rank

from .conftest import REPO, SLOW_TRAIN, job_pids, wait_for

pytestmark = pytest.mark.e2e
UGRO = [str(REPO / ".venv" / "bin" / "python"), str(REPO / "manage.py")]


def test_ctrl_c_leaves_the_job_running_and_says_how_to_follow_or_cancel(lab, controller_env, tmp_path):
    """Covers: Ctrl-C (SIGINT) to a real `manage.py launch` process following a job on two sshd nodes: it exits 0, the
    job runs on, and another process cancels it: every torchrun agent and worker on the nodes killed, no rank left
    active, a second cancel refused.
    """
    out_path = tmp_path / "launch.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([*UGRO, "launch", "--name", "ctrlc", "--nodes", "2", "--", *SLOW_TRAIN], cwd=tmp_path,
                                env=controller_env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        # given the launch shows live progress: the running state and rank-prefixed lines
        wait_for(lambda: b'[rank 1] {"step"' in out_path.read_bytes(), timeout=90, what="live lines")
        assert b"ctrlc running (ranks 0:node1, 1:node2)" in out_path.read_bytes()
        # when the user presses Ctrl-C
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out_path.read_text()
    assert "left job ctrlc running" in text and "ugro logs ctrlc --follow" in text and "ugro cancel ctrlc" in text
    job = Job.objects.get(name="ctrlc")
    assert job.state == Job.State.RUNNING
    assert len(job_pids(job.tag)) >= 4  # torchrun agent + worker on each of 2 nodes
    # and the job can be cancelled from another command: every process of it on every node is killed
    done = subprocess.run([*UGRO, "cancel", "ctrlc"], env=controller_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "no process of it remains" in done.stdout
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED
    assert job_pids(job.tag) == []
    assert not Rank.objects.filter(job=job, active=True).exists()
    # and a second cancel is refused
    with pytest.raises(CommandError, match="already cancelled"):
        call_command("cancel", "ctrlc")


def test_a_refused_launch_exits_non_zero_with_one_line(lab, controller_env):
    """Covers: `manage.py launch` as a process of its own refusing a hostile name: exit status and one line on stderr
    (no node is asked; call_command's refusals are tests/test_security_launch.py's).
    """
    done = subprocess.run([*UGRO, "launch", "--name", "$(touch /tmp/ugro_cli_pwned)"], env=controller_env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0 and "job name" in done.stderr
    assert not Path("/tmp/ugro_cli_pwned").exists()
    assert not Job.objects.exists()
