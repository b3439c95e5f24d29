"""The worker's decisions of serving/scaling.py and serving/updates.py on the fake agent: a service that sleeps
when idle (its slots freed) and wakes on a request, one that follows its load between its bounds (never on a slot a
job holds), a rolling update one replica at a time with a ready replica throughout, a broken update that leaves
the old replicas serving, and the refusals of bad input. The endpoint's part (a request held while a service
wakes) is tests/test_serve_proxy.py's; the real engines are tests/test_serve.py's."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from cluster.models import Node
from jobs.models import Allocation, Checkpoint, Job
from serving import replicas as replicas_module
from serving import scaling
from serving.models import Replica, Service
from serving.requests import (
    ServeError,
    ServeRequest,
    create_service,
    describe,
    listing,
    start_service,
    update_service,
)
from serving.stats import write_load

from .fake_agent import FakeCluster, _Link
from .test_roles import make_user

pytestmark = pytest.mark.django_db
BROKEN = "checkpoint-30"  # an engine given this checkpoint exits at once, as one that cannot load it


def _free_port(self, host: str = "") -> dict:
    return {"port": 20000 + len(self.node.requests)}


def _start(self, argv: list[str], cwd: str, env: dict, key: str, log: str, exit_file: str) -> dict:
    tag = env["UGRO_JOB"]
    self.node.started[key] = tag
    if any(BROKEN in part for part in argv):
        self.node.exits[key] = {"rc": 1}
    else:
        self.node.tags.setdefault(tag, []).append(50000 + len(self.node.requests))
    return {"pid": 1}


@pytest.fixture
def cluster(monkeypatch, settings):
    """Three nodes without GPUs (a replica holds one whole) on the fake agent; an engine answers its health check
    while its processes live; checkpoints copy instantly."""
    settings.UGRO = {**settings.UGRO, "KILL_GRACE_S": 0.0}
    fake = FakeCluster("n1", "n2", "n3").install(monkeypatch)
    monkeypatch.setattr(_Link, "op_free_port", _free_port, raising=False)
    monkeypatch.setattr(_Link, "op_start", _start, raising=False)
    monkeypatch.setattr(replicas_module, "ensure_on", lambda checkpoint, nodes: None)
    monkeypatch.setattr(replicas_module, "answers", lambda r: bool(fake[r.node.name].tags.get(r.tag)))
    monkeypatch.setattr("serving.placement.node_request", lambda *a, **k: {"entries": []})
    for i, name in enumerate(("n1", "n2", "n3")):
        Node.objects.create(name=name, address=f"127.0.0.{i + 2}", gpu_count=0, workdir="/w", order=i)
    job = Job.objects.create(name="trained", script="train.py", state=Job.State.SUCCEEDED)
    for step in (10, 20, 30):
        Checkpoint.objects.create(job=job, node=Node.objects.get(name="n1"), path=f"/w/out/checkpoint-{step}",
                                  size=1, mtime=0, step=step, kind=Checkpoint.Kind.DIR, ready=True)  # fmt: skip
    return fake


def tend(times: int = 1) -> Service:
    for _ in range(times):
        replicas_module.tend()
    return Service.objects.get()


def states(service: Service) -> list[str]:
    return list(service.replica_set.order_by("index").values_list("state", flat=True))


def drain_now(service: Service) -> None:
    """The drain's wait passed (the endpoint reported nothing in flight)."""
    ago = timezone.now() - timedelta(seconds=scaling.DRAIN_S + 1)
    service.replica_set.filter(state=Replica.State.DRAINING).update(draining_since=ago)


def held() -> set[str]:
    return set(Allocation.objects.filter(active=True, job=None).values_list("holder", flat=True))


def test_an_idle_service_sleeps_frees_its_node_and_a_request_wakes_it(cluster):
    # given a service that may sleep, up and answering
    create_service(ServeRequest(name="chat", source="trained:10", min_replicas=0, max_replicas=2, idle_after="1m"))
    service = tend(2)
    assert (service.state, states(service), held()) == ("running", ["ready"], {"serve:chat/0"})
    tag = service.replica_set.get().tag

    # when it has had no request for its idle time (the last request was 61 s ago)
    Service.objects.update(last_request_at=timezone.now() - timedelta(seconds=61))
    service = tend()
    # then it sleeps: its replica drains (still holding its node, nothing sent to it), then stops and frees it
    assert (service.state, states(service)) == ("sleeping", ["draining"])
    assert service.note == "asleep: no request for 1 min"
    drain_now(service)
    service = tend()
    assert (states(service), held(), cluster["n1"].tags.get(tag)) == (["stopped"], set(), None)
    assert "chat  sleeping" in "\n".join(listing([describe(service)]))
    assert "  replicas 0 (0-2)  sleeps after 1 min idle" in listing([describe(service)])[1]

    # when a request comes (the endpoint wakes it)
    assert scaling.wake("chat") and not scaling.wake("chat")  # once: a second request finds it waking
    assert Service.objects.get().state == "waking"
    service = tend()
    # then a replica starts where one is free and the worker waits for it to answer in the same pass
    assert (service.state, states(service), held()) == ("waking", ["ready"], {"serve:chat/0"})
    service = tend()
    assert service.state == "running" and service.last_cold_start_s is not None
    assert service.note.startswith("woke in ")
    line = listing([describe(service)])[1]
    assert "sleeps after 1 min idle  last cold start " in line and " s" in line
    viewer = Client()
    viewer.force_login(make_user("viewer"))
    page = viewer.get("/services/").content.decode()
    assert "sleeps after 1 min idle" in page and "last cold start <span data-cold-start>" in page
    assert 'data-cold-start>—' not in page and "woke in " in page
    # and a service that may not sleep is not woken
    assert not scaling.wake("chat")


def test_a_wake_whose_replica_cannot_start_goes_back_to_sleep_saying_why(cluster):
    # given a service started asleep (no replica yet) whose engine cannot load its checkpoint
    create_service(ServeRequest(name="chat", source="trained:30", min_replicas=0, replicas=0, idle_after="1m"))
    assert (Service.objects.get().state, Replica.objects.count()) == ("sleeping", 0)
    # when a request wakes it, and its replica is started 1 + 3 times
    scaling.wake("chat")
    for _ in range(10):  # 1 start + 3 restarts, each exiting at once
        service = tend()
        if service.state == "sleeping":
            break
    # then it is asleep again, saying why, holding nothing
    assert service.state == "sleeping" and service.note.startswith("could not wake: given up after 3 restarts")
    assert held() == set() and list(service.replica_set.values_list("index", "state")) == [(0, "stopped")]


def test_load_adds_a_replica_up_to_the_bound_and_a_quiet_period_takes_it_away(cluster, monkeypatch):
    # given a service of 1-2 replicas, 2 requests in flight each at most, one replica up
    create_service(ServeRequest(name="chat", source="trained:10", max_replicas=2, target_outstanding=2))
    service = tend(2)
    first = service.replica_set.get()
    assert (service.replicas, states(service)) == (1, ["ready"])

    # when the endpoint reports 5 requests in flight on it
    write_load({first.pk: (5, 5.0)})
    service = tend()
    # then a second replica is added and started at once, and it is ready by the next pass
    assert service.replicas == 2 and service.note.startswith("scaled up to 2: 5.0 requests in flight on 1")
    assert states(service) == ["ready", "starting"]
    write_load({first.pk: (9, 9.0)})
    service = tend()
    assert states(service) == ["ready", "ready"] and service.replicas == 2  # the bound: no third

    # when the load falls to what one replica takes at half its target, for the quiet period
    write_load({r.pk: (0, 0.4) for r in service.replica_set.all()})
    service = tend()
    assert service.replicas == 2 and service.quiet_since is not None  # quiet: counted from now
    monkeypatch.setattr(scaling, "SCALE_DOWN_QUIET_S", 0.0)
    service = tend()
    # then one leaves: drained first, then stopped, its node freed
    assert service.replicas == 1 and states(service) == ["ready", "draining"]
    drain_now(service)
    service = tend()
    assert states(service) == ["ready", "stopped"] and held() == {"serve:chat/0"}
    # and never below the minimum
    service = tend()
    assert service.replicas == 1


def test_an_added_replica_never_takes_a_node_a_job_holds(cluster):
    create_service(ServeRequest(name="chat", source="trained:10", max_replicas=3, target_outstanding=1))
    service = tend(2)
    job = Job.objects.create(name="training", script="train.py", state=Job.State.RUNNING)
    for name in ("n2", "n3"):
        Allocation.objects.create(job=job, node=Node.objects.get(name=name), gpu_index=Allocation.WHOLE_NODE)
    write_load({service.replica_set.get().pk: (4, 4.0)})
    service = tend(2)
    assert service.replicas == 2 and states(service) == ["ready", "pending"]
    assert service.replica_set.get(index=1).note.startswith("waiting for")
    assert held() == {"serve:chat/0"}  # the job's nodes are untouched


def _worker(monkeypatch):
    """The commands' check that a worker runs: the tests here are the worker."""
    monkeypatch.setattr("serving.requests.require_worker", lambda: None)


def test_a_rolling_update_replaces_each_replica_with_one_ready_throughout(cluster, monkeypatch):
    # given two replicas of step 10 on two of the three nodes
    _worker(monkeypatch)
    user = make_user("launcher")
    create_service(ServeRequest(name="chat", source="trained:10", replicas=2))
    service = tend(2)
    assert states(service) == ["ready", "ready"]

    # when it is updated to step 20
    update_service(user, service, ServeRequest(name="chat", source="trained:20"), "test")
    service = Service.objects.get()
    assert service.next_checkpoint.step == 20 and service.note == "updating to trained step 20"
    ready_seen = []
    for _ in range(20):
        service = tend()
        drain_now(service)
        ready_seen.append(service.replica_set.filter(state=Replica.State.READY).count())
        if service.next_checkpoint_id is None and not service.replica_set.filter(state="draining").exists():
            break
    # then the service serves step 20 from two new replicas, the old ones stopped, and a replica was ready at every
    # pass (two while it had two)
    assert service.checkpoint.step == 20 and service.note.startswith("updated to trained step 20")
    steps = {(r.checkpoint.step, r.state) for r in service.replica_set.select_related("checkpoint")}
    assert steps == {(20, "ready"), (10, "stopped")} and service.replica_set.filter(state="ready").count() == 2
    assert min(ready_seen) >= 2
    assert {r["step"] for r in describe(service)["replicas"] if r["state"] == "ready"} == {20}
    assert len(held()) == 2


def test_a_broken_update_leaves_the_old_replicas_serving_and_says_so_in_one_line(cluster, monkeypatch):
    _worker(monkeypatch)
    user = make_user("launcher")
    create_service(ServeRequest(name="chat", source="trained:10"))
    service = tend(2)
    old = service.replica_set.get()

    # when it is updated to a checkpoint its engine cannot load (the engine exits at once)
    update_service(user, service, ServeRequest(name="chat", source="trained:30"), "test")
    for _ in range(6):
        service = tend()
        if service.next_checkpoint_id is None:
            break
    # then the update is given up with why, the old replica serves on, and the new one leaves
    assert service.next_checkpoint_id is None and service.checkpoint.step == 10
    assert service.note.startswith("update to trained step 30 failed: replica 1 its engine exited (1)")
    assert "\n" not in service.note and service.note.endswith("the old replicas serve on")
    assert Replica.objects.get(pk=old.pk).state == "ready"
    drain_now(service)
    service = tend()
    assert states(service) == ["ready", "stopped"] and held() == {"serve:chat/0"}


def test_bad_scaling_input_is_one_line_and_changes_nothing(cluster, monkeypatch):
    _worker(monkeypatch)
    user = make_user("launcher")
    create_service(ServeRequest(name="taken", source="trained:10"))
    before = (Service.objects.count(), Replica.objects.count(), list(Service.objects.values()))
    cases = [
        (dict(min_replicas=3, max_replicas=2), "--min-replicas 3 is above --max-replicas 2"),
        (dict(min_replicas=0, idle_after="30s"), "--idle-after must be at least 1m, not 30s"),
        (dict(min_replicas=0, idle_after="soon"), "--idle-after must be a duration like 15m"),
        (dict(idle_after="20m"), "--idle-after is for --min-replicas 0"),
        (dict(replicas=3, min_replicas=1, max_replicas=2), "--replicas 3 is above --max-replicas 2"),
        (dict(cold_start_timeout="2h"), "--cold-start-timeout must be 1s-1h"),
        (dict(target_outstanding=0), "--target-outstanding must be 1-1000"),
    ]
    for fields, message in cases:
        with pytest.raises(ServeError) as err:
            start_service(user, ServeRequest(name="chat", source="trained", **fields), "test")
        assert message in str(err.value) and "\n" not in str(err.value), fields
    updates = {
        ("trained:10", ()): "service taken already serves trained step 10",
        ("trained:20", (("replicas", 2),)): "--replicas need a new service",
        ("trained:7", ()): "no complete checkpoint directory at step 7",
    }
    for (source, fields), message in updates.items():
        with pytest.raises(ServeError) as err:
            start_service(user, ServeRequest(name="taken", source=source, **dict(fields)), "test")
        assert message in str(err.value) and "\n" not in str(err.value), source
    assert (Service.objects.count(), Replica.objects.count(), list(Service.objects.values())) == before
