"""What the script is given: only the user's arguments and the cluster's configured defaults, and
`launch --dry-run` (and the form's "Show commands") printing each rank's exact command line."""

from __future__ import annotations

import io
import shlex

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command
from django.test import Client

from cluster.models import ClusterSettings
from jobs.launch import LaunchError, LaunchRequest, create_job, render_args
from jobs.models import Job
from metrics.models import JobMetrics

from .conftest import two_launch_nodes


@pytest.fixture
def nodes(db):
    return two_launch_nodes()


def launcher(name: str) -> User:
    user = User.objects.create_user(name, password="pw-alice-123")
    user.groups.add(Group.objects.get(name="launcher"))
    return user


def dry(*args: str) -> str:
    out = io.StringIO()
    call_command("launch", "--dry-run", *args, stdout=out)
    return out.getvalue()


def test_nothing_is_appended_when_the_user_gave_nothing_and_the_cluster_configured_nothing(nodes):
    # given a cluster with no training defaults; when a job is launched with only its own arguments
    job = create_job(LaunchRequest(name="plain", extra_args=["--max-steps", "5"]))
    # then the script gets exactly those
    assert job.script_args == ["--max-steps", "5"]
    assert job.params == {"model": None, "dataset": None, "epochs": None, "lr": None, "extra": ["--max-steps", "5"]}


def test_configured_defaults_and_given_values_are_passed_and_nothing_else(nodes):
    # given a cluster whose cluster.yaml sets a default model (no dataset)
    cs = ClusterSettings.load()
    cs.training = {"default_model": "tiny"}
    cs.save()
    # when the user gives a learning rate only
    job = create_job(LaunchRequest(name="some", lr=0.01))
    # then the script gets the configured model and the given rate; no dataset, epochs or job id
    assert job.script_args == ["--model-name", "tiny", "--learning-rate", "0.01"]


def test_a_cluster_template_leaves_out_what_has_no_value():
    template = ["--lr={lr}", "--epochs", "{epochs}", "--name", "{job}", "--fixed", "--out", "runs/{job}/{model}"]
    values = {"lr": None, "epochs": None, "job": "exp", "model": None}
    assert render_args(template, values) == ["--name", "exp", "--fixed"]
    assert render_args(["--x", "{dataset}"], {"dataset": "{model}"}) == ["--x", "{model}"]


def test_dry_run_prints_each_ranks_exact_command_and_creates_nothing(nodes):
    # when a launch is dry-run
    out = dry("--name", "exp1", "--nodes", "2", "--", "--max-steps", "5", "--note", "a b;c")
    # then no job exists, and each rank's command line is what launch would run, quoted for a shell
    assert not Job.objects.exists()
    lines = out.splitlines()
    assert lines[0] == "dry run of job exp1: nothing was created or started"
    assert lines[1] == "rank 0 on gpu0 (127.0.0.2, GPUs 0), in /srv/w0:"
    argv = shlex.split(lines[2])
    tag = argv[argv.index("--rdzv-backend=c10d") + 2].removeprefix("--rdzv-id=")
    assert argv == [
        "/opt/venv/bin/torchrun", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.2:29500", f"--rdzv-id={tag}", "--rdzv-conf=join_timeout=30",
        "--local-addr=127.0.0.2", "--max-restarts=0", "/srv/w0/train/train_production.py",
        "--max-steps", "5", "--note", "a b;c",
    ]  # fmt: skip
    assert tag.startswith("exp1-")
    assert "UGRO_NODE_RANK=0" in lines[3] and f"UGRO_JOB={tag}" in lines[3]
    assert "CUDA_VISIBLE_DEVICES=0" in lines[3].split()
    assert lines[4] == "rank 1 on gpu1 (127.0.0.3, GPUs 0), in /srv/w1:"
    assert "--local-addr=127.0.0.3" in shlex.split(lines[5])


def test_the_job_and_its_directory_reach_the_script_after_the_double_dash_too(nodes):
    # when a script opts into the convention with {job} and {job_dir} in its own arguments
    out = dry("--name", "exp2", "--nodes", "2", "--", "--output_dir", "{job_dir}", "--run-name", "{job}-a")
    lines = out.splitlines()
    # then each rank gets its node's directory for the job, in its arguments and as UGRO_JOB_DIR
    assert shlex.split(lines[2])[-4:] == ["--output_dir", "/srv/w0/outputs/exp2", "--run-name", "exp2-a"]
    assert "UGRO_JOB_DIR=/srv/w0/outputs/exp2" in shlex.split(lines[3])
    assert shlex.split(lines[5])[-4:] == ["--output_dir", "/srv/w1/outputs/exp2", "--run-name", "exp2-a"]
    assert "UGRO_JOB_DIR=/srv/w1/outputs/exp2" in shlex.split(lines[6])


def test_dry_run_refuses_a_bad_request_in_one_line(nodes):
    with pytest.raises(CommandError, match=r"^the metrics pattern is not a valid regular expression: .*"):
        dry("--name", "bad", "--metrics-pattern", "loss=(")
    with pytest.raises(CommandError, match="asked for 3 nodes"):
        dry("--name", "bad", "--nodes", "3")


def test_metrics_pattern_and_files_are_kept_with_the_job_and_relaunched(nodes):
    # given a job launched with a metrics pattern and files
    req = LaunchRequest(name="m1", metrics_pattern=r"^epoch \d+", metrics_files=["lightning_logs", "runs/{job}"])
    job = create_job(req)
    settings = JobMetrics.objects.get(job=job)
    assert (settings.pattern, settings.files) == (r"^epoch \d+", ["lightning_logs", "runs/{job}"])
    # when it is relaunched from its page, the copy reads its metrics the same way
    client = Client()
    client.force_login(launcher("alice"))
    client.post(f"/jobs/{job.pk}/relaunch/")
    copy = JobMetrics.objects.get(job__name="m1-r1")
    assert (copy.pattern, copy.files) == (settings.pattern, settings.files)
    with pytest.raises(LaunchError, match="contains a NUL byte or a line break"):
        create_job(LaunchRequest(name="m2", metrics_files=["a\nb"]))


def test_launch_form_shows_the_commands_without_queuing(nodes):
    client = Client()
    client.force_login(launcher("alice"))
    response = client.post(
        "/jobs/launch/",
        {"name": "web-dry", "nodes": ["gpu0"], "extra_args": "--max-steps 40", "dry_run": "1", "priority": "0"},
    )
    html = response.content.decode()
    assert response.status_code == 200 and not Job.objects.exists()
    assert "What each rank would run" in html
    assert "--max-restarts=0 /srv/w0/train/train_production.py --max-steps 40\n" in html


def test_the_clusters_default_sync_directory_is_used_unless_a_launch_says_none(nodes, tmp_path):
    from cluster.models import ClusterSettings

    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text("print(1)\n")
    cs = ClusterSettings.load()
    cs.training = {"sync": str(project)}
    cs.paths = {"sync_roots": [str(tmp_path)]}
    cs.save()
    # a launch with no --sync starts its ranks in the job's copy of the cluster's directory
    lines = dry("--name", "exp3", "--nodes", "2", "--script", "train.py").splitlines()
    assert lines[1] == "rank 0 on gpu0 (127.0.0.2, GPUs 0), in /srv/w0/outputs/exp3/code:"
    assert "/srv/w0/outputs/exp3/code/train.py" in shlex.split(lines[2])
    # and `--sync none` runs it from each node's workdir
    lines = dry("--name", "exp4", "--nodes", "2", "--script", "train.py", "--sync", "none").splitlines()
    assert lines[1] == "rank 0 on gpu0 (127.0.0.2, GPUs 0), in /srv/w0:" and "/srv/w0/train.py" in lines[2]
    # a default outside the sync roots is refused in one line, naming where it may be
    cs.paths = {"sync_roots": [str(tmp_path / "elsewhere")]}
    cs.save()
    with pytest.raises(CommandError, match=r"^--sync .*proj: outside the directories UGRO may sync \("):
        dry("--name", "exp5", "--nodes", "2", "--script", "train.py")
    assert not Job.objects.exists()
