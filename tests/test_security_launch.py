"""Issue 10's launch findings: the script that is checked is the script that runs, only inside the
allowed script roots; every number a launch takes is bounded, with a one-line error and never a 500."""

from __future__ import annotations

import io

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command
from django.test import Client

from cluster.models import ClusterSettings
from jobs.launch import (
    PRIORITY_MAX,
    LaunchError,
    LaunchRequest,
    build_job,
    create_job,
    rank_command,
)
from jobs.models import Job, Rank
from jobs.preflight import script_path

from .conftest import two_launch_nodes

INJECTION = '-cimport os;os.system("id")#/../../../../etc/passwd'


@pytest.fixture
def nodes(db):
    return two_launch_nodes(paths={"scripts": "~/ai-cluster/scripts"})


@pytest.mark.parametrize(
    "script, why",
    [
        (INJECTION, "starts with '-'"),
        ("-m http.server", "starts with '-'"),
        ("train/../../../etc/passwd", "contains '..'"),
        ("../outside.py", "contains '..'"),
        ("/etc/passwd", "outside the allowed script roots"),
        ("/srv/w0-evil/x.py", "outside the allowed script roots"),
        ("~/elsewhere/x.py", "outside the allowed script roots"),
    ],
)
def test_a_script_that_is_an_option_climbs_out_or_lies_outside_the_roots_is_refused(nodes, script, why):
    # when a launch names such a script, then it is refused with one line and nothing is created
    with pytest.raises(LaunchError, match=why) as info:
        create_job(LaunchRequest(name="evil", script=script))
    assert "\n" not in str(info.value)
    assert not Job.objects.exists()


def test_the_cli_refuses_the_injection_before_anything_reaches_a_node(nodes):
    with pytest.raises(CommandError, match="starts with '-'"):
        call_command("launch", "--name", "evil", "--script", INJECTION, "--detach", stdout=io.StringIO())
    assert not Job.objects.exists()


def test_the_launch_form_refuses_the_injection_with_one_line(nodes):
    user = User.objects.create_user("alice", password="pw-alice-123456")
    user.groups.add(Group.objects.get(name="launcher"))  # she may launch: the form's checks answer
    client = Client()
    client.force_login(user)
    resp = client.post("/jobs/launch/", {"name": "evil", "script": INJECTION, "count": "1"})
    assert resp.status_code == 200
    assert b"starts with &#x27;-&#x27;" in resp.content
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    "script", ["train/train_production.py", "./train/x.py", "/srv/w0/train/x.py", "~/ai-cluster/scripts/t.py"]
)
def test_scripts_in_the_workdir_or_the_scripts_directory_are_allowed(nodes, script):
    job, _, _ = build_job(LaunchRequest(name="ok", script=script, nodes=["gpu0"]))
    assert ".." not in job.script and not job.script.startswith("-")


def test_an_absolute_path_must_be_inside_a_root_on_every_node_the_job_may_use(nodes):
    # /srv/w0 is gpu0's workdir only: fine when the job is pinned to gpu0, refused when gpu1 may run it
    build_job(LaunchRequest(name="one", script="/srv/w0/x.py", nodes=["gpu0"]))
    with pytest.raises(LaunchError, match="/srv/w0/x.py on gpu1 is outside"):
        build_job(LaunchRequest(name="two", script="/srv/w0/x.py"))


def test_configured_script_roots_replace_the_default(nodes):
    cs = ClusterSettings.load()
    cs.script_roots = ["/opt/approved"]
    cs.save()
    build_job(LaunchRequest(name="a", script="/opt/approved/train.py"))
    with pytest.raises(LaunchError, match=r"allowed script roots \(/opt/approved\)"):
        build_job(LaunchRequest(name="b", script="train/train_production.py"))
    cs.script_roots = ["{workdir}/train"]
    cs.save()
    build_job(LaunchRequest(name="c", script="train/train_production.py"))
    with pytest.raises(LaunchError, match="outside"):
        build_job(LaunchRequest(name="d", script="other.py"))


def test_the_path_in_the_rank_command_is_the_path_preflight_checks(nodes):
    job = create_job(LaunchRequest(name="same", script="./train//train_production.py", nodes=["gpu1"]))
    job.current.tag, job.current.rdzv_endpoint = "same-1", "127.0.0.3:29500"
    rank = Rank(job=job, attempt=job.current, node=nodes[1], index=0)
    argv = rank_command(job, rank, 1, job.rdzv_endpoint)
    checked = script_path(nodes[1], job.script)
    assert checked == "/srv/w1/train/train_production.py"
    assert argv[argv.index("--max-restarts=0") + 1] == checked


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("priority", 10**22, "priority must be a whole number from 0 to 100"),
        ("priority", PRIORITY_MAX + 1, "priority must be"),
        ("priority", -1, "priority must be"),
        ("count", 10**22, "node count must be"),
        ("epochs", 10**22, "epochs must be"),
        ("epochs", 0, "epochs must be"),
        ("nproc_per_node", 10**22, "nproc-per-node must be"),
        ("lr", float("inf"), "learning rate must be"),
        ("lr", 1e300, "learning rate must be"),
        ("lr", -0.1, "learning rate must be"),
    ],
)
def test_every_number_of_a_launch_request_is_bounded(nodes, field, value, message):
    with pytest.raises(LaunchError, match=message) as info:
        create_job(LaunchRequest(name="big", **{field: value}))
    assert "\n" not in str(info.value)
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    "option, value",
    [("--priority", "10000000000000000000000"), ("--epochs", "10000000000000000000000"), ("--nodes", "99999"),
     ("--lr", "nan"), ("--nproc-per-node", "65")],
)  # fmt: skip
def test_the_cli_gives_one_line_for_an_out_of_range_number(nodes, option, value):
    with pytest.raises(CommandError) as info:
        call_command("launch", "--name", "big", option, value, "--detach", stdout=io.StringIO())
    assert "\n" not in str(info.value) and "must be" in str(info.value)
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    "field, value",
    [("priority", "10000000000000000000000"), ("priority", "101"), ("epochs", "10000000000000000000000"),
     ("count", "10000000000000000000000"), ("nproc_per_node", "10000000000000000000000"), ("lr", "1e999")],
)  # fmt: skip
def test_the_launch_form_answers_a_huge_number_with_a_field_error_not_a_500(nodes, field, value):
    user = User.objects.create_user("alice", password="pw-alice-123456")
    user.groups.add(Group.objects.get(name="launcher"))  # she may launch: the form's checks answer
    client = Client()
    client.force_login(user)
    resp = client.post("/jobs/launch/", {"name": "big", field: value})
    assert resp.status_code == 200
    assert b"has-error" in resp.content or b"launch-error" in resp.content
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    "url",
    ["/api/jobs/{pk}/logs?rank=10000000000000000000000", "/api/jobs/{pk}/logs?tail=10000000000000000000000",
     "/compare/?jobs=10000000000000000000000", "/jobs/10000000000000000000000/",
     "/api/jobs/{pk}/series?rank=10000000000000000000000", "/api/jobs/10000000000000000000000/logs",
     "/api/jobs/{pk}/panels?rank=10000000000000000000000&name=loss"],
)  # fmt: skip
def test_huge_integers_in_query_strings_are_not_a_500(nodes, url):
    job = Job.objects.create(name="q", script="s.py")
    user = User.objects.create_user("alice", password="pw-alice-123456")
    client = Client()
    client.force_login(user)
    resp = client.get(url.format(pk=job.pk))
    assert resp.status_code in (200, 400, 404)


@pytest.mark.parametrize("command", [["launch", "--name", "evil", "--dry-run"], ["preflight"]])
def test_dry_run_and_preflight_refuse_the_injection_too(nodes, command):
    with pytest.raises(CommandError, match="starts with '-'"):
        call_command(*command, "--script", INJECTION, stdout=io.StringIO())
    assert not Job.objects.exists()
