"""The lifecycle on real sshd nodes and real torchrun: no job wedged, no node held, every failure explained."""

from __future__ import annotations

import getpass
import io
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from jobs.models import Job, Rank
from jobs.reconcile import reconcile
from metrics.models import MetricPoint

from .conftest import REPO, SLOW_TRAIN, job_pids, ranks_logged, wait_for
from .loopback import on_node

pytestmark = pytest.mark.e2e
SCRIPTS = REPO / "tests" / "data" / "scripts"


@pytest.fixture
def scripts(lab):
    """The test scripts in every node's working directory, as scripts/<name>.py."""
    for node in lab.nodes:
        shutil.copytree(SCRIPTS, node.workdir / "scripts", dirs_exist_ok=True)
    return lab


def run(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def pids_on(tag: str, node: str) -> list[int]:
    return on_node(job_pids(tag), node)


def test_detach_then_logs_follow_frees_the_nodes_every_time(scripts):
    """Covers: `launch --detach` then `logs --follow`, twice over on two sshd nodes: logs returns once the job
    ended with every line and the nodes free, and the next launch starts at once.
    """
    # given the worker; when a job is launched detached and followed with logs --follow, a few times over
    for i in range(2):
        t0 = time.monotonic()
        run("launch", "--name", f"d{i}", "--nodes", "2", "--script", "scripts/quick.py", "--detach")
        t1 = time.monotonic()
        out = run("logs", f"d{i}", "--follow")
        print(f"d{i}: launch {t1 - t0:.1f} s, logs --follow {time.monotonic() - t1:.1f} s")
        job = Job.objects.get(name=f"d{i}")
        # then by the time logs returns the job ended, copied every line and holds no node
        assert job.state == Job.State.SUCCEEDED, job.failure_reason
        assert f"-- job d{i} succeeded" in out and out.count('"loss"') == 6
        assert not Rank.objects.filter(active=True).exists()
        last_exit = max(r.ended_at for r in job.ranks.all())
        assert (job.finished_at - last_exit).total_seconds() < 5
    # and the next launch starts at once
    run("launch", "--name", "after", "--nodes", "2", "--script", "scripts/quick.py")
    assert Job.objects.get(name="after").state == Job.State.SUCCEEDED


def test_an_attached_launch_whose_ranks_ignore_sigterm_returns_after_its_nodes_are_free(scripts):
    """Covers: an attached launch whose real ranks ignore SIGTERM: it returns only once every process was killed and
    every node released.
    """
    # given ranks that ignore SIGTERM, one of which fails; when launched attached
    with pytest.raises(CommandError, match="job stubborn failed"):
        run("launch", "--name", "stubborn", "--nodes", "2", "--script", "scripts/stubborn.py", "--", "1")
    job = Job.objects.get(name="stubborn")
    # then the command returned only after every process was killed and every node released
    assert job.state == Job.State.FAILED
    assert job.failure_rank == 1 and job.failure_node == "node2"
    assert job_pids(job.tag) == []
    assert not Rank.objects.filter(job=job, active=True).exists()


def test_an_oom_on_the_last_rank_is_explained_everywhere(scripts, client, django_user_model):
    """Covers: a real rank exiting on a CUDA OOM: the command's one line, status, the job page and the alert all name
    it; the explanation's rules run on recorded output in tests/test_failure.py.
    """
    from cluster.models import Alert

    # given a job whose last rank runs out of CUDA memory and exits 3
    with pytest.raises(CommandError) as err:
        run("launch", "--name", "oom", "--nodes", "2", "--script", "scripts/oom.py", "--", "1")
    job = Job.objects.get(name="oom")
    # then the one-line error, the job's record, status, the page and the alert all say what happened
    line = str(err.value)
    assert "\n" not in line
    for text in (line, job.failure_reason):
        assert "OOM" in text and "rank 1" in text and "exit code 3" in text and "CUDA out of memory" in text
    assert (job.failure_kind, job.failure_rank, job.failure_exit_code) == ("OOM", 1, 3)
    assert "CUDA out of memory. Tried to allocate 2.00 GiB" in job.failure_line
    with pytest.raises(CommandError, match="OOM"):
        run("status", "oom")
    client.force_login(django_user_model.objects.create_superuser("admin", password="x" * 12))
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "OOM" in page and "CUDA out of memory" in page and "exit code 3" in page
    # the alert is opened after the final state commits (by the teardown's thread here): wait for it
    wait_for(lambda: Alert.objects.filter(key="job_failed:oom", resolved_at__isnull=True).exists(), timeout=10,
             what="the job's failure alert")  # fmt: skip
    alert = Alert.objects.get(key="job_failed:oom", resolved_at__isnull=True)
    assert (
        alert.severity == Alert.Severity.CRITICAL
        and alert.node.name == "node2"
        and "CUDA out of memory" in alert.message
    )
    assert job_pids(job.tag) == []


@pytest.mark.no_test_worker
def test_with_no_worker_commands_refuse_in_one_line_and_change_nothing(scripts):
    """Covers: commands refusing when no worker heartbeat is in Redis, the dry run still working; no node is asked (a
    fast test could hold it).
    """
    # given no worker running
    # when a job is launched, attached or detached, or a sweep started: one line, and nothing is recorded
    for args in (["launch", "--name", "nw"], ["launch", "--name", "nw", "--detach"],
                 ["sweep", "nws", "--grid", "lr=0.1,0.2"]):  # fmt: skip
        with pytest.raises(CommandError) as err:
            run(*args, "--script", "scripts/quick.py")
        assert str(err.value) == "no UGRO worker is running: start it with bin/start"
    assert not Job.objects.exists()
    # a queued job can still be cancelled (nothing of it runs), and a dry run still shows the commands
    from django.contrib.auth import get_user_model

    from accounts import actions
    from jobs.launch import LaunchRequest

    me = get_user_model().objects.get(username=getpass.getuser())
    actions.launch(me, LaunchRequest(name="waiting", count=2, script="scripts/quick.py"), "cli")
    assert "cancelled" in run("cancel", "waiting")
    with pytest.raises(CommandError, match="^no UGRO worker is running: start it with bin/start$"):
        run("resume", "waiting")
    assert Job.objects.get(name="waiting").attempt == 1
    assert "torchrun" in run("launch", "--name", "dry", "--dry-run", "--script", "scripts/quick.py")


@pytest.mark.no_test_worker
def test_a_worker_killed_between_start_and_running_leaves_a_job_the_reconciler_finishes(
    scripts, controller_env, fast_settings, monkeypatch
):
    """Covers: a worker process SIGKILLed right after starting ranks on three nodes, before RUNNING: the reconciler ends
    the job as a timeout and kills its orphaned ranks.
    """
    from django.contrib.auth import get_user_model

    from accounts import actions
    from jobs.launch import LaunchRequest

    # given a queued job, and a worker that dies (SIGKILL) right after its ranks started, before it is RUNNING
    me = get_user_model().objects.get(username=getpass.getuser())
    actions.launch(me, LaunchRequest(name="crash", count=3, extra_args=list(SLOW_TRAIN)), "cli")
    code = (
        "import os, signal, django; django.setup()\n"
        "from jobs import lifecycle\n"
        "lifecycle.ranks_started = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
        "from jobs.tasks import schedule_jobs\n"
        "schedule_jobs()\n"
    )
    env = {**controller_env, "DJANGO_SETTINGS_MODULE": "ugro_site.settings"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    job = Job.objects.get(name="crash")
    assert job.state == Job.State.STARTING
    wait_for(lambda: len(job_pids(job.tag)) >= 6, timeout=30, what="the orphaned ranks to run")
    # when its STARTING window has passed and the reconciler runs
    monkeypatch.setattr("jobs.lifecycle.STARTING_GRACE_S", 1.0)
    monkeypatch.setattr("jobs.lifecycle.STOPPING_RETRY_S", 1.0)
    Job.objects.filter(pk=job.pk).update(sync_window_s=1.0)
    time.sleep(2.1)

    def finished() -> bool:
        reconcile([job.pk], orphans=False)
        return Job.objects.get(pk=job.pk).is_ended

    wait_for(finished, timeout=60, what="the reconciler to finish the job")
    job.refresh_from_db()
    # then the job failed as a timeout, nothing of it is left, and its nodes are free
    assert job.state == Job.State.FAILED and job.failure_kind == "TIMEOUT"
    assert job_pids(job.tag) == []
    assert not Rank.objects.filter(job=job, active=True).exists()


def test_a_node_cut_off_mid_run_fails_the_job_and_its_output_is_complete_once_it_is_back(scripts, fast_settings):
    """Covers: a node's sshd stopped mid-run (its sessions cut), then back: NODE_LOST naming rank, node and the link's
    own error, the ranks on the reachable nodes stopped, then the reconciler kills what still runs there and the
    follower fetches the rest of its logs byte for byte.
    """
    from jobs.follow import follow

    run("launch", "--name", "cutoff", "--node", "node1", "--node", "node2", "--detach", "--", *SLOW_TRAIN)
    job = Job.objects.get(name="cutoff")
    wait_for(lambda: follow(1.0, job_ids=[job.pk]) or ranks_logged(job, 3), timeout=90,
             what="every rank to print")  # fmt: skip
    node2 = scripts.nodes[1]
    try:
        # when node2 drops off the network mid-run (its rank keeps running, unreachable)
        node2.stop()
        wait_for(lambda: follow(2.0, job_ids=[job.pk]) or Job.objects.get(pk=job.pk).is_ended, timeout=90,
                 what="the job to end")  # fmt: skip
        job.refresh_from_db()
        # then the job fails naming the node, and the nodes UGRO could reach are clean
        assert job.state == Job.State.FAILED and job.failure_kind == "NODE_LOST" and job.failure_node == "node2"
        assert job.failure_rank == 1 and "node node2 stopped answering: " in job.failure_reason
        assert "no contact" not in job.failure_reason  # the link's own error says why
        assert pids_on(job.tag, "node1") == []
    finally:
        node2.start()

    # when it is back, the reconciler kills what still runs there and fetches the rest of its output
    def recovered() -> bool:
        reconcile()
        follow(1.0, job_ids=[job.pk])
        return not job.ranks.filter(drained=False).exists()

    wait_for(recovered, timeout=60, what="node2's output to be recovered")
    assert job_pids(job.tag) == []
    # and every central log is byte for byte the node's, metrics.jsonl matches the database
    for r in job.ranks.all():
        assert r.local_log.read_bytes() == Path(r.remote_log).read_bytes(), f"rank {r.index}"
    lines = (job.job_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == MetricPoint.objects.filter(job=job).count() > 0
