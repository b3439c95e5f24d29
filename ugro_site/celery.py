"""The Celery app: tasks are thin and live in each app's tasks.py."""

from __future__ import annotations

import logging
import os
import time

from celery import Celery, signals
from celery.beat import Scheduler

from ugro_site.env import private_umask

private_umask()  # worker and beat write job logs and metric files into the data directory
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugro_site.settings")

app = Celery("ugro")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def broker_answers(timeout: float = 0.3) -> bool:
    """Whether the broker accepts connections now (Celery's own publish retries for seconds if not)."""
    import socket
    from urllib.parse import urlsplit

    from django.conf import settings

    url = urlsplit(settings.CELERY_BROKER_URL)
    try:
        with socket.create_connection((url.hostname or "127.0.0.1", url.port or 6379), timeout=timeout):
            return True
    except OSError:
        return False


def send_task(name: str, *args) -> bool:
    """Queue a task by name if the broker answers; False (never an exception) when it does not.

    By name, so that domain modules can queue work without importing the tasks module above them.
    Whoever needed the task also has a fallback: the reconciler repeats what was never queued.
    """
    import logging

    if not broker_answers():
        return False
    try:
        app.send_task(name, args=list(args), retry=False)
    except Exception as exc:  # the broker went away in between
        logging.getLogger(__name__).info("could not queue %s: %s", name, exc)
        return False
    return True


# A worker says it is alive through a short-lived Redis key. The worker is the only executor of job work
# (starting, following, judging, stopping): a command or page submits and reads, and a command that would
# need a worker and finds none refuses in one line (require_worker).
HEARTBEAT_KEY = "ugro:worker-alive"
HEARTBEAT_TTL_S = 10


def _redis(timeout: float = 0.3):
    import redis
    from django.conf import settings

    return redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_timeout=timeout, socket_connect_timeout=timeout)


def worker_alive() -> bool:
    """Whether a UGRO worker has said it is alive in the last few seconds."""
    if not broker_answers():
        return False
    try:  # it listens: give its answer longer than the connect (a loaded 2-core controller can take 0.3 s)
        return bool(_redis(timeout=2.0).exists(HEARTBEAT_KEY))
    except Exception:  # no answer is the same as no worker
        return False


NO_WORKER = "no UGRO worker is running: start it with bin/start"
_heartbeat: list = []  # this process's heartbeat: (stop event, thread)


class NoWorker(RuntimeError):
    """Job work was asked of a deployment with no worker to do it (commands only submit and read)."""


def require_worker() -> None:
    """NoWorker (one line) unless a worker has said it is alive: commands never do a job's work themselves."""
    if not worker_alive():
        raise NoWorker(NO_WORKER)


# A worker thread keeps its database connection from one task to the next, as a web server does from one
# request to the next with CONN_MAX_AGE: a new PostgreSQL backend for every task (the beat sends a few a
# second) cost the server a process start each and the worker a login. Closed when older than this, after an
# error that left it unusable, or when a health check at the next task finds it dead (a restarted server).
WORKER_DB_MAX_AGE_S = 300


def keep_db_connections(max_age: float | None = WORKER_DB_MAX_AGE_S) -> dict:
    """This process's connections kept up to max_age seconds (0: closed after each task, Django's default), with
    a health check before reuse; returns the settings it replaced, for tests that run a worker in their own
    process and put them back."""
    from django.db import connections

    before = {}
    for alias in connections:
        conf = connections.settings[alias]
        before[alias] = {key: conf.get(key) for key in ("CONN_MAX_AGE", "CONN_HEALTH_CHECKS")}
        conf.update(CONN_MAX_AGE=max_age, CONN_HEALTH_CHECKS=bool(max_age))
    return before


@signals.worker_init.connect
def _worker_keeps_db_connections(**kwargs) -> None:
    keep_db_connections()


@signals.task_prerun.connect
@signals.task_postrun.connect
def _db_connections_checked(sender=None, **kwargs) -> None:
    """Around each task, as around each web request: this thread's connection closed if too old or broken
    (with the default CONN_MAX_AGE of 0, always, as Celery's fixup did); not around a task run in its caller's
    thread (eagerly), whose connection is the caller's."""
    from django.db import connections

    if getattr(getattr(sender, "request", None), "is_eager", False):
        return
    for conn in connections.all(initialized_only=True):
        conn.close_if_unusable_or_obsolete()


@signals.worker_ready.connect
def _start_heartbeat(**kwargs) -> None:
    import threading

    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                _redis().set(HEARTBEAT_KEY, f"{os.uname().nodename}:{os.getpid()}", ex=HEARTBEAT_TTL_S)
            except Exception:  # Redis away for a moment: say it again next time
                pass
            stop.wait(HEARTBEAT_TTL_S / 3)

    thread = threading.Thread(target=beat, name="ugro-heartbeat", daemon=True)
    thread.start()
    _heartbeat.append((stop, thread))


@signals.worker_shutdown.connect
def _stop_heartbeat(**kwargs) -> None:
    while _heartbeat:
        stop, thread = _heartbeat.pop()
        stop.set()
        thread.join(timeout=2)  # so that no last beat says it again after the key is gone
    try:
        _redis().delete(HEARTBEAT_KEY)
    except Exception:  # it expires by itself
        pass


# Beat runs inside every worker, on a thread, so that a worker never runs without its schedule; a Redis lock
# makes exactly one of them fire at a time, and another takes over within SCHEDULER_TTL_S of its holder's end.
SCHEDULER_KEY = "ugro:scheduler"
SCHEDULER_TTL_S = 15
STANDBY_TICK_S = 2.0
NO_SCHEDULER = (
    "no scheduler running: queued jobs do not start and running ones are not followed or reconciled "
    "(start a worker: bin/start)"
)


def scheduler_alive() -> bool:
    """Whether some worker's scheduler holds the lock now (None of them: nothing is queued on schedule)."""
    if not broker_answers():
        return False
    try:
        return bool(_redis().exists(SCHEDULER_KEY))
    except Exception:  # no answer is the same as no scheduler
        return False


_embedded = []


@signals.worker_ready.connect
def _start_scheduler(**kwargs) -> None:
    """Every worker runs beat on a thread; LockedScheduler lets one of them fire."""
    from celery.beat import EmbeddedService

    if app.conf.beat_scheduler != f"{__name__}:LockedScheduler":
        return  # a deployment with a beat of its own
    service = EmbeddedService(app, thread=True, scheduler_cls=LockedScheduler)
    service.start()
    _embedded.append(service)


@signals.worker_shutdown.connect
def _stop_scheduler(**kwargs) -> None:
    for service in _embedded:
        service.stop()  # releases the lock (LockedScheduler.close): another worker fires at once


class LockedScheduler(Scheduler):
    """Beat's in-memory scheduler that fires only while it holds the deployment's scheduler lock, and says
    one line when the broker goes away and one when it is back, instead of a ~150-line traceback on every
    tick of every entry while Redis is down."""

    _broker_down_since: float | None = None
    _lock = None
    _client = None

    def tick(self, *args, **kwargs):
        if not self._hold():
            return STANDBY_TICK_S
        return super().tick(*args, **kwargs)

    def _hold(self) -> bool:
        """Take the lock, or renew it while held (a lock lost to a Redis restart is taken anew)."""
        import uuid

        try:
            if self._client is None:
                self._client = _redis(timeout=1.0)
            if self._lock is not None:
                self._lock.reacquire()
                return True
            lock = self._client.lock(SCHEDULER_KEY, timeout=SCHEDULER_TTL_S, thread_local=False)
            if lock.acquire(blocking=False, token=f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"):
                self._lock = lock
                logging.getLogger("ugro.beat").warning("this worker's scheduler fires the periodic tasks now")
                return True
        except Exception:  # Redis away or the lock taken over meanwhile: stand by, try again next tick
            self._lock = None
        return False

    def close(self) -> None:
        if self._lock is not None:
            try:
                self._lock.release()  # the next worker's scheduler takes over at once
            except Exception:  # it expires by itself
                pass
            self._lock = None
        super().close()

    def apply_entry(self, entry, producer=None):
        logger = logging.getLogger("ugro.beat")
        if not broker_answers():
            if self._broker_down_since is None:
                self._broker_down_since = time.monotonic()
                logger.warning("broker unreachable: scheduled tasks wait until it is back")
            return
        if self._broker_down_since is not None:
            logger.warning("broker back after %.0fs", time.monotonic() - self._broker_down_since)
            self._broker_down_since = None
        try:
            self.apply_async(entry, producer=producer, advance=False)
        except Exception as exc:  # it went away between the check and the send: the next tick retries
            logger.warning("could not send %s: %s", entry.task, exc)
