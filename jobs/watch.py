"""A command that follows its own job: copy its logs and, with no worker running, reconcile it too.

`launch` (attached) and `logs --follow` run this on a background thread, so that a job started with
no worker still ends, releases its nodes and has its failure explained before the command returns.
"""

from __future__ import annotations

import logging
import threading

from django.db import connections

from ugro_site.celery import worker_alive

from .follow import follow, follower_id
from .models import Job
from .reconcile import reconcile

log = logging.getLogger(__name__)


class JobWatch:
    """Follows one job on a daemon thread until stopped; reconciles it when no worker would."""

    def __init__(self, job: Job, who: str, reconcile_every: float = 2.0) -> None:
        self.job = job
        self.owner = f"{follower_id()}:{who}"
        self.reconcile_every = reconcile_every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"watch-{job.pk}", daemon=True)

    def start(self) -> JobWatch:
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                follow(self.reconcile_every, job_ids=[self.job.pk], owner=self.owner, idle_sleep=0.2)
                if not worker_alive():
                    try:
                        reconcile([self.job.pk], orphans=False)
                    except Exception:  # keep following; the next pass tries again
                        log.exception("reconciling %s failed", self.job.name)
                self.stop.wait(0.1)
        finally:
            connections.close_all()

    def close(self, timeout: float = 5.0) -> None:
        self.stop.set()
        self.thread.join(timeout=timeout)

    def settled(self) -> bool:
        """The job reached its final state and every rank's output that can be copied was."""
        job = Job.objects.get(pk=self.job.pk)
        return job.is_ended and not job.ranks.filter(state="running").exists()
