"""Locks that keep two workers from acting on the same thing at once: PostgreSQL advisory locks, held by
the session of the connection that acts, so a worker that dies lets go with its connection (no lease to
lapse, and no transaction left open while the holder waits on a node). Used where acting twice at once is
wasteful or confusing (one SIGKILL round per job, one loop acting on a job at a time); every action is
still safe to repeat afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager

from django.db import connection

TEARDOWN = 2  # one teardown of a given job at a time (its TERM, grace, KILL and final state)
PASS = 3  # a periodic pass of a loop holds one of its few slots (jobs/reconcile.py PASSES_AT_ONCE)
# One loop acting on a given job at a time (jobs/loops/): the kind names the loop, the key the job, so two
# workers run the same loop side by side on different jobs, and different loops never wait for each other.
STARTS = 11
RUNNING = 12
STOPPING = 13
ENDED = 14
RETRIES = 15
ORPHANS = 16  # keyed by the node: one orphan scan of a node at a time
SWEEP = 17  # keyed by the sweep: one median-stop judgment of a sweep at a time
# Held by the launcher of a job while it starts the job's ranks: a teardown (a cancel during the start) waits
# for it to let go, so that it stops every process the launch started, not those started before it looked
LAUNCH = 18
RETENTION = 19  # keyed by the job: one retention pass of a job at a time (jobs/retention.py)
CACHE = 20  # keyed by a store (its first node's pk, 0 the controller's): one trim of a store at a time (jobs/cache.py)


@contextmanager
def held(kind: int, key: int = 0, wait: bool = False) -> Iterator[bool]:
    """Take the (kind, key) lock for the block; yields whether it is held (always True with wait=True,
    which blocks until the holder lets go)."""
    args = [kind, key % 2**31]
    with connection.cursor() as cursor:
        if wait:
            cursor.execute("SELECT pg_advisory_lock(%s, %s)", args)
            got = True
        else:
            cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", args)
            got = bool(cursor.fetchone()[0])
    try:
        yield got
    finally:
        if got:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s, %s)", args)


def wait_free(kind: int, key: int, timeout: float, poll: float = 0.05) -> bool:
    """Wait (up to timeout) until nobody holds the (kind, key) lock; True if nobody did by then. Not taken:
    only waited for, and bounded, since its holder may be busy for long (unlike pg_advisory_lock)."""
    deadline = time.monotonic() + timeout
    while True:
        with held(kind, key) as got:
            if got:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)


@contextmanager
def held_each(kind: int, keys: Iterable[int], wait: bool = False) -> Iterator[list[int]]:
    """Take the (kind, key) lock of each key for the block; yields the keys held (every one with wait=True).
    Taken in ascending order, so two waiting holders of overlapping sets cannot deadlock."""
    with ExitStack() as stack:
        yield [key for key in sorted(set(keys)) if stack.enter_context(held(kind, key, wait))]


@contextmanager
def held_any(kind: int, keys: Iterable[int]) -> Iterator[int | None]:
    """Take the first free one of the (kind, key) locks, without waiting; yields its key, or None when
    every one is held."""
    for key in keys:
        with held(kind, key) as got:
            if got:
                yield key
                return
    yield None
