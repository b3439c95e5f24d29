"""Locks that keep two workers from acting on the same thing at once: PostgreSQL advisory locks, held by
the session of the connection that acts, so a worker that dies lets go with its connection (no lease to
lapse). Used where acting twice at once is wasteful or confusing (one SIGKILL round per job, one reconcile
pass at a time); every action is still safe to repeat afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection

RECONCILE = 1  # one reconciler pass over all jobs at a time, across every worker
TEARDOWN = 2  # one teardown of a given job at a time (its TERM, grace, KILL and final state)


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
