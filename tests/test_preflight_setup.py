"""A node without its training env: pre-flight refuses the launch (PREFLIGHT) in one line naming the node, what is
missing and the command that fixes it; the demo node follows `bin/setup --node-env` without a restart."""

from __future__ import annotations

import importlib
import io
import shutil
import subprocess
import sys

import pytest
from django.apps import apps
from django.core.management import CommandError, call_command

from cluster.alerts import job_ended_alerts
from cluster.links import pool
from cluster.models import Alert, ClusterSettings, Node
from jobs import lifecycle
from jobs.failure import FailureKind
from jobs.launch import LaunchRequest, create_job, launch
from jobs.models import Job
from jobs.preflight import check_nodes, env_python, python_missing, tell_setup
from jobs.scheduler import place_queued

from .conftest import FAST_TRAIN, NODE_ENV, REPO, free_port, rendezvous_ports
from .jobrows import update_jobs

ENV_TORCHRUN = str(NODE_ENV / "bin" / "torchrun")


@pytest.fixture
def box(db, tmp_path):
    """A node on this machine (the local transport: a real agent, no sshd) with a script in its working directory,
    whose ranks see only an empty directory on their PATH; its links are closed after the test."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "train.py").write_text("print('trained')\n")
    node = Node.objects.create(
        name="box", address="127.0.0.1", transport="local", role="master", gpu_count=0, workdir=str(tmp_path),
        agent_python=sys.executable, torchrun_command=ENV_TORCHRUN, env={"PATH": str(tmp_path / "empty")},
    )  # fmt: skip
    ClusterSettings.objects.filter(pk=1).update(rendezvous_port=free_port(), default_script="train.py")
    yield node
    pool.close_all()


def checked(node: Node):
    return check_nodes([node], "train.py", "127.0.0.1", free_port())


@pytest.mark.parametrize(
    ("torchrun", "missing"),
    [
        ("/opt/nowhere/bin/torchrun", "/opt/nowhere/bin/torchrun is not an executable file on this node"),
        ("torchrun", "torchrun was not found on PATH on this node"),
        ("conda run -n train torchrun", "conda was not found on PATH on this node (the first word of its torchrun "
         "command 'conda run -n train torchrun')"),
    ],
    ids=["path", "name-on-path", "first-word"],
)  # fmt: skip
def test_a_missing_torchrun_is_one_line_naming_the_node_and_the_fix(box, torchrun, missing):
    # given a node whose torchrun command names a program its ranks would not find
    Node.objects.filter(pk=box.pk).update(torchrun_command=torchrun)
    box.refresh_from_db()
    # when pre-flight checks it
    report = checked(box)
    # then one line says so, with the fix for a node set up by hand, and nothing else is blamed on the env
    line = (f"box: cannot start torchrun: {missing}; set its Torchrun command in admin > Nodes or "
            "nodes.box.torchrun in cluster.yaml (then `ugro import_cluster`), or install torch in its env")  # fmt: skip
    assert report.problems == [line]
    assert report.setup == {"box": [line]}


def test_torchrun_is_looked_up_on_the_path_its_ranks_get(box):
    # given a bare torchrun, found only on the PATH the node's env gives its ranks
    Node.objects.filter(pk=box.pk).update(torchrun_command="torchrun", env={"PATH": f"{NODE_ENV}/bin:/usr/bin:/bin"})
    box.refresh_from_db()
    # when checked, then it passes (the versions are not read: no python is known next to a bare name)
    report = checked(box)
    assert report.ok, report.problems
    assert report.setup == {"box": []}


def test_preflight_command_shows_a_missing_python_as_a_refusal_with_the_fix(box):
    # given a node whose python (the one its agent runs with) does not exist
    Node.objects.filter(pk=box.pk).update(agent_python="/opt/nowhere/bin/python3")
    # when `ugro preflight` runs on it
    out = io.StringIO()
    with pytest.raises(CommandError, match="pre-flight failed on 1 node"):
        call_command("preflight", "--nodes", "box", stdout=out)
    # then one line names the node, the python and the fix: no link trace
    assert out.getvalue().splitlines() == [
        "box: its python /opt/nowhere/bin/python3 (UGRO's agent runs with it) is not there; set its Agent python in "
        "admin > Nodes or nodes.box.python in cluster.yaml (then `ugro import_cluster`) to any python >= 3.8 on it"
    ]


@pytest.mark.parametrize("shell", ["bash", "sh"])
def test_a_python_missing_behind_ssh_is_told_as_its_login_shell_says_it(shell):
    # given what the user's shell prints when sshd runs the agent's command with a python that is not there
    python = "/opt/nowhere/bin/python3"
    said = subprocess.run([shell, "-c", f"exec {python} -u -c pass"], capture_output=True, text=True).stderr
    node = Node(name="gpu1", agent_python=python)
    # then pre-flight reads it as the missing python (links.py puts the last stderr line in its error)
    assert python_missing(node, Exception(f"agent failed to start on gpu1 (u@10.0.0.2:22): {said.strip()}"))
    # and as zsh words it
    assert python_missing(node, Exception(f"agent failed to start on gpu1: zsh:1: no such file or directory: {python}"))
    # and not a node that cannot be reached
    assert python_missing(node, Exception("cannot reach gpu1 (u@10.0.0.2:22): [Errno 111] Connection refused")) is None


def test_a_launch_on_a_node_without_its_python_is_refused_not_lost(box, fast_settings):
    # given a queued job placed on a node whose python does not exist
    Node.objects.filter(pk=box.pk).update(agent_python="/opt/nowhere/bin/python3")
    job = create_job(LaunchRequest(name="nopython", script="train.py"))
    assert place_queued() == [job]
    job.refresh_from_db()
    # when the worker launches it
    launch(job)
    # then it fails as PREFLIGHT (not NODE_LOST, which would wait for the node to come back), naming the fix
    job.refresh_from_db()
    assert job.state == Job.State.FAILED and job.failure_kind == "PREFLIGHT", job.failure_reason
    assert "box: its python /opt/nowhere/bin/python3" in job.failure_reason
    assert job.failure_reason.endswith("Nothing was started.")
    alert = Alert.objects.get(key="preflight", resolved_at__isnull=True)
    assert alert.node_id == box.pk and "Agent python in admin > Nodes" in alert.message


def test_a_node_keeps_one_alert_for_what_it_lacks_until_it_is_checked_sound(box, tmp_path):
    other = Node.objects.create(name="far", address="10.0.0.9", transport="local", workdir=str(tmp_path))
    jobs = [Job.objects.create(name=n, script="train.py") for n in ("exp1", "exp2", "exp3")]
    # given two launches refused for box's missing torchrun, the second also on far
    tell_setup(jobs[0], [box], {"box": ["box: cannot start torchrun: ...; run bin/setup --node-env"]})
    tell_setup(jobs[1], [box, other], {"box": ["box: cannot start torchrun: ..."], "far": ["far: no python"]})
    # then each node has one open alert, the latest refusal in it
    open_ = Alert.objects.filter(key="preflight", resolved_at__isnull=True)
    assert sorted(a.node.name for a in open_) == ["box", "far"]
    assert open_.get(node=box).message.startswith("job exp2 was not started: box: cannot start torchrun")
    # when the next launch finds box sound and far unreachable (not checked)
    tell_setup(jobs[2], [box, other], {"box": []})
    # then box's alert is resolved and far's stays
    assert [a.node.name for a in Alert.objects.filter(key="preflight", resolved_at__isnull=True)] == ["far"]


def test_a_job_refused_by_preflight_leaves_no_alert_of_its_own(box):
    # given a job that pre-flight refused
    job = create_job(LaunchRequest(name="refused", script="train.py"))
    update_jobs(Job.objects.filter(pk=job.pk), state=Job.State.STARTING)
    job.refresh_from_db()
    assert lifecycle.fail_unstarted(job, FailureKind.PREFLIGHT, "pre-flight failed: box: no torchrun")
    job.refresh_from_db()
    # when its end is announced
    job_ended_alerts(job)
    # then how it ended is recorded (INFO, resolved) and no CRITICAL job alert stays open beside the node's
    assert not Alert.objects.filter(job_name="refused", resolved_at__isnull=True).exists()
    assert Alert.objects.get(key="job_finished:refused").severity == "info"


def test_the_demo_node_follows_bin_setup_and_a_torchrun_set_by_hand_is_kept(box, settings, tmp_path, monkeypatch):
    # given bin/start's demo node in a checkout with no node env and no torchrun on PATH
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    settings.BASE_DIR = tmp_path / "repo"
    settings.BASE_DIR.mkdir()
    Node.objects.all().delete()
    call_command("demo_node", stdout=io.StringIO())
    demo = Node.objects.get()
    assert (demo.torchrun_command, demo.torchrun_auto) == ("torchrun", "torchrun") and demo.follows_setup
    # when bin/setup --node-env makes the repo's env, then the next launch runs its torchrun (no restart)
    (settings.BASE_DIR / ".venv-node").symlink_to(NODE_ENV)
    venv_torchrun = str(settings.BASE_DIR / ".venv-node" / "bin" / "torchrun")
    assert demo.torchrun_argv == [venv_torchrun]
    # and bin/start, when it runs again, writes it down and says so
    out = io.StringIO()
    call_command("demo_node", stdout=out)
    demo.refresh_from_db()
    assert (demo.torchrun_command, demo.torchrun_auto) == (venv_torchrun, venv_torchrun)
    assert f"torchrun_command torchrun -> {venv_torchrun}" in out.getvalue()
    # but a torchrun the user set (admin, cluster.yaml) is theirs: kept while it exists
    Node.objects.update(torchrun_command=ENV_TORCHRUN)
    demo.refresh_from_db()
    assert not demo.follows_setup and demo.torchrun_argv == [ENV_TORCHRUN]
    call_command("demo_node", stdout=io.StringIO())
    demo.refresh_from_db()
    assert demo.torchrun_command == ENV_TORCHRUN


def test_demo_node_given_a_torchrun_does_not_follow(settings, db, tmp_path):
    settings.BASE_DIR = tmp_path
    call_command("demo_node", "--torchrun", ENV_TORCHRUN, stdout=io.StringIO())
    (tmp_path / ".venv-node").symlink_to(NODE_ENV)
    demo = Node.objects.get()
    assert demo.torchrun_auto == "" and demo.torchrun_argv == [ENV_TORCHRUN]


def test_preflight_refuses_the_demo_node_with_bin_setup_then_passes_once_it_ran(box, settings, tmp_path, monkeypatch):
    # given the demo node as bin/start makes it with no torchrun anywhere (its ranks' PATH: the agent's own)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    settings.BASE_DIR = tmp_path
    Node.objects.filter(pk=box.pk).update(torchrun_command="torchrun", torchrun_auto="torchrun", env={})
    box.refresh_from_db()
    # when pre-flight checks it, then the fix is bin/setup
    assert checked(box).problems == [
        "box: cannot start torchrun: torchrun was not found on PATH on this node; "
        "run bin/setup --node-env (it makes .venv-node, the training env this node then uses)"
    ]
    # when bin/setup --node-env made the env, then the next pre-flight passes, reads that env's torch, and the node
    # shows the torchrun it now runs
    (tmp_path / ".venv-node").symlink_to(NODE_ENV)
    report = checked(box)
    assert report.ok, report.problems
    assert report.versions["box"]["torch"].startswith("2.")
    box.refresh_from_db()
    assert box.torchrun_command == box.torchrun_auto == str(tmp_path / ".venv-node" / "bin" / "torchrun")


def test_migration_makes_an_existing_demo_node_with_a_detected_torchrun_follow(db, settings):
    # given demo nodes made before the field: one with the bare fallback, one set by the user
    migration = importlib.import_module("cluster.migrations.0008_node_torchrun_auto")
    Node.objects.create(name="local", transport="local", address="127.0.0.1", torchrun_command="torchrun")
    Node.objects.create(name="other", transport="local", address="127.0.0.1", torchrun_command="torchrun")
    # when the migration's data step runs
    migration.demo_nodes_follow_setup(apps, None)
    # then only the demo node follows
    assert dict(Node.objects.values_list("name", "torchrun_auto")) == {"local": "torchrun", "other": ""}


@pytest.mark.e2e
def test_demo_node_without_torchrun_is_refused_then_follows_setup(test_worker, fast_settings, tmp_path, monkeypatch):
    """The one real path from a missing torchrun to a launch that runs once the node env exists: the demo node as
    bin/start makes it, a real agent on the local transport, real torchrun (no faster test launches for real).

    Covers: bin/start's demo node refused by pre-flight while no torchrun exists, then a real launch on it once
    .venv-node does (the local transport: the agent a local process, no sshd), its alert resolved, and the reading
    commands (status, logs, results, queue, export_cluster) on that real job.
    """
    # given a fresh checkout where no torchrun exists yet, and bin/start's demo node for it
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "train", repo / "train")
    fast_settings.BASE_DIR = repo
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    call_command("demo_node", stdout=io.StringIO())
    Node.objects.update(gpu_count=0)  # whatever this machine has: the job trains on CPU
    cs = ClusterSettings.load()
    cs.rendezvous_port = rendezvous_ports()  # c10d's store listens on every address: not another run's 29500
    cs.save()
    # when the first job is launched
    with pytest.raises(CommandError, match="pre-flight failed"):
        call_command("launch", "--name", "exp1", "--nodes", "1", "--", *FAST_TRAIN, stdout=io.StringIO())
    # then pre-flight refused it, naming the node, what is missing and the fix, and nothing started
    job = Job.objects.get(name="exp1")
    assert job.failure_kind == "PREFLIGHT", job.failure_reason
    assert "local: cannot start torchrun: torchrun was not found on PATH on this node; run bin/setup --node-env" in (
        job.failure_reason
    )
    assert not job.ranks.exclude(state="pending").exists()
    # and the one alert left open is the node's, saying the same (not a CRITICAL one per refused job)
    open_alerts = list(Alert.objects.filter(resolved_at__isnull=True))
    assert [(a.node.name, a.key, a.severity) for a in open_alerts] == [("local", "preflight", "warning")]
    assert "run bin/setup --node-env" in open_alerts[0].message

    # when bin/setup --node-env has made the repo's node env, and the job is launched again (no restart)
    (repo / ".venv-node").symlink_to(NODE_ENV)
    out = io.StringIO()
    call_command("launch", "--name", "exp1", "--nodes", "1", "--", *FAST_TRAIN, stdout=out)
    # then it ran with that env's torchrun, which the node now shows, and the node's alert is resolved
    job = Job.objects.get(name="exp1")
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    assert '[rank 0] {"step": 2' in out.getvalue()
    node = Node.objects.get()
    assert node.torchrun_command == str(repo / ".venv-node" / "bin" / "torchrun")
    assert not Alert.objects.filter(resolved_at__isnull=True, severity__in=["warning", "critical"]).exists()
    assert b"training complete" in job.ranks.get().local_log.read_bytes()

    # and the reading commands show what happened on that real job
    def run(*args: str) -> str:
        buf = io.StringIO()
        call_command(*args, stdout=buf)
        return buf.getvalue()

    assert "exp1" in run("status") and "succeeded" in run("status")
    detail = run("status", "exp1")
    assert "rank 0 on local" in detail and "exit      0" in detail
    assert run("logs", "exp1").splitlines()[0].startswith("[rank 0] ")
    only = run("logs", "exp1", "--rank", "0", "--tail", "2")
    assert only.splitlines()[-1].startswith("training complete") and len(only.splitlines()) == 2, only
    results = run("results", "exp1")
    assert "(last loss logged by rank 0)" in results
    assert "checkpoints: 2" in results and "checkpoint_step12.pt" in results
    assert run("queue").strip() == "queue is empty"
    assert "local:" in run("export_cluster")


def test_env_python_is_found_next_to_torchrun_only():
    assert env_python(Node(torchrun_command="/opt/venv/bin/torchrun")) == "/opt/venv/bin/python"
    assert env_python(Node(torchrun_command="pixi run -e cuda torchrun")) is None
    assert env_python(Node(torchrun_command="torchrun")) is None
