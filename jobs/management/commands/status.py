from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from jobs.models import Job
from jobs.report import get_job, job_detail, jobs_table


class Command(BaseCommand):
    help = "Show jobs (or one job in detail). Exit code 1 if the named job failed or was cancelled."

    def add_arguments(self, parser):
        parser.add_argument("name", nargs="?")
        parser.add_argument("--limit", type=int, default=20)

    def handle(self, name=None, limit=20, **options):
        if not name:
            jobs = list(Job.objects.prefetch_related("ranks__node")[:limit])
            for row in jobs_table(jobs):
                self.stdout.write(row)
            return
        job = get_job(name)
        for row in job_detail(job):
            self.stdout.write(row)
        if job.state in (Job.State.FAILED, Job.State.CANCELLED):
            raise CommandError(f"job {job.name} {job.state}")
