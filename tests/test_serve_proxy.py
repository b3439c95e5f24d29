"""The services' endpoint, /serve/<name>/v1/..., on a real daphne in front of real HTTP replicas (the fake
engine, tests/data/serve/fake_engine.py): streaming passed on as it arrives, least outstanding requests,
one retry past a dead replica, the token and the size bound. The replicas' rows are written here; the
worker's part (placing, starting, checking them) is tests/test_serve.py's."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from accounts.tokens import create_token, find_token, revoke
from cluster.models import Node
from jobs.models import Checkpoint, Job
from serving.balancer import READY_CACHE_S
from serving.models import Replica, Service

from .conftest import REPO, wait_for
from .test_browser import daphne_serving, free_port, http_ok, start, stop

FAKE_ENGINE = REPO / "tests" / "data" / "serve" / "fake_engine.py"
pytestmark = pytest.mark.no_test_worker  # nothing here needs the worker: the rows say which replicas are ready


@pytest.fixture
def web(controller_env, transactional_db, tmp_path):
    with daphne_serving(controller_env, tmp_path / "daphne.log") as base:
        yield base


@pytest.fixture
def engines(tmp_path):
    """start(name) -> the port of a new fake engine; every one is stopped afterwards."""
    procs: list[subprocess.Popen] = []
    gate = tmp_path / "gate"
    gate.mkdir()

    def one(name: str) -> int:
        port = free_port()
        argv = [sys.executable, str(FAKE_ENGINE), "--port", str(port), "--name", name, "--gate", str(gate)]
        procs.append(start(argv, {}, tmp_path / f"{name}.log"))
        wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/health"), timeout=15, what=f"engine {name}")
        return port

    one.gate = gate
    yield one
    for p in procs:
        stop(p)


@pytest.fixture
def token(os_account):
    return create_token(os_account, "tests", "infer")[1]


def service_on(ports: list[int], name: str = "chat") -> Service:
    """A running service whose replicas listen on these ports of 127.0.0.1, each ready."""
    node = Node.objects.create(name="here", address="127.0.0.1", gpu_count=0)
    job = Job.objects.create(name="trained", script="train.py")
    ckpt = Checkpoint.objects.create(job=job, node=node, path="/ckpt/checkpoint-10", size=1, mtime=0, step=10,
                                     kind=Checkpoint.Kind.DIR, ready=True)  # fmt: skip
    service = Service.objects.create(name=name, job=job, checkpoint=ckpt, engine="custom", replicas=len(ports),
                                     command_template="{python} engine.py --port {port}")  # fmt: skip
    for i, port in enumerate(ports):
        Replica.objects.create(service=service, index=i, state=Replica.State.READY, node=node, port=port)
    return service


def completion(base: str, token: str | None, stream: bool = False, service: str = "chat", **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"model": service, "prompt": "hi", "stream": stream}
    return httpx.post(f"{base}/serve/{service}/v1/completions", json=body, headers=headers, timeout=30, **kw)


def test_a_streamed_completion_is_passed_on_as_it_arrives(web, engines, token):
    # given one replica that sends its first chunk, then waits for the test's word before the rest
    service_on([engines("a")])

    # when a streamed completion is asked through the endpoint
    with httpx.stream("POST", f"{web}/serve/chat/v1/completions", json={"model": "chat", "prompt": "hi",
                      "stream": True}, headers={"Authorization": f"Bearer {token}"}, timeout=30) as r:  # fmt: skip
        chunks = r.iter_bytes()
        first = next(chunks)
        # then the first chunk arrived while the replica still holds back the rest
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert b'"first"' in first and b'"second"' not in first
        (engines.gate / "go").touch()
        rest = first + b"".join(chunks)

    # and the whole answer followed, the replica asked for the model its engine serves (the service's name)
    assert b'"second"' in rest and rest.rstrip().endswith(b"data: [DONE]")
    assert json.loads(first.split(b"data: ", 1)[1].split(b"\n")[0])["model"] == "chat"


def test_the_idle_replica_takes_the_next_request(web, engines, token):
    # given two replicas, one of them busy with a stream held open
    service_on([engines("a"), engines("b")])
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.stream("POST", f"{web}/serve/chat/v1/completions", json={"prompt": "hi", "stream": True},
                      headers=headers, timeout=30) as held:  # fmt: skip
        lines = held.iter_lines()  # kept: a dropped iterator closes the connection (the stream would end)
        busy = json.loads(next(lines).removeprefix("data: "))["served_by"]

        # when more requests come while it is held
        others = {completion(web, token).json()["served_by"] for _ in range(3)}
        (engines.gate / "go").touch()

    # then each of them went to the other replica (fewest requests outstanding)
    assert others == ({"a", "b"} - {busy})


def test_a_dead_replica_is_skipped_and_its_request_retried_once_and_the_stats_say_so(web, engines, token, os_account):
    # given two ready replicas, one of which died (nothing listens on its port)
    service = service_on([engines("alive"), free_port()])
    (engines.gate / "go").touch()  # streams are not held back here

    # when several requests come, one of them streamed
    answers = [completion(web, token) for _ in range(4)]
    streamed = completion(web, token, stream=True)

    # then every one is answered, by the live replica
    assert [r.status_code for r in answers] == [200] * 4 and streamed.status_code == 200
    assert {r.json()["served_by"] for r in answers} == {"alive"}

    # and the endpoint's stats, written within a few seconds, count them: five answered with 3 tokens each
    # (usage) but the stream (its 2 chunks), the dead replica's failed tries as errors
    alive, dead = service.replica_set.order_by("index")
    wait_for(lambda: Replica.objects.filter(pk=alive.pk, requests_total=5).exists(), timeout=30,
             what="the stats written")  # fmt: skip
    alive.refresh_from_db()
    dead.refresh_from_db()
    assert (alive.errors_total, alive.tokens_total) == (0, 4 * 3 + 2)
    assert dead.requests_total == dead.errors_total >= 1 and dead.tokens_total == 0
    read = create_token(os_account, "reader", "read")[1]
    listed = httpx.get(f"{web}/api/v1/services/chat/", headers={"Authorization": f"Bearer {read}"}, timeout=10)
    stats = listed.json()["replicas"][0]["stats"]
    assert stats["requests"] == 5 and stats["p50_ms"] > 0 and stats["p99_ms"] >= stats["p50_ms"]


def test_no_replica_answering_is_one_clear_error(web, token):
    # given a service whose only replica is gone
    service_on([free_port()])

    # when asked
    r = completion(web, token)

    # then 502, saying so
    assert r.status_code == 502
    assert "no replica of service chat answered" in r.json()["error"]["message"]


def test_a_token_is_required_and_its_scope_counts(web, engines, os_account, token):
    # given a service and tokens of each kind
    service_on([engines("a")])
    read = create_token(os_account, "reader", "read")[1]

    # then no token, an unknown one and a read-only one are refused; an infer token is served
    assert completion(web, None).status_code == 401
    assert completion(web, "ugro_deadbeef_nope").status_code == 401
    refused = completion(web, read)
    assert refused.status_code == 403 and "scope is read" in refused.json()["error"]["message"]
    assert completion(web, token).status_code == 200

    # and a token revoked after it was let in is refused once its admission (ADMITTED_S) has run out
    revoke(find_token(token))
    wait_for(lambda: completion(web, token).status_code == 401, timeout=30, interval=0.5, what="the revoked token")


def test_the_request_size_is_bounded(web, engines, token, tmp_path):
    # given a service
    service_on([engines("a")])

    # when a request over the bound comes
    r = httpx.post(
        f"{web}/serve/chat/v1/completions", content=b'{"prompt": "' + b"x" * (1024 * 1024 + 10) + b'"}',
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"}, timeout=30,
    )  # fmt: skip

    # then it is refused and the replica never saw it
    assert r.status_code == 413
    assert "request" not in (tmp_path / "a.log").read_text().replace("listening", "")


def test_models_lists_the_service_and_unknown_services_are_404(web, engines, token):
    service_on([engines("a")])
    headers = {"Authorization": f"Bearer {token}"}

    models = httpx.get(f"{web}/serve/chat/v1/models", headers=headers, timeout=10)
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["chat"]
    # served beside Django (serving/endpoint.py): no cookie, no page headers, still nosniff
    assert "set-cookie" not in models.headers and "content-security-policy" not in models.headers
    assert models.headers["x-content-type-options"] == "nosniff"
    # an engine's answer of another type than an OpenAI-compatible one is never a page of this origin
    page = httpx.post(f"{web}/serve/chat/v1/completions", json={"prompt": "<page>"}, headers=headers, timeout=10)
    assert page.status_code == 200 and page.content.startswith(b"<html>")
    assert (page.headers["content-type"], page.headers["x-content-type-options"]) == ("application/octet-stream",
                                                                                      "nosniff")  # fmt: skip
    assert httpx.get(f"{web}/serve/nope/v1/models", headers=headers, timeout=10).status_code == 404


def test_a_request_to_a_sleeping_service_wakes_it_and_is_held_until_a_replica_is_ready(web, engines, token):
    # given a service asleep (min 0 replicas), its replica stopped, a request waiting at most 20 s for it
    service = service_on([engines("a")])
    (engines.gate / "go").touch()
    Service.objects.filter(pk=service.pk).update(state=Service.State.SLEEPING, min_replicas=0, idle_after_s=60,
                                                 cold_start_timeout_s=20)  # fmt: skip
    service.replica_set.update(state=Replica.State.STOPPED)
    answer = {}
    asking = threading.Thread(target=lambda: answer.update(r=completion(web, token)), daemon=True)

    # when a request comes
    asking.start()
    # then the endpoint wakes the service and holds the request (no answer while no replica is ready)
    wait_for(lambda: Service.objects.filter(pk=service.pk, state=Service.State.WAKING).exists(), timeout=15,
             what="the service woken")  # fmt: skip
    assert asking.is_alive() and Service.objects.get(pk=service.pk).wake_at is not None
    # and once a replica is ready (the worker's part), the held request is answered by it
    service.replica_set.update(state=Replica.State.READY)
    asking.join(timeout=30)
    assert answer["r"].status_code == 200 and answer["r"].json()["served_by"] == "a"

    # and past the cold-start timeout, a request gets 503 with Retry-After
    Service.objects.filter(pk=service.pk).update(state=Service.State.SLEEPING, cold_start_timeout_s=1,
                                                 last_cold_start_s=12.4)  # fmt: skip
    service.replica_set.update(state=Replica.State.STOPPED)
    time.sleep(READY_CACHE_S + 0.2)  # the web server's view of the ready replicas is read again past this
    late = completion(web, token)
    assert late.status_code == 503 and late.headers["retry-after"] == "12"
    assert "waited 1 s for it to wake" in late.json()["error"]["message"]

    # and a held request whose wake the worker gives up (its engine never answered) gets 503 with the reason at
    # once, not at the end of its cold-start timeout; the next request tries a wake again
    Service.objects.filter(pk=service.pk).update(state=Service.State.SLEEPING, cold_start_timeout_s=120)
    time.sleep(READY_CACHE_S + 0.2)
    for _ in range(2):
        before = Service.objects.get(pk=service.pk).wake_at
        asking = threading.Thread(target=lambda: answer.update(r=completion(web, token)), daemon=True)
        asking.start()
        wait_for(lambda b=before: Service.objects.filter(pk=service.pk, state=Service.State.WAKING, wake_at__gt=b)
                 .exists(), timeout=15, what="the service woken by this request")  # fmt: skip
        Service.objects.filter(pk=service.pk).update(state=Service.State.SLEEPING,
                                                     note="could not wake: given up after 3 restarts: exit 1")
        asking.join(timeout=15)
        assert not asking.is_alive() and answer["r"].status_code == 503
        said = answer["r"].json()["error"]["message"]
        assert said == "service chat could not wake: given up after 3 restarts: exit 1"


@pytest.mark.parametrize("ends", ["answered", "client hangs up"])
def test_the_endpoint_reports_each_replicas_requests_in_flight_until_the_exchange_ends(web, engines, token, ends):
    # given a replica holding a stream open (its engine sends the rest only on the test's word)
    service = service_on([engines("a")])
    replica = service.replica_set.get()
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.stream("POST", f"{web}/serve/chat/v1/completions", json={"prompt": "hi", "stream": True},
                      headers=headers, timeout=30) as held:  # fmt: skip
        lines = held.iter_lines()
        next(lines)
        # then the flusher reports one request in flight (the autoscaler's load), and the service's last request
        wait_for(lambda: Replica.objects.filter(pk=replica.pk, outstanding=1, load__gt=0).exists(), timeout=20,
                 what="one request in flight reported")  # fmt: skip
        assert Service.objects.get(pk=service.pk).last_request_at is not None
        if ends == "answered":
            (engines.gate / "go").touch()
    # and none once it has ended: answered, or the client hung up (the endpoint stops relaying while the engine
    # still holds the stream: the word never comes)
    wait_for(lambda: Replica.objects.filter(pk=replica.pk, outstanding=0).exists(), timeout=20,
             what="nothing in flight reported")  # fmt: skip
    assert (engines.gate / "go").exists() == (ends == "answered")
