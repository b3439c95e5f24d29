from __future__ import annotations

import threading
import time

from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from jobs.follow import follow, follower_id
from jobs.logs import job_lines, rank_lines
from jobs.report import get_job


class Command(BaseCommand):
    help = "Show a job's logs: one rank, or all ranks merged in arrival order, rank-prefixed."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--rank", type=int)
        parser.add_argument("--tail", type=int, help="only the last N lines")
        parser.add_argument("--follow", "-f", action="store_true", help="keep printing new lines")

    def handle(self, name, rank=None, tail=None, follow=False, **options):
        job = get_job(name)
        if rank is not None and not job.ranks.filter(index=rank).exists():
            raise CommandError(f"job {job.name} has no rank {rank} (ranks 0-{job.ranks.count() - 1})")
        for line in job_lines(job, rank, tail):
            self.stdout.write(line.text if rank is not None else line.prefixed())
        if follow:
            try:
                self._follow(job, rank)
            except KeyboardInterrupt:
                pass

    def _follow(self, job, rank_index):
        stop = threading.Event()
        owner = follower_id() + ":logs"

        def keep_following():
            while not stop.is_set():
                follow(2.0, job_ids=[job.pk], owner=owner)
                stop.wait(0.5)
            connections.close_all()

        threading.Thread(target=keep_following, daemon=True).start()
        offsets = {r.index: r.log_offset for r in job.ranks.all()}
        try:
            while True:
                job.refresh_from_db()
                for r in job.ranks.order_by("index"):
                    if rank_index is not None and r.index != rank_index:
                        continue
                    for end, line in rank_lines(r, offsets.get(r.index, 0)):
                        self.stdout.write(line.text if rank_index is not None else line.prefixed())
                        offsets[r.index] = end
                if job.is_ended:
                    self.stdout.write(f"-- job {job.name} {job.state}")
                    return
                time.sleep(0.3)
        finally:
            stop.set()
