"""Websocket consumers against the real ASGI app and the real Redis channel layer."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.test import Client

from jobs.events import publish_job
from jobs.models import Job
from ugro_site.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)


def headers(cookie: str = "") -> list[tuple[bytes, bytes]]:
    out = [(b"origin", b"http://localhost"), (b"host", b"localhost")]
    if cookie:
        out.append((b"cookie", cookie.encode()))
    return out


def session_cookie() -> str:
    client = Client()
    client.force_login(User.objects.create_user("alice", password="pw-alice-123"))
    return f"sessionid={client.cookies['sessionid'].value}"


async def connect(path: str, cookie: str = "") -> tuple[WebsocketCommunicator, bool, object]:
    communicator = WebsocketCommunicator(application, path, headers=headers(cookie))
    connected, code = await communicator.connect(timeout=5)
    return communicator, connected, code


def test_anonymous_websockets_are_closed():
    job = Job.objects.create(name="demo", script="s.py")

    async def run():
        for path in (f"/ws/jobs/{job.pk}/", "/ws/cluster/"):
            communicator, connected, code = await connect(path)
            assert not connected and code == 4401, path
            await communicator.disconnect()

    async_to_sync(run)()


def test_logged_in_user_gets_the_jobs_published_events():
    job = Job.objects.create(name="demo", script="s.py")
    cookie = session_cookie()

    async def run():
        job_ws, connected, _ = await connect(f"/ws/jobs/{job.pk}/", cookie)
        assert connected
        cluster_ws, connected, _ = await connect("/ws/cluster/", cookie)
        assert connected
        # when the follower publishes lines and a state change (through the real Redis layer)
        payload = {"rank": 1, "lines": ["<script>x</script>"], "points": [[1, 3, "loss", 2.5]]}
        await sync_to_async(publish_job)(job, "lines", payload)
        job.state = Job.State.RUNNING
        await sync_to_async(publish_job)(job, "state", {"state": "running", "reason": ""})
        # then the job's socket relays both, the cluster socket the state summary
        assert await job_ws.receive_json_from(timeout=5) == {"kind": "lines", "data": payload}
        assert await job_ws.receive_json_from(timeout=5) == {
            "kind": "state",
            "data": {"state": "running", "reason": ""},
        }
        assert await cluster_ws.receive_json_from(timeout=5) == {
            "kind": "job",
            "data": {"job": "demo", "state": "running"},
        }
        await job_ws.disconnect()
        await cluster_ws.disconnect()

    async_to_sync(run)()


def test_another_jobs_events_are_not_relayed():
    mine, other = Job.objects.create(name="mine", script="s.py"), Job.objects.create(name="other", script="s.py")
    cookie = session_cookie()

    async def run():
        ws, connected, _ = await connect(f"/ws/jobs/{mine.pk}/", cookie)
        assert connected
        await sync_to_async(publish_job)(other, "lines", {"rank": 0, "lines": ["not yours"], "points": []})
        assert await ws.receive_nothing(timeout=0.5)
        await ws.disconnect()

    async_to_sync(run)()


def test_an_idle_websocket_stays_open_and_still_relays():
    job = Job.objects.create(name="quiet", script="s.py")
    cookie = session_cookie()

    async def run():
        ws, connected, _ = await connect(f"/ws/jobs/{job.pk}/", cookie)
        assert connected
        # given nothing is published for longer than the layer's 5 s receive wait
        assert await ws.receive_nothing(timeout=7, interval=0.5)
        # then the socket is still open and the next event arrives
        await sync_to_async(publish_job)(job, "state", {"state": "running", "reason": ""})
        event = await ws.receive_json_from(timeout=5)
        assert event["kind"] == "state"
        await ws.disconnect()

    async_to_sync(run)()
