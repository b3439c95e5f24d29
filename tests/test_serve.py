"""`manage.py serve` and the worker's care of services on the loopback nodes: replicas placed on held slots,
started through the node agent, health-checked, restarted when they die, stopped with nothing left; bad input
refused in one line. The engine is the fake one (tests/data/serve/fake_engine.py) as a custom command, except
in the end-to-end test, where it is `transformers serve` with a tiny GPT-2 built here, one of whose replicas is
killed while a client keeps asking."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import threading
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import pytest
from django.core.management import CommandError, call_command

from accounts.tokens import create_token
from cluster.models import Node
from jobs.models import Allocation, Checkpoint, Job
from jobs.snapshot import Snapshot
from serving.models import Replica, ReplicaTraffic, Service
from serving.requests import describe
from ugro_site.celery import send_task

from .conftest import NODE_ENV, REPO, job_pids, wait_for
from .test_browser import daphne_serving

FAKE = f"{{python}} {REPO}/tests/data/serve/fake_engine.py --host {{host}} --port {{port}} --name {{name}}"
TINY_GPT2 = REPO / "tests" / "data" / "serve" / "tiny_gpt2.py"
pytestmark = pytest.mark.e2e


@pytest.fixture
def tender(lab):
    """The beat's tend_services, twice a second (the test worker's beat sends only the job tasks)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.5):
            send_task("serving.tasks.tend_services")

    ticker = threading.Thread(target=beat, daemon=True)
    ticker.start()
    yield
    stop.set()
    ticker.join()
    for tag in Replica.objects.exclude(tag="").values_list("tag", flat=True):  # a failed test leaves no engine
        for pid in job_pids(tag):
            os.kill(pid, signal.SIGKILL)


def trained_job(files: dict[str, str] | None = None) -> Checkpoint:
    """A job that recorded a complete checkpoint directory (step 10) on the first node."""
    node = Node.objects.order_by("order").first()
    path = f"{node.workdir}/outputs/trained/checkpoint-10"
    os.makedirs(path, exist_ok=True)
    for name, text in (files or {"config.json": "{}", "trainer_state.json": "{}"}).items():
        with open(f"{path}/{name}", "w") as fh:
            fh.write(text)
    job = Job.objects.create(name="trained", script="train.py", state=Job.State.SUCCEEDED)
    return Checkpoint.objects.create(job=job, node=node, path=path, size=4, mtime=0, step=10,
                                     kind=Checkpoint.Kind.DIR, ready=True)  # fmt: skip


def serve(*args: str) -> str:
    out = io.StringIO()
    call_command("serve", *args, stdout=out)
    return out.getvalue()


def engine_pids(replica: Replica) -> list[int]:
    return job_pids(replica.tag)


def ready(name: str, count: int) -> list[Replica] | None:
    rows = list(Replica.objects.filter(service__name=name, state=Replica.State.READY).select_related("node"))
    return rows if len(rows) == count else None


def test_an_engine_that_keeps_dying_is_given_up_after_its_restarts_and_frees_its_slot(lab, tender):
    """Covers: an engine that exits at once on a real node, tried 1 + 3 times by the worker, then given up with its
    reason and its slot freed.
    """
    # given an engine that exits at once with code 3
    trained_job()
    serve("dies", "--from", "trained", "--engine", "custom", "--command",
          "{python} -c 'import sys; print(\"no model here\"); sys.exit(3)' {port}")  # fmt: skip

    # when the worker has tried it
    failed = wait_for(lambda: Replica.objects.filter(service__name="dies", state=Replica.State.FAILED).first(),
                      timeout=60, what="the replica given up")  # fmt: skip

    # then it was started 1 + max_restarts times, says why it gave up, and holds nothing
    assert failed.restarts == 4
    assert failed.note.startswith("given up after 3 restarts: its engine exited (3): no model here")
    assert not Allocation.objects.filter(active=True, job=None).exists()
    assert "replica 0  failed" in serve("--list", "dies")
    assert "stopped" in serve("dies", "--stop")


def test_a_replica_that_stops_answering_leaves_the_rotation_and_is_restarted(lab, tender, monkeypatch):
    """Covers: a frozen (SIGSTOP) engine on a real node: its health check times out, it leaves the rotation and is
    restarted.
    """
    monkeypatch.setattr("serving.replicas.UNHEALTHY_RESTART_S", 2.0)
    monkeypatch.setattr("serving.replicas.CHECK_TIMEOUT_S", 1.0)
    # given a ready replica
    trained_job()
    serve("hangs", "--from", "trained", "--engine", "custom", "--command", FAKE)
    (replica,) = wait_for(lambda: ready("hangs", 1), timeout=60, what="a ready replica")

    # when its engine freezes (alive, silent)
    for pid in engine_pids(replica):
        os.kill(pid, signal.SIGSTOP)

    # then it is taken out of the rotation, then restarted, and ready again
    wait_for(lambda: Replica.objects.filter(pk=replica.pk, state=Replica.State.UNHEALTHY).exists(), timeout=30,
             what="the replica unhealthy")  # fmt: skip
    again = wait_for(lambda: ready("hangs", 1), timeout=60, what="the replica ready again")[0]
    assert again.restarts == 1 and again.tag != replica.tag
    assert job_pids(replica.tag) == []  # the frozen engine was killed
    assert "stopped" in serve("hangs", "--stop")


def test_bad_input_is_one_line_and_changes_nothing(lab, tender):
    """Covers: `serve`'s refusals in one line beside a real running service; the checks read the database only (a fast
    test could hold them).
    """
    trained_job()
    serve("taken", "--from", "trained", "--engine", "custom", "--command", FAKE)
    before = (Service.objects.count(), Replica.objects.count())

    cases = {
        ("chat", "--from", "nosuchjob"): "no job named 'nosuchjob'",
        ("chat", "--from", "trained:7"): "no complete checkpoint directory at step 7 (steps: 10)",
        ("chat", "--from", "trained", "--replicas", "4"): "4 replicas of 1 GPUs each do not fit",
        ("chat", "--from", "trained", "--gpus-per-replica", "2", "--replicas", "4"): "do not fit",
        ("taken", "--from", "trained"): "service taken already serves trained step 10",
        ("taken", "--from", "trained", "--replicas", "2"): "--replicas need a new service",
        ("chat", "--from", "trained", "--min-replicas", "2", "--max-replicas", "1"): "--min-replicas 2 is above",
        ("chat", "--from", "trained", "--engine", "custom"): "--engine custom needs --command",
        ("bad name!", "--from", "trained"): "service name 'bad name!' is not allowed",
    }
    for args, message in cases.items():
        with pytest.raises(CommandError) as err:
            serve(*args)
        assert message in str(err.value) and "\n" not in str(err.value), args
    assert (Service.objects.count(), Replica.objects.count()) == before
    serve("taken", "--stop")


# five engine starts (a replica, a second for the load, a restart, a wake, an update) and a broken one: past the
# suite's 300 s on a loaded 2-core CI machine (307 s there, 110 s alone)
@pytest.mark.timeout(600)
def test_transformers_serve_replicas_answer_through_the_endpoint_and_survive_a_replica_killed_under_load(
    lab, tender, controller_env, os_account, tmp_path, monkeypatch
):
    """Covers: real `transformers serve` replicas of a tiny GPT-2 started through real agents, answering through the
    controller's endpoint (streamed too); scaling with the load of three clients from one replica to two (on the
    other node, holding it, the checkpoint copied there) and back to one once they stop, the load figures from the
    web process's flusher; one killed under load and restarted in place by the worker, every request answered whole;
    `serve --list` after the restart and after the stop; stop leaving no process and no slot held; then a service
    from zero (--min-replicas 0 --replicas 0) holding nothing until its first request, which wakes it, is held while
    the engine loads and is answered, its cold start recorded and listed; a rolling update of it under a client's
    steady requests with none failed, and an update to a checkpoint its engine cannot load failing in one line with
    the running replica serving on (the scaling rules' edges are tests/test_serve_scaling.py's on the fake agent).
    """
    monkeypatch.setattr("serving.scaling.SCALE_DOWN_QUIET_S", 3.0)  # 120 s shipped
    # given a tiny GPT-2 saved with save_pretrained (config, weights, a tokenizer trained here: nothing downloaded)
    checkpoint = trained_job({})
    subprocess.run([str(NODE_ENV / "bin" / "python"), str(TINY_GPT2), checkpoint.path], check=True,
                   capture_output=True, timeout=300)  # fmt: skip

    # when it is served by `transformers serve` (CPU), one replica and up to two with the load (a target of one
    # request in flight each), and asked through the controller's endpoint
    said = serve("gpt", "--from", "trained:latest", "--max-replicas", "2", "--target-outstanding", "1")
    assert "service gpt: 1 replica(s) of transformers" in said and "/serve/gpt/v1/" in said
    wait_for(lambda: ready("gpt", 1), timeout=300, interval=1, what="a transformers serve replica ready")
    token = create_token(os_account, "app", "infer")[1]
    headers = {"Authorization": f"Bearer {token}"}
    with daphne_serving(controller_env, tmp_path / "daphne.log") as web:
        url = f"{web}/serve/gpt/v1/completions"
        answers = [httpx.post(url, json={"model": "gpt", "prompt": "the cluster", "max_tokens": 4}, headers=headers,
                              timeout=120) for _ in range(2)]  # fmt: skip
        with httpx.stream("POST", url, json={"model": "gpt", "prompt": "the node", "max_tokens": 3, "stream": True},
                          headers=headers, timeout=120) as r:  # fmt: skip
            streamed = r.read().decode()

        # then it answers completions from the model, a streamed one as server-sent events
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        assert all(a.json()["choices"][0]["finish_reason"] == "length" for a in answers)
        assert r.status_code == 200 and streamed.count("data: ") >= 3

        # when three clients keep asking (three requests in flight on one replica, past its target of one)
        with client_asking(url, headers, clients=3) as load:
            replicas = wait_for(lambda: ready("gpt", 2), timeout=300, interval=1, what="a second replica for the load")
            # then a second replica comes up on the other node, each holding its node (these nodes have no GPUs) as a
            # job would, the copy on the second node made from the first's checkpoint
            assert Service.objects.get(name="gpt").note.startswith("scaled up to 2: ")
            assert len({r.node_id for r in replicas}) == 2
            holds = Allocation.objects.filter(active=True, job=None)
            assert sorted(holds.values_list("holder", flat=True)) == ["serve:gpt/0", "serve:gpt/1"]
            held = Snapshot().holders  # the scheduler counts them busy
            assert {name for _, name in held.values()} == {"serve:gpt/0", "serve:gpt/1"}
            assert {r.model_path for r in replicas} == {
                f"{n.workdir}/outputs/trained/checkpoint-10"
                for n in Node.objects.filter(pk__in=[r.node_id for r in replicas])
            }

            # when, still under that load, one replica's engine is killed (once the new one is in the endpoint's
            # rotation: its ready list is read again within a second, and the flusher counts what each answered)
            (added,) = [r for r in replicas if r.index == 1]
            wait_for(lambda: ReplicaTraffic.objects.filter(replica=added, requests__gt=0).exists(), timeout=60,
                     what="the second replica serving")  # fmt: skip
            victim = Replica.objects.select_related("node").get(service__name="gpt", index=0)
            for pid in engine_pids(victim):
                os.kill(pid, signal.SIGKILL)
            killed_at = len(load.statuses)

            # then UGRO restarts it (the worker sees it gone), it is ready again and takes requests again
            def back():
                r = Replica.objects.get(pk=victim.pk)
                return r if r.restarts == 1 and r.state == Replica.State.READY and r.tag != victim.tag else None

            again = wait_for(back, timeout=300, interval=0.5, what="the killed replica restarted and ready")
            assert again.node_id == victim.node_id  # where it was
            listing = serve("--list")
            assert "gpt  running  transformers  from trained step 10" in listing
            assert "replica 0  ready" in listing and "restarts 1" in listing
            wait_for(lambda: ReplicaTraffic.objects.filter(replica=again, started_at__gte=again.ready_at,
                                                           requests__gt=0).exists(),
                     timeout=60, what="the restarted replica serving again")  # fmt: skip

        # and every request was answered whole, those sent while the replica was dead too: its row says ready until
        # the worker has taken it out, so a request the endpoint sent it then failed and was retried once (whether
        # one reached it first is the race of the client against the worker's health check: the retry and its
        # count are checked where they are certain, test_serve_proxy's dead-replica test)
        assert len(load.statuses) > killed_at + 2
        assert [s for s in load.statuses if s != 200] == []
        assert job_pids(victim.tag) == []

        # and its stats count what it answered (tokens from the engine's usage field)
        stats = describe(Service.objects.get(name="gpt"))["replicas"]
        assert all(r["stats"]["requests_total"] > 0 and r["stats"]["tokens_total"] > 0 for r in stats), stats

        # when the clients stop: once the quiet period is over, one replica drains and stops, its node freed
        wait_for(lambda: ready("gpt", 1) and not Replica.objects.filter(service__name="gpt", state="draining").exists()
                 and Allocation.objects.filter(active=True, job=None).count() == 1, timeout=120, interval=0.5,
                 what="back to one replica")  # fmt: skip
        assert Service.objects.get(name="gpt").note.startswith("scaled down to 1: ")
        assert Replica.objects.filter(service__name="gpt", state="stopped").count() == 1

        # and stopping leaves no process (the killed engine's included), no slot held, and the list says so
        assert "service gpt stopped" in serve("gpt", "--stop")
        tags = list(Replica.objects.filter(service__name="gpt").values_list("tag", flat=True))
        assert [t for t in [*tags, victim.tag] if job_pids(t)] == []
        assert not Allocation.objects.filter(active=True, job=None).exists()
        assert set(Replica.objects.filter(service__name="gpt").values_list("state", flat=True)) == {"stopped"}
        assert "gpt  stopped" in serve("--list")

        # when the checkpoint is served again from zero (--min-replicas 0 --replicas 0): nothing runs or is held
        said = serve("cold", "--from", "trained:10", "--min-replicas", "0", "--replicas", "0", "--idle-after", "15m")
        assert "service cold: asleep until its first request, transformers" in said
        assert not Allocation.objects.filter(active=True).exists() and "cold  sleeping" in serve("--list")
        # then its first request wakes it, is held while `transformers serve` loads, and is answered
        first = httpx.post(f"{web}/serve/cold/v1/completions", json={"model": "cold", "prompt": "the cluster",
                           "max_tokens": 4}, headers=headers, timeout=200)  # fmt: skip
        assert first.status_code == 200 and first.json()["choices"][0]["finish_reason"] == "length", first.text
        service = wait_for(lambda: Service.objects.filter(name="cold", state="running").first(), timeout=30,
                           what="the woken service running")  # fmt: skip
        assert service.last_cold_start_s > 0 and service.note.startswith("woke in ")
        assert "last cold start " in serve("--list", "cold")
        (woken,) = ready("cold", 1)
        assert Allocation.objects.get(active=True).holder == "serve:cold/0" and woken.checkpoint_id == checkpoint.pk

        # when, while a client keeps asking, it is moved to a newer checkpoint (a rolling update), then to one its
        # engine cannot load (a config that does not parse: transformers serve exits at start)
        newer = checkpoint_beside(checkpoint, 20)
        checkpoint_beside(checkpoint, 30, config='{"model_type": "gpt2", "n_layer": "x"}')
        with client_asking(f"{web}/serve/cold/v1/completions", headers) as load:
            wait_for(lambda: len(load.statuses) >= 2, timeout=60, what="requests before the update")
            said = serve("cold", "--from", "trained:20")
            # then the new replica took requests before the old one drained and stopped: the service serves step
            # 20 from one replica, and no request failed
            assert said.startswith("service cold: updated to trained step 20"), said
            (moved,) = ready("cold", 1)
            assert moved.checkpoint_id == newer.pk
            wait_for(lambda: job_pids(woken.tag) == [], timeout=60, what="the old replica's engine stopped")
            updated = len(load.statuses)
            with pytest.raises(CommandError) as err:
                serve("cold", "--from", "trained:30")
            # and the broken update fails in one line, its replica gone, the running one serving on
            line = str(err.value)
            assert "update to trained step 30 failed: replica" in line and "the old replicas serve on" in line, line
            assert "\n" not in line and ready("cold", 1)[0].pk == moved.pk
            wait_for(lambda: len(load.statuses) >= updated + 3, timeout=60, what="requests after the updates")
        assert [s for s in load.statuses if s != 200] == [], load.statuses
        assert Service.objects.get(name="cold").checkpoint_id == newer.pk
    assert "service cold stopped" in serve("cold", "--stop")
    assert not Allocation.objects.filter(active=True).exists() and job_pids(moved.tag) == []
    assert not [r.tag for r in Replica.objects.filter(service__name="cold") if job_pids(r.tag)]


def checkpoint_beside(checkpoint: Checkpoint, step: int, config: str | None = None) -> Checkpoint:
    """A copy of a checkpoint directory recorded at another step of its job (its config.json replaced if given)."""
    import shutil

    path = checkpoint.path.replace("checkpoint-10", f"checkpoint-{step}")
    shutil.copytree(checkpoint.path, path)
    if config is not None:
        with open(f"{path}/config.json", "w") as fh:
            fh.write(config)
    return Checkpoint.objects.create(job=checkpoint.job, node=checkpoint.node, path=path, size=4, mtime=0, step=step,
                                     kind=Checkpoint.Kind.DIR, ready=True)  # fmt: skip


@contextmanager
def client_asking(url: str, headers: dict, clients: int = 1):
    """`clients` clients each sending completions one after another until the block ends: .statuses (200, or what
    went wrong)."""
    load = SimpleNamespace(statuses=[])
    stop = threading.Event()

    def ask() -> None:
        with httpx.Client(headers=headers, timeout=120) as client:
            while not stop.is_set():
                try:
                    r = client.post(url, json={"model": "gpt", "prompt": "the cluster", "max_tokens": 4})
                    whole = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
                    load.statuses.append(r.status_code if whole else f"{r.status_code}: {r.text[:300]}")
                except (httpx.HTTPError, ValueError, LookupError) as exc:  # a cut answer is a failure too
                    load.statuses.append(repr(exc))

    threads = [threading.Thread(target=ask, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield load
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=150)
