"""Sending events to the channel layer from synchronous code, cheaply.

`async_to_sync(layer.group_send)` from a worker thread starts a thread and an event loop and opens a
Redis connection for every call: 5 ms of CPU each (measured), where a follower publishes every rank's
lines on every pass. Here each thread keeps one event loop of its own for the life of the thread, so
channels_redis keeps its connections (0.45 ms a send, measured), and the send stays synchronous: the
caller's events leave in its order, and a follower cannot outrun the viewers.

Not one publishing thread per process with a queue: that takes the wait off the follower, which can then
read faster than one thread can send at tens of thousands of lines a second, so events fall behind and are
dropped once the queue is full.

Best effort: the database is the record, and a page that reconnects reloads from it. After a
failed send this thread skips sending for RETRY_AFTER_S, so a Redis outage costs a follower one timeout,
not one per event, and is logged once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from channels.layers import get_channel_layer

log = logging.getLogger(__name__)
SEND_TIMEOUT_S = 3.0
RETRY_AFTER_S = 1.0

_local = threading.local()
_outage = threading.Event()  # set while sends fail (any thread): log the outage and its end once


def _thread_loop() -> asyncio.AbstractEventLoop:
    loop = getattr(_local, "loop", None)
    if loop is None or loop.is_closed():
        loop = _local.loop = asyncio.new_event_loop()
    return loop


def send(group: str, message: dict[str, Any]) -> bool:
    """group_send to the channel layer; never raises. False if it was not sent."""
    if time.monotonic() < getattr(_local, "skip_until", 0.0):
        return False
    layer = get_channel_layer()
    if layer is None:
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:  # sync code called straight from async code: it must go through sync_to_async
        log.debug("not publishing to %s from inside an event loop", group)
        return False
    try:
        _thread_loop().run_until_complete(asyncio.wait_for(layer.group_send(group, message), SEND_TIMEOUT_S))
    except Exception as exc:  # Redis down must not stop following: the next page load rebuilds the view
        _local.skip_until = time.monotonic() + RETRY_AFTER_S
        if not _outage.is_set():
            _outage.set()
            log.warning("publishing to the channel layer failed (events are skipped until it answers): %s", exc)
        return False
    if _outage.is_set():
        _outage.clear()
        log.info("publishing to the channel layer works again")
    return True
