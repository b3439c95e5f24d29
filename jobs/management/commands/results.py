from __future__ import annotations

from accounts.commands import UserCommand
from jobs.report import get_job, results


class Command(UserCommand):
    help = "Show a job's results: config, duration, exit codes, final loss, checkpoints, log files."

    def add_arguments(self, parser):
        parser.add_argument("name")

    def handle(self, name, **options):
        for row in results(get_job(name)):
            self.stdout.write(row)
