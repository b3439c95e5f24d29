"""Websocket consumers: join a group, relay its events to the browser as JSON. They do no work."""

from __future__ import annotations

import logging
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from redis.exceptions import RedisError

from accounts import policy

from .events import job_group

log = logging.getLogger(__name__)

# The close code a page gets while the channel layer (Redis) is down. RFC 6455's "try again later" is
# 1013, but daphne's websocket library sends only 1000 and 3000-4999 (it raises on anything else, and
# the page would never hear of the close): 4013 is ours, in the range for applications.
TRY_AGAIN_LATER = 4013


class RelayConsumer(AsyncJsonWebsocketConsumer):
    """Relays one channel-layer group to a browser whose user may view (accounts.policy); others are closed:
    4401 anonymous, 4403 refused."""

    group = ""

    async def __call__(self, scope, receive, send) -> None:
        """Redis down (at connect or mid-stream): one warning line and a close with 4013 (try again later),
        which the page answers by reconnecting, instead of an HTTP 500 or a 1011 with a traceback per viewer."""
        try:
            await super().__call__(scope, receive, send)
        except (RedisError, OSError) as exc:
            log.warning("websocket %s closed: the channel layer is unreachable (%s)", scope.get("path"), exc)
            try:
                await send({"type": "websocket.close", "code": TRY_AGAIN_LATER})
            except Exception:  # the client went too; nothing is left to tell
                pass

    def group_name(self) -> str:
        return self.group

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        if not await database_sync_to_async(policy.allowed)(user, "view"):
            await self.close(code=4403)
            return
        self.joined = self.group_name()
        await self.channel_layer.group_add(self.joined, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if getattr(self, "joined", ""):
            await self.channel_layer.group_discard(self.joined, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """Browsers only listen; anything they send is ignored."""

    async def relay(self, event: dict[str, Any]) -> None:
        await self.send_json({"kind": event.get("kind"), "data": event.get("data")})


class JobConsumer(RelayConsumer):
    """/ws/jobs/<id>/: a job's log lines, metric points and state changes."""

    def group_name(self) -> str:
        return job_group(self.scope["url_route"]["kwargs"]["job_id"])

    async def job_event(self, event: dict[str, Any]) -> None:
        text = event.get("text")
        if text is None:
            await self.relay(event)
        else:  # encoded once by the publisher (jobs/events.py), sent to every viewer as it is
            await self.send(text_data=text)


class ClusterConsumer(RelayConsumer):
    """/ws/cluster/: node status, GPU readings and job states for the overview and the jobs board."""

    group = "cluster"

    async def cluster_event(self, event: dict[str, Any]) -> None:
        await self.relay(event)
