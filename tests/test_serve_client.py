"""`ugro serve` (the thin client) through the REST API, /api/v1/services/: start, list, refuse, stop."""

from __future__ import annotations

import subprocess

import pytest

from accounts.tokens import create_token
from cluster.models import Node
from jobs.models import Checkpoint, Job
from serving.models import Service
from serving.replicas import tend

from .conftest import wait_for
from .test_client import NO_DJANGO_PYTHON, server, ugro, ugro_script  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)
COMMAND = "{python} engine.py --port {port}"


@pytest.fixture
def trained(server):  # noqa: F811
    job = Job.objects.create(name="trained", script="train.py", state=Job.State.SUCCEEDED)
    Checkpoint.objects.create(job=job, node=Node.objects.get(name="n1"), path="/w/outputs/trained/checkpoint-10",
                              size=1, mtime=0, step=10, kind=Checkpoint.Kind.DIR, ready=True)  # fmt: skip
    return job


def test_serve_starts_lists_refuses_and_stops(ugro_script, server, trained, worker_heartbeat):  # noqa: F811
    # when a service is asked for
    done = ugro(ugro_script, server, "serve", "chat", "--from", "trained:10", "--engine", "custom",
                "--command", COMMAND)  # fmt: skip

    # then it is recorded for the worker, and the list shows it
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("service chat: 1 replica(s) of custom serving n1:/w/outputs/trained/checkpoint-10")
    assert Service.objects.get(name="chat").owner == server["user"]
    listed = ugro(ugro_script, server, "serve", "--list").stdout
    assert "chat  running  custom  from trained step 10  /serve/chat/v1/" in listed and "replica 0  pending" in listed

    # bad input and a token that may only call services are refused in one line, nothing written
    for args, why in [(("chat2", "--from", "nosuch"), "no job named 'nosuch'"),
                      (("chat", "--from", "trained"), "service chat already serves trained step 10"),
                      (("chat", "--from", "trained", "--replicas", "2"), "--replicas need a new service"),
                      (("chat2", "--from", "trained", "--min-replicas", "3", "--max-replicas", "2"),
                       "--min-replicas 3 is above --max-replicas 2"),
                      (("chat2", "--from", "trained", "--min-replicas", "0", "--idle-after", "30s"),
                       "--idle-after must be at least 1m, not 30s")]:  # fmt: skip
        refused = ugro(ugro_script, server, "serve", *args)
        assert refused.returncode != 0 and why in refused.stderr and refused.stderr.count("\n") == 1, refused.stderr
    infer = create_token(server["user"], "app", "infer")[1]
    refused = ugro(ugro_script, server, "serve", "chat3", "--from", "trained", token=infer)
    assert refused.returncode != 0 and "scope is infer" in refused.stderr
    assert Service.objects.count() == 1

    # when it is stopped (the worker's pass run here)
    path, site = ugro_script
    env = {"PYTHONPATH": str(site), "UGRO_URL": server["url"], "UGRO_TOKEN": server["token"], "HOME": "/nonexistent"}
    stop = subprocess.Popen([NO_DJANGO_PYTHON, str(path), "serve", "chat", "--stop"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    wait_for(lambda: Service.objects.filter(name="chat", state="stopping").exists(), timeout=30, what="stopping")
    tend()
    out, err = stop.communicate(timeout=30)

    # then it says so
    assert stop.returncode == 0, err
    assert out.startswith("service chat stopped")


def test_serve_f_the_server_reads_the_file_the_flags_win(ugro_script, server, trained, worker_heartbeat, tmp_path):  # noqa: F811
    # given a service file that sleeps when idle, and one with a key misspelt
    path = tmp_path / "chat.yaml"
    path.write_text("name: chat\nfrom: trained:10\nengine: custom\ncommand: '{python} engine.py --port {port}'\n"
                    "min-replicas: 0\nmax-replicas: 2\nreplicas: 0\nidle-after: 15m\n")  # fmt: skip
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: chat\nfrom: trained\nmax-replica: 2\n")

    # when it is served with an idle time typed beside it
    done = ugro(ugro_script, server, "serve", "-f", str(path), "--idle-after", "20m")

    # then the server read the file under the typed option: asleep, the file's bounds, the typed idle time
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("service chat: asleep until its first request, custom serving n1:")
    service = Service.objects.get(name="chat")
    assert (service.state, service.min_replicas, service.max_replicas, service.idle_after_s) == ("sleeping", 0, 2, 1200)

    # and bad files are refused in one line naming the file, nothing created
    for args, why in [((str(bad),), f"service file {bad}: unknown key 'max-replica': did you mean 'max_replicas'?"),
                      ((str(path), "other", "--min-replicas", "3"), "--min-replicas 3 is above --max-replicas 2"),
                      ((str(tmp_path / "none.yaml"),), "cannot read")]:  # fmt: skip
        refused = ugro(ugro_script, server, "serve", "-f", *args)
        assert refused.returncode != 0 and why in refused.stderr and refused.stderr.count("\n") == 1, refused.stderr
    assert Service.objects.count() == 1
