from __future__ import annotations

from django.core.management.base import BaseCommand

from jobs.report import get_job, results


class Command(BaseCommand):
    help = "Show a job's results: config, duration, exit codes, final loss, checkpoints, log files."

    def add_arguments(self, parser):
        parser.add_argument("name")

    def handle(self, name, **options):
        for row in results(get_job(name)):
            self.stdout.write(row)
