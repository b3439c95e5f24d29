"""Sending events to the channel layer from synchronous code without waiting for Redis.

`async_to_sync(layer.group_send)` from a worker thread starts a thread and an event loop and opens a
Redis connection for every call (5 ms of CPU each, measured: 0.45 ms through one loop that lives on).
A follower publishing every rank's lines on every pass spent most of its CPU there. Instead, each
process has one publishing thread with one event loop (so channels_redis keeps its connection pool)
that sends the queued events one after another, in the order they were queued: a page sees a rank's
lines in order, and a state change after the lines that preceded it.

Best effort, as before: the database is the record, and a page that reconnects reloads from it. At most
MAX_PENDING events wait; beyond that (Redis down or far behind) new ones are dropped, counted and
logged once per outage. `flush()` waits for what is queued (at exit, for CLI followers).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
from typing import Any

from channels.layers import get_channel_layer

log = logging.getLogger(__name__)
MAX_PENDING = 2000
SEND_TIMEOUT_S = 5.0
FLUSH_AT_EXIT_S = 5.0


class Publisher:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.lock = threading.Condition()
        self.pending = 0
        self.dropped = 0
        self.failing = False
        self.queue: asyncio.Queue[tuple[str, dict[str, Any]]] | None = None
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), name="ugro-publish", daemon=True)
        self.thread.start()
        ready.wait(5)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.queue = asyncio.Queue()
        self.loop.call_soon(ready.set)
        self.loop.run_until_complete(self._drain())

    def submit(self, group: str, message: dict[str, Any]) -> bool:
        """Queue one group_send; False if it was dropped (too many waiting)."""
        with self.lock:
            if self.pending >= MAX_PENDING:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("channel layer is behind: %d events waiting; dropping new ones", self.pending)
                return False
            self.pending += 1
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (group, message))
        return True

    async def _drain(self) -> None:
        while True:
            group, message = await self.queue.get()
            try:
                layer = get_channel_layer()  # looked up each time: tests swap CHANNEL_LAYERS
                if layer is not None:
                    await asyncio.wait_for(layer.group_send(group, message), SEND_TIMEOUT_S)
                if self.failing or self.dropped:
                    log.info("channel layer keeps up again (%d events dropped meanwhile)", self.dropped)
                self.failing = False
                with self.lock:
                    self.dropped = 0
            except Exception as exc:  # Redis down: one line per outage, not one per event
                if not self.failing:
                    log.warning("publishing to the channel layer failed: %s", exc)
                self.failing = True
            finally:
                with self.lock:
                    self.pending -= 1
                    if self.pending == 0:
                        self.lock.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued event was sent (or failed); False if time ran out."""
        with self.lock:
            return self.lock.wait_for(lambda: self.pending == 0, timeout)


_publisher: Publisher | None = None
_publisher_lock = threading.Lock()


def publisher() -> Publisher:
    """This process's publisher (a forked child starts its own: threads do not survive a fork)."""
    global _publisher
    with _publisher_lock:
        if _publisher is None or _publisher.pid != os.getpid():
            _publisher = Publisher()
        return _publisher


def send(group: str, message: dict[str, Any]) -> bool:
    """Queue a group_send to the channel layer; never raises, never waits for Redis."""
    return publisher().submit(group, message)


def flush(timeout: float = FLUSH_AT_EXIT_S) -> bool:
    """Wait for queued events (nothing to do if this process never published)."""
    if _publisher is None or _publisher.pid != os.getpid():
        return True
    return _publisher.flush(timeout)


atexit.register(flush)
