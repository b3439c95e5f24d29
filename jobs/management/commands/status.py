from __future__ import annotations

import json

from django.core.management.base import CommandError

from accounts.commands import UserCommand
from jobs.energy import energy_records
from jobs.models import Job
from jobs.report import get_job, job_detail, job_progress, job_record, job_summary, jobs_table

# --exit-code: the job's state as the exit status, for scripts that wait on a job.
EXIT_CODES = {Job.State.SUCCEEDED: 0, Job.State.FAILED: 1, Job.State.CANCELLED: 2}
NOT_ENDED_EXIT = 3


class Command(UserCommand):
    help = (
        "Show recent jobs as a table (name, state, progress, nodes, age, owner), or one job in detail. "
        "Exits 1 if the named job FAILED. With --exit-code the exit status is the job's state: "
        "0 succeeded, 1 failed, 2 cancelled, 3 not ended yet."
    )

    def add_arguments(self, parser):
        parser.add_argument("name", nargs="?")
        parser.add_argument("--limit", type=int, default=20)
        parser.add_argument("--exit-code", action="store_true", dest="exit_code",
                            help="exit 0 succeeded, 1 failed, 2 cancelled, 3 not ended")  # fmt: skip
        parser.add_argument("--json", action="store_true", dest="as_json", help="Machine-readable output.")

    def handle(self, name=None, limit=20, exit_code=False, as_json=False, **options):
        if not name:
            if exit_code:
                raise CommandError("--exit-code needs a job name")
            if limit < 1:
                raise CommandError("--limit must be at least 1")
            jobs = list(Job.objects.select_related("owner", "current").prefetch_related("current__ranks__node")[:limit])
            prog = {job.pk: job_progress(job) for job in jobs}
            if as_json:
                energy = energy_records(jobs)
                rows = [job_summary(j, prog[j.pk], energy[j.pk]) for j in jobs]
                self.stdout.write(json.dumps({"jobs": rows}, indent=2))
                return
            for row in jobs_table(jobs, prog):
                self.stdout.write(row)
            return
        job = get_job(name)
        if as_json:
            self.stdout.write(json.dumps(job_record(job), indent=2))
        else:
            for row in job_detail(job):
                self.stdout.write(row)
        if exit_code:
            code = EXIT_CODES.get(job.state, NOT_ENDED_EXIT)
            if code:
                raise CommandError(f"job {job.name} {job.state}", returncode=code)
            return
        if job.state == Job.State.FAILED:
            raise CommandError(f"job {job.name} failed: {job.failure_reason}")
