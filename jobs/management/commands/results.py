from __future__ import annotations

import json

from accounts.commands import UserCommand
from jobs.report import get_job, results, results_record


class Command(UserCommand):
    help = "Show a job's results: config, duration, exit codes, final loss, checkpoints, log files."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--json", action="store_true", dest="as_json", help="Machine-readable output.")

    def handle(self, name, as_json=False, **options):
        job = get_job(name)
        if as_json:
            self.stdout.write(json.dumps(results_record(job), indent=2))
            return
        for row in results(job):
            self.stdout.write(row)
