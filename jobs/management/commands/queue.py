from __future__ import annotations

from accounts.commands import UserCommand
from jobs.report import jobs_table
from jobs.scheduler import queued_jobs


class Command(UserCommand):
    help = "List queued jobs in the order they will start."

    def handle(self, **options):
        jobs = queued_jobs()
        if not jobs:
            self.stdout.write("queue is empty")
            return
        for i, row in enumerate(jobs_table(jobs)):
            self.stdout.write(("    " if i == 0 else f"{i:>3} ") + row)
