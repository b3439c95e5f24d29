from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from jobs.report import get_job
from jobs.stop import cancel_job


class Command(BaseCommand):
    help = "Cancel a job: every process of every rank on every node is stopped (TERM, then KILL)."

    def add_arguments(self, parser):
        parser.add_argument("name")

    def handle(self, name, **options):
        job = get_job(name)
        try:
            job, unclean = cancel_job(job)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if unclean:
            raise CommandError(f"job {job.name} cancelled, but not confirmed clean on: {'; '.join(unclean)}")
        self.stdout.write(f"job {job.name} cancelled; no process of it remains on its nodes")
