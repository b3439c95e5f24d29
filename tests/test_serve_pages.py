"""The services page's own controls: a form that starts a service (`ugro serve NAME --from JOB`) and a stop
button per running service, for those the policy lets serve; bad input, a viewer and a missing worker are
refused in one line and leave nothing behind. What the page lists is tests/test_serve_stats.py's; a real
service end to end is tests/test_serve.py's."""

from __future__ import annotations

import base64
import io

import pytest
from django.test import Client

from accounts.models import AuditEvent
from cluster.models import Node
from jobs.models import Checkpoint, Job
from serving.models import Replica, Service

from .test_roles import make_user

pytestmark = pytest.mark.django_db
FORM = {"name": "chat", "source": "trained", "replicas": "2", "gpus_per_replica": "1", "engine": "transformers",
        "command": ""}  # fmt: skip


WEIGHTS = [{"name": "model.safetensors", "size": 3 * 2**30, "mtime": 0}, {"name": "optimizer.pt", "size": 6 * 2**30,
                                                                           "mtime": 0}]  # fmt: skip


@pytest.fixture
def trained(db, monkeypatch):
    """A finished job with a checkpoint directory of 3 GiB of weights on gpu1, whose two GPUs have 8 GB each."""
    from cluster.models import GPU
    from serving import placement

    monkeypatch.setattr(placement, "node_request", lambda node, op, timeout, path: {"entries": WEIGHTS})
    node = Node.objects.create(name="gpu1", address="10.0.0.2", gpu_count=2)
    GPU.objects.filter(node=node).update(vram_mb=8192)
    job = Job.objects.create(name="trained", script="train.py", state=Job.State.SUCCEEDED)
    Checkpoint.objects.create(job=job, node=node, path="/w/outputs/trained/checkpoint-10", size=1, mtime=0, step=10,
                              kind=Checkpoint.Kind.DIR, ready=True)  # fmt: skip
    return job


def client_in(role: str) -> Client:
    client = Client()
    client.force_login(make_user(role))
    return client


def test_a_launcher_starts_a_service_from_the_page_and_stops_it(trained, worker_heartbeat):
    launcher = client_in("launcher")
    assert 'id="serve-form"' in launcher.get("/services/").content.decode()
    # when the form is sent
    answer = launcher.post("/services/start", FORM)
    # then the service is recorded with its replicas waiting for the worker, audited, and the page says so
    assert answer.status_code == 302 and answer["Location"] == "/services/"
    service = Service.objects.get(name="chat")
    assert service.state == Service.State.RUNNING and service.checkpoint.step == 10
    assert list(service.replica_set.values_list("state", flat=True)) == [Replica.State.PENDING] * 2
    assert AuditEvent.objects.filter(action="serve", target="chat", outcome="ok").exists()
    page = launcher.get("/services/").content.decode()
    assert "service chat starting: /serve/chat/v1/" in page and 'data-stop="chat"' in page
    # when its stop button is pressed: it is stopping (the worker drains it)
    assert launcher.post("/services/chat/stop").status_code == 302
    assert Service.objects.get(name="chat").state == Service.State.STOPPING
    assert 'data-stop="chat"' not in launcher.get("/services/").content.decode()


def test_the_form_on_a_running_services_name_starts_a_rolling_update(trained, worker_heartbeat):
    # given a running service from step 10, and the job's newer checkpoint at step 20
    launcher = client_in("launcher")
    launcher.post("/services/start", FORM)
    Checkpoint.objects.create(job=trained, node=Node.objects.get(name="gpu1"), path="/w/outputs/trained/checkpoint-20",
                              size=1, mtime=1, step=20, kind=Checkpoint.Kind.DIR, ready=True)  # fmt: skip
    # when the form is sent again under its name, from the job's latest checkpoint
    answer = launcher.post("/services/start", {**FORM, "source": "trained:latest"})
    # then an update to step 20 is recorded (the worker carries it out), audited, and the page says so
    assert answer.status_code == 302
    service = Service.objects.get(name="chat")
    assert service.next_checkpoint.step == 20 and service.checkpoint.step == 10
    assert AuditEvent.objects.filter(action="serve update", target="chat", outcome="ok").exists()
    assert "service chat: updating to trained step 20" in launcher.get("/services/").content.decode()
    # and the same shape changed is refused in one line, nothing recorded
    answer = launcher.post("/services/start", {**FORM, "source": "trained:10", "gpus_per_replica": "2"})
    assert answer.status_code == 400 and "an update changes only its checkpoint" in answer.content.decode()


@pytest.mark.parametrize(
    "change, says",
    [
        ({"source": "nosuchjob"}, "nosuchjob"),
        ({"name": "bad name;rm"}, "service name"),
        ({"replicas": "3", "gpus_per_replica": "2"}, "do not fit"),
        ({"engine": "custom", "command": ""}, "command"),
    ],
)
def test_bad_input_is_named_on_the_page_and_nothing_is_recorded(trained, worker_heartbeat, change, says):
    answer = client_in("launcher").post("/services/start", {**FORM, **change})
    assert answer.status_code == 400
    error = answer.content.decode().split('id="serve-error">', 1)[1].split("</div>", 1)[0]
    assert says in error and "\n" not in error.strip()
    assert not Service.objects.exists() and not Replica.objects.exists()


def test_a_viewer_sees_no_controls_and_is_refused(trained, worker_heartbeat):
    viewer = client_in("viewer")
    page = viewer.get("/services/").content.decode()
    assert 'id="serve-form"' not in page
    assert viewer.post("/services/start", FORM).status_code == 403
    assert not Service.objects.exists()
    client_in("launcher").post("/services/start", FORM)
    assert viewer.post("/services/chat/stop").status_code == 403
    assert Service.objects.get(name="chat").state == Service.State.RUNNING


def test_with_no_worker_the_form_says_so_and_records_nothing(trained):
    answer = client_in("launcher").post("/services/start", FORM)
    assert answer.status_code == 400 and "no UGRO worker is running: start it with bin/start" in answer.content.decode()
    assert not Service.objects.exists()


def test_with_no_worker_the_serve_command_refuses_in_one_line(trained):
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="no UGRO worker is running") as err:
        call_command("serve", "chat", "--from", "trained", "--engine", "custom", "--command",
                     "{python} engine.py --port {port}", stdout=io.StringIO())  # fmt: skip
    assert "\n" not in str(err.value) and not Service.objects.exists()


def test_a_replicas_log_is_read_from_its_node_and_shown_as_text(trained, monkeypatch):
    from cluster.links import LinkError
    from serving import replicas

    service = Service.objects.create(name="chat", job=trained, checkpoint=Checkpoint.objects.get(), replicas=2)
    node = Node.objects.get(name="gpu1")
    Replica.objects.create(
        service=service, index=0, state=Replica.State.READY, node=node, port=8001, tag="serve-chat-0"
    )
    Replica.objects.create(service=service, index=1)
    asked = []

    def tail(node, op, timeout, argv):
        asked.append(argv)
        return {"stdout": "INFO: Uvicorn running\n<script>alert(1)</script>\n"}

    monkeypatch.setattr(replicas, "node_request", tail)
    viewer = client_in("viewer")
    # the page links each started replica's log
    assert 'data-log="0"' in viewer.get("/services/").content.decode()
    # its log: the tail of the file of its current start, escaped
    html = viewer.get("/services/chat/replicas/0/log").content.decode()
    [argv] = asked
    assert argv[:3] == ["tail", "-c", str(replicas.LOG_TAIL_BYTES)] and argv[3].endswith(
        "/.ugro/serve/serve-chat-0.log"
    )
    assert "INFO: Uvicorn running" in html and "<script>alert(1)" not in html and "&lt;script&gt;" in html
    # a replica not started yet, and a node that does not answer: one line each
    assert "has not started yet" in viewer.get("/services/chat/replicas/1/log").content.decode()

    def silent(*a, **k):
        raise LinkError("node gpu1: SSH did not answer within 5 s")

    monkeypatch.setattr(replicas, "node_request", silent)
    error = viewer.get("/services/chat/replicas/0/log").content.decode().split('id="log-error">', 1)[1]
    assert (
        error.split("</div>", 1)[0]
        == "the log of replica 0 on gpu1 cannot be read: node gpu1: SSH did not answer within 5 s"
    )
    assert viewer.get("/services/chat/replicas/7/log").status_code == 404


def test_a_checkpoint_too_big_for_any_gpu_is_refused_and_replicas_go_where_the_weights_fit(trained, monkeypatch):
    from cluster.models import GPU
    from serving import placement
    from serving.requests import ServeError, ServeRequest, check_request

    # given the checkpoint's 3 GiB of weights (its optimizer state does not count) and 8 GB GPUs
    _, _, vram = check_request(ServeRequest(name="chat", source="trained", replicas=1, gpus_per_replica=1))
    assert vram == 3687  # 3 GiB x 1.2 on one GPU
    # when the weights grow to 10 GiB: refused in one line naming what each GPU needs and the largest GPU
    placement_listing = [{"name": "model-00001-of-00002.safetensors", "size": 5 * 2**30},
                         {"name": "model-00002-of-00002.safetensors", "size": 5 * 2**30}]  # fmt: skip
    monkeypatch.setattr(placement, "node_request", lambda node, op, timeout, path: {"entries": placement_listing})
    with pytest.raises(ServeError, match=r"at least 12\.0 GB .* the largest GPU has 8\.0 GB"):
        check_request(ServeRequest(name="chat", source="trained", replicas=1, gpus_per_replica=1))
    # split over the node's two GPUs (6 GB each) it fits
    assert check_request(ServeRequest(name="chat", source="trained", replicas=1, gpus_per_replica=2))[2] == 6144
    # and a replica is placed on a node whose GPUs hold its share, not on the smaller one placement tries first
    big = Node.objects.create(name="gpu9", address="10.0.0.9", gpu_count=1, order=99)
    GPU.objects.filter(node=big).update(vram_mb=16384)
    GPU.objects.filter(node__name="gpu1").update(vram_mb=8192)
    service = Service.objects.create(name="big", job=Job.objects.get(), checkpoint=Checkpoint.objects.get(),
                                     replicas=1, gpus_per_replica=1, min_vram_mb=12288)  # fmt: skip
    replica = Replica.objects.create(service=service, index=0)
    assert min(Node.objects.all(), key=lambda n: n.placement_key()).name == "gpu1"
    assert placement.place(replica) and Replica.objects.get(pk=replica.pk).node.name == "gpu9"


def test_a_replicas_log_is_copied_centrally_as_written_shown_live_and_kept_after_it_stops(
    trained, monkeypatch, settings, tmp_path
):
    from cluster.links import LinkError
    from serving import replica_logs, replicas

    settings.DATA_DIR = tmp_path
    service = Service.objects.create(name="chat", job=trained, checkpoint=Checkpoint.objects.get())
    replica = Replica.objects.create(service=service, index=0, state=Replica.State.READY,
                                     node=Node.objects.get(name="gpu1"), port=8001, tag="serve-chat-0-a")  # fmt: skip
    on_node = {"serve-chat-0-a": b"INFO: Uvicorn running\n"}  # each start's log on its node

    def tail(node, op, timeout, files):
        (item,) = files
        data = on_node[item["path"].rsplit("/", 1)[1].removesuffix(".log")][item["offset"] :]
        return {"files": [{"key": item["key"], "data": base64.b64encode(data).decode(), "zlib": False}]}

    monkeypatch.setattr(replica_logs, "node_request", tail)
    viewer = client_in("viewer")

    # when the worker's passes copy it as it grows
    assert replica_logs.copy(replica) == len(b"INFO: Uvicorn running\n")
    on_node["serve-chat-0-a"] += b"<script>alert(1)</script> 200 OK\n"
    replica_logs.copy(replica)
    assert replica_logs.copy(replica) == 0  # nothing new: nothing written

    # then the page shows the central copy (the node is not asked), escaped, and refreshes itself
    monkeypatch.setattr(replicas, "node_request", lambda *a, **k: pytest.fail("the node was asked"))
    html = viewer.get("/services/chat/replicas/0/log").content.decode()
    assert "INFO: Uvicorn running\n&lt;script&gt;alert(1)&lt;/script&gt; 200 OK" in html and "<script>alert" not in html
    assert "as copied to the controller" in html and 'data-region="services"' in html

    # when it is restarted (a new start, a new log) and then stopped with its node gone
    replica.tag = "serve-chat-0-b"
    on_node["serve-chat-0-b"] = b"starting again\n"
    replica_logs.copy(replica)

    def silent(*a, **k):
        raise LinkError("node gpu1: SSH did not answer within 5 s")

    monkeypatch.setattr(replica_logs, "node_request", silent)
    assert replica_logs.copy(replica) == 0
    Replica.objects.filter(pk=replica.pk).update(state=Replica.State.STOPPED, tag="serve-chat-0-b")
    # then each start's copy is kept, and the page shows the last one without its node
    first = (tmp_path / "serve-logs" / "chat" / "0-serve-chat-0-a.log").read_bytes()
    assert first == on_node["serve-chat-0-a"]
    html = viewer.get("/services/chat/replicas/0/log").content.decode()
    assert "starting again" in html and "log-error" not in html


def test_a_replicas_central_log_keeps_its_newest_part_and_its_last_starts(trained, monkeypatch, settings, tmp_path):
    from serving import replica_logs

    settings.DATA_DIR = tmp_path
    monkeypatch.setattr(replica_logs, "SEGMENT_BYTES", 10)  # 16 MiB shipped
    monkeypatch.setattr(replica_logs, "NODE_KEEP_BYTES", 25)  # 1 MiB shipped
    service = Service.objects.create(name="chat", job=trained, checkpoint=Checkpoint.objects.get())
    replica = Replica.objects.create(service=service, index=0, state=Replica.State.READY,
                                     node=Node.objects.get(name="gpu1"), port=8001, tag="serve-chat-0-s0")  # fmt: skip
    on_node = {"serve-chat-0-s0": b""}
    asked = []

    def tail(node, op, timeout, files):
        (item,) = files
        asked.append(item)
        data = on_node[item["path"].rsplit("/", 1)[1].removesuffix(".log")][item["offset"] :]
        return {"files": [{"key": item["key"], "data": base64.b64encode(data).decode(), "zlib": False}]}

    monkeypatch.setattr(replica_logs, "node_request", tail)
    folder = tmp_path / "serve-logs" / "chat"
    # given an engine that logs a line per request, copied pass after pass (a write may span segments)
    for i in range(9):
        on_node["serve-chat-0-s0"] += b"request %d\n" % i  # 10 bytes a line
        if i % 3 == 2:
            replica_logs.copy(replica)
    # then the copy keeps the log's last two segments (20 of its 90 bytes), and the page's tail reads across them
    assert sorted(p.name for p in folder.iterdir()) == ["0-serve-chat-0-s0.log.7", "0-serve-chat-0-s0.log.8"]
    assert replica_logs.shown(replica) == "request 7\nrequest 8\n"
    assert replica_logs.shown(replica, size=15) == "uest 7\nrequest 8\n"[-15:]
    # and the node was asked to free what was stored here but the newest 25 bytes (the agent: tests/test_agent.py)
    assert [i.get("release_before") for i in asked] == [None, 30 - 25, 60 - 25]
    # when it is restarted six times: the copies of its last five starts stay, the oldest goes
    for n in range(1, 7):
        replica.tag = f"serve-chat-0-s{n}"
        on_node[replica.tag] = b"start %d\n" % n
        replica_logs.copy(replica)
    assert sorted({p.name.split(".log")[0] for p in folder.iterdir()}) == [f"0-serve-chat-0-s{n}" for n in range(2, 7)]
    assert replica_logs.shown(replica) == "start 6\n"
