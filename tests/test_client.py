"""The thin `ugro` client as a real console script (installed by pip from pyproject.toml) against a live
server with a real token; run by a Python that has no Django."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pathspec
import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from accounts.tokens import create_token
from cluster.models import Node
from jobs.models import Job, Rank

from .conftest import REPO, wait_for
from .jobrows import update_jobs

NO_DJANGO_PYTHON = "/usr/bin/python3"
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="session")
def ugro_script(tmp_path_factory) -> tuple[Path, Path]:
    """pip installs the project (a copy: no build/ left in the repo) into a target dir: (bin/ugro, site dir)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for pkg in ("ugro_site", "cluster", "jobs", "metrics", "accounts", "api", "serving", "ugro_client"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(target), str(src)], check=True, capture_output=True, timeout=120)  # fmt: skip
    # the client's one dependency (pure Python), as pip would bring it, from the controller's environment
    shutil.copytree(Path(pathspec.__file__).parent, target / "pathspec", ignore=shutil.ignore_patterns("__pycache__"))
    return target / "bin" / "ugro", target


@pytest.fixture
def server(live_server, settings, tmp_path):
    settings.JOBS_DIR = tmp_path / "jobs"
    Node.objects.create(name="n1", address="127.0.0.2", role=Node.Role.MASTER)
    user = User.objects.create_user("dana")
    user.groups.add(Group.objects.get(name="launcher"))
    _, token = create_token(user, "cli", "launch")
    return {"url": live_server.url, "token": token, "user": user}


def ugro(script, server, *args: str, token: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    path, site = script
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "PYTHON"))}
    env.update(PYTHONPATH=str(site), UGRO_URL=server["url"], UGRO_TOKEN=token or server["token"], HOME="/nonexistent")
    return subprocess.run([NO_DJANGO_PYTHON, str(path), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_the_console_script_is_the_thin_client_and_imports_no_django(ugro_script):
    assert ugro_script[0].read_text().splitlines()[2] == "from ugro_client.cli import main"
    for path in (REPO / "ugro_client").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("django", "rest_framework", "jobs", "cluster") for n in names), path
    assert subprocess.run([NO_DJANGO_PYTHON, "-c", "import django"], capture_output=True).returncode != 0


def test_launch_detach_status_table_queue_and_cancel(ugro_script, server):
    done = ugro(ugro_script, server, "launch", "--name", "exp1", "--nodes", "1", "--detach", "--", "--max-steps", "5")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("job exp1 queued (id ")
    job = Job.objects.get(name="exp1")
    assert job.owner == server["user"] and job.script_args[-2:] == ["--max-steps", "5"]
    table = ugro(ugro_script, server, "status").stdout.splitlines()
    assert table[0].split() == ["NAME", "STATE", "PROGRESS", "NODES", "AGE", "OWNER"]
    assert table[1].split()[:2] == ["exp1", "queued"] and table[1].split()[-1] == "dana"
    assert "exp1" in ugro(ugro_script, server, "queue").stdout
    cancelled = ugro(ugro_script, server, "cancel", "exp1")
    assert (
        cancelled.returncode == 0
        and cancelled.stdout.strip() == "job exp1 cancelled; no process of it remains on its nodes"
    )
    exit_code = ugro(ugro_script, server, "status", "exp1", "--exit-code")
    assert exit_code.returncode == 2  # cancelled


def test_errors_are_one_line_with_documented_exit_codes(ugro_script, server):
    usage = ugro(ugro_script, server, "launch", "--nodes", "x")
    assert usage.returncode == 2 and usage.stderr.count("\n") == 1 and "see `ugro launch --help`" in usage.stderr
    refused = ugro(ugro_script, server, "launch", "--name", "$(touch /tmp/ugro_client_pwned)", "--detach")
    assert refused.returncode == 3 and refused.stderr.count("\n") == 1 and "job name" in refused.stderr
    assert not Path("/tmp/ugro_client_pwned").exists() and not Job.objects.exists()
    high = ugro(ugro_script, server, "launch", "--name", "hi", "--priority", "90", "--detach")
    assert high.returncode == 4 and high.stderr == "ugro launch: priority 90 is out of range for dana: 0-50\n"
    denied = ugro(ugro_script, server, "status", token="ugro_deadbeef_nope")
    assert denied.returncode == 4 and denied.stderr == "ugro status: the API token is unknown or revoked\n"
    missing = ugro(ugro_script, server, "status", "ghost")
    assert missing.returncode == 3 and missing.stderr == "ugro status: no job named 'ghost'\n"
    down = ugro(ugro_script, {**server, "url": "http://127.0.0.1:9"}, "health")
    assert down.returncode == 5 and down.stderr.startswith("ugro health: cannot reach UGRO at http://127.0.0.1:9")
    no_token = ugro(ugro_script, server, "status", token=" ")
    assert no_token.returncode == 5 and "no API token: set UGRO_TOKEN or put one in" in no_token.stderr


def test_help_lists_ugros_commands_only_in_groups(ugro_script, server):
    out = ugro(ugro_script, server, "help").stdout
    assert [ln for ln in out.splitlines() if ln.endswith(":")] == ["Jobs:", "Cluster:", "Account:"]
    for name in ("launch", "status", "logs", "results", "cancel", "health", "queue", "resume"):
        assert f"\n  {name} " in out
    assert "migrate" not in out and "shell" not in out


def test_logs_follow_prints_each_line_once_until_the_job_ends(ugro_script, server, tmp_path):
    job = Job.objects.create(name="run1", script="t.py", owner=server["user"], state=Job.State.RUNNING,
                             started_at=timezone.now(), running_at=timezone.now())  # fmt: skip
    rank = Rank.objects.create(job=job, node=Node.objects.get(), index=0, state=Rank.State.RUNNING)

    def write(text: bytes) -> None:
        rank.local_log.parent.mkdir(parents=True, exist_ok=True)
        with open(rank.local_log, "ab") as fh:
            fh.write(text)
        Rank.objects.filter(pk=rank.pk).update(log_offset=rank.local_log.stat().st_size)

    write(b"first\n")
    path, site = ugro_script
    out_path = tmp_path / "follow.out"
    env = {**os.environ, "PYTHONPATH": str(site), "UGRO_URL": server["url"], "UGRO_TOKEN": server["token"]}
    with open(out_path, "w") as out:
        proc = subprocess.Popen([NO_DJANGO_PYTHON, str(path), "logs", "run1", "--follow"], env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_for(lambda: "first" in out_path.read_text(), timeout=20, what="the tail")
        write(b"second\n<b>third</b>\n")
        wait_for(lambda: "third" in out_path.read_text(), timeout=20, what="followed lines")
        Rank.objects.filter(pk=rank.pk).update(state=Rank.State.EXITED, exit_code=0)
        update_jobs(Job.objects.filter(pk=job.pk), state=Job.State.SUCCEEDED, finished_at=timezone.now())
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            time.sleep(0.1)
    assert out_path.read_text().splitlines() == [
        "[rank 0] first", "[rank 0] second", "[rank 0] <b>third</b>", "-- job run1 succeeded",
    ]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.no_test_worker
def test_ugro_launch_through_the_api_runs_every_rank_follows_to_the_end_and_cancels(
    ugro_script, lab, controller_env, live_server, tmp_path
):
    """The whole path: the client -> the API queues the job -> a real worker starts torchrun on two sshd
    nodes -> the client follows the merged log until the job succeeds.

    Covers: the `ugro` console script on real nodes: a launch through the API started by a real worker on two sshd
    nodes and followed to its end, and a running job cancelled through the API.
    """
    from accounts.models import AuditEvent

    from .conftest import FAST_TRAIN, SLOW_TRAIN, job_pids
    from .test_worker_restart_e2e import kill_worker, start_worker

    user = User.objects.create_user("erin")
    user.groups.add(Group.objects.get(name="launcher"))
    _, token = create_token(user, "e2e", "launch")
    where = {"url": live_server.url, "token": token}
    worker = start_worker(controller_env, tmp_path, "wapi")
    try:
        done = ugro(ugro_script, where, "launch", "--name", "viaapi", "--nodes", "2", "--", *FAST_TRAIN, timeout=240)
        # and a long job cancelled through the client: it returns once nothing of the job is left
        assert ugro(ugro_script, where, "launch", "--name", "long", "--nodes", "1", "--detach", "--", *SLOW_TRAIN,
                    timeout=60).returncode == 0  # fmt: skip
        wait_for(lambda: Job.objects.get(name="long").state == Job.State.RUNNING, timeout=90, what="long to run")
        tag = Job.objects.get(name="long").tag
        wait_for(lambda: len(job_pids(tag)) >= 2, timeout=30, what="long's processes")
        cancelled = ugro(ugro_script, where, "cancel", "long", timeout=120)
    finally:
        kill_worker(worker)
        # a killed worker's heartbeat would outlive it by up to 10 s: later tests must not hand starts to it
        from ugro_site.celery import HEARTBEAT_KEY, _redis

        _redis().delete(HEARTBEAT_KEY)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.strip() == "job long cancelled; no process of it remains on its nodes"
    assert job_pids(tag) == []
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("job viaapi queued (id ")
    assert lines[-1] == "-- job viaapi succeeded"
    assert {f"[rank {r}]" for r in range(2)} <= {ln[:8] for ln in lines}
    job = Job.objects.get(name="viaapi")
    assert job.state == Job.State.SUCCEEDED and job.owner == user and job.ranks.count() == 2
    assert AuditEvent.objects.get(action="launch", target="viaapi").argv == [job.script, *job.script_args]


def test_launch_follows_and_ctrl_c_leaves_the_job_queued_and_says_how_to_follow(ugro_script, server, tmp_path):
    import signal

    path, site = ugro_script
    env = {**os.environ, "PYTHONPATH": str(site), "UGRO_URL": server["url"], "UGRO_TOKEN": server["token"]}
    out_path = tmp_path / "launch.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen([NO_DJANGO_PYTHON, str(path), "launch", "--name", "waits", "--nodes", "1"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        # no worker runs in this test: the job waits in the queue while the client follows it
        wait_for(lambda: "] waits queued" in out_path.read_text(), timeout=20, what="following")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out_path.read_text()
    assert "left job waits to go on without this command. Follow it: ugro logs waits --follow;" in text
    assert "cancel it: ugro cancel waits" in text
    assert Job.objects.get(name="waits").state == Job.State.QUEUED
