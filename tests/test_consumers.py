"""Websocket consumers against the real ASGI app and the real Redis channel layer."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.test import Client

from jobs.events import publish_job
from jobs.models import Job
from ugro_site.asgi import application

from .conftest import free_port, redis_server, wait_port

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


def _layer_at(settings, port: int) -> None:
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [f"redis://127.0.0.1:{port}/0"]},
        }
    }


def test_a_page_is_told_to_try_again_later_while_redis_is_down(settings, caplog):
    """Redis down at connect: a close with 4013 (the page reconnects), not an HTTP 500 and a traceback."""
    job = Job.objects.create(name="demo", script="s.py")
    cookie = session_cookie()
    _layer_at(settings, free_port())  # nothing listens there

    async def run():
        communicator, connected, code = await connect(f"/ws/jobs/{job.pk}/", cookie)
        assert not connected and code == 4013
        await communicator.disconnect()

    async_to_sync(run)()
    assert "channel layer is unreachable" in caplog.text


def test_a_connected_page_is_closed_with_4013_when_redis_goes_away(settings, tmp_path):
    """Redis stopped under a connected page: the consumer closes it with 4013 (one warning line)."""
    job = Job.objects.create(name="demo", script="s.py")
    cookie = session_cookie()
    port = free_port()
    redis = subprocess.Popen(
        [redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
    )  # fmt: skip
    try:
        wait_port(port)
        _layer_at(settings, port)

        async def run():
            communicator, connected, _ = await connect(f"/ws/jobs/{job.pk}/", cookie)
            assert connected
            redis.terminate()
            await asyncio.get_running_loop().run_in_executor(None, redis.wait)
            out = await communicator.receive_output(timeout=15)
            assert out == {"type": "websocket.close", "code": 4013}
            # a code daphne's websocket library will send (it raises on others: the close is then lost)
            assert out["code"] == 1000 or 3000 <= out["code"] <= 4999

        async_to_sync(run)()
    finally:
        if redis.poll() is None:
            redis.kill()
            redis.wait()
