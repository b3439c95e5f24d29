from __future__ import annotations

import json

from accounts.commands import UserCommand
from jobs.report import job_summary, jobs_table
from jobs.scheduler import queued_jobs


class Command(UserCommand):
    help = "List queued jobs in the order they will start."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", dest="as_json", help="Machine-readable output.")

    def handle(self, as_json=False, **options):
        jobs = queued_jobs()
        if as_json:
            entries = [{"position": i, **job_summary(job)} for i, job in enumerate(jobs, start=1)]
            self.stdout.write(json.dumps({"queue": entries}, indent=2))
            return
        if not jobs:
            self.stdout.write("queue is empty")
            return
        for i, row in enumerate(jobs_table(jobs)):
            self.stdout.write(("    " if i == 0 else f"{i:>3} ") + row)
