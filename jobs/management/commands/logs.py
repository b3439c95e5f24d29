from __future__ import annotations

import json
import time

from django.core.management.base import CommandError

from accounts.commands import UserCommand
from jobs.logs import earlier_attempt, job_lines, job_settled, rank_lines
from jobs.report import get_job
from ugro_site.celery import NO_WORKER, worker_alive


class Command(UserCommand):
    help = "Show a job's logs: one rank, or all ranks merged in arrival order, rank-prefixed."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--rank", type=int)
        parser.add_argument("--tail", type=int, help="only the last N lines")
        parser.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")
        parser.add_argument("--json", action="store_true", dest="as_json",
                            help='one JSON object per line: {"rank", "time", "text"}; with --follow the last is '
                            '{"job", "state", "reason"}')  # fmt: skip
        parser.add_argument("--attempt", type=int, help="an earlier attempt's logs (default: the current one)")

    def handle(self, name, rank=None, tail=None, follow=False, as_json=False, attempt=None, **options):
        self.as_json = as_json
        job = get_job(name)
        if attempt is not None and attempt != job.attempt:
            return self._earlier(job, attempt, rank, tail, follow)
        if rank is not None and not job.ranks.filter(index=rank).exists():
            raise CommandError(f"job {job.name} has no rank {rank} (ranks 0-{job.ranks.count() - 1})")
        if tail is not None and tail < 1:
            raise CommandError("--tail must be at least 1")
        ranks = list(job.ranks.order_by("index"))
        for line in job_lines(job, rank, tail, ranks=ranks):
            self._write(line, rank)
        if follow:
            try:
                self._follow(job, rank, {r.index: r.log_offset for r in ranks})
            except KeyboardInterrupt:
                pass

    def _earlier(self, job, attempt, rank, tail, follow):
        try:
            ranks = earlier_attempt(job, attempt, rank, follow)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if tail is not None and tail < 1:
            raise CommandError("--tail must be at least 1")
        for line in job_lines(job, rank, tail, ranks=ranks):
            self._write(line, rank)

    def _follow(self, job, rank_index, offsets):
        # Only reads the central copies the worker's follower writes: the job goes on without this.
        if not job.is_ended and not worker_alive():
            self.stderr.write(f"{NO_WORKER}: job {job.name} is not followed or judged until one runs")
        while True:
            settled = job_settled(job)
            job.refresh_from_db()
            for r in job.ranks.order_by("index"):
                if rank_index is not None and r.index != rank_index:
                    continue
                for end, line in rank_lines(r, offsets.get(r.index, 0)):
                    self._write(line, rank_index)
                    offsets[r.index] = end
            if settled:
                if self.as_json:
                    end = {"job": job.name, "state": job.state, "reason": job.failure_reason or None}
                    self.stdout.write(json.dumps(end))
                else:
                    self.stdout.write(
                        f"-- job {job.name} {job.state}" + (f": {job.failure_reason}" if job.failure_reason else "")
                    )
                return
            time.sleep(0.3)

    def _write(self, line, rank_index) -> None:
        if self.as_json:
            self.stdout.write(json.dumps({"rank": line.rank, "time": line.time, "text": line.text}))
        else:
            self.stdout.write(line.text if rank_index is not None else line.prefixed())
