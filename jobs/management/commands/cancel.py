from __future__ import annotations

from django.core.management.base import CommandError

from accounts import actions, policy
from accounts.commands import UserCommand
from jobs import lifecycle
from jobs.report import get_job
from ugro_site.celery import NoWorker, require_worker


class Command(UserCommand):
    action = "cancel"
    help = "Cancel a job: every process of every rank on every node is stopped (TERM, then KILL)."

    def add_arguments(self, parser):
        parser.add_argument("name")

    def handle(self, name, **options):
        job = get_job(name)
        try:
            if job.is_live or job.is_stopping:
                require_worker()  # its processes are the worker's to stop
            job = actions.cancel(self.user, job, self.source)
        except (ValueError, policy.Refused, NoWorker) as exc:
            raise CommandError(str(exc)) from None
        job = lifecycle.wait_final(job)
        if job.is_stopping:
            raise CommandError(f"job {job.name} is {job.state}: its processes are still being stopped")
        if job.state != "cancelled":
            raise CommandError(f"job {job.name} {job.state} before it could be cancelled")
        if "not confirmed stopped" in job.failure_reason:
            raise CommandError(f"job {job.name} cancelled, but {job.failure_reason.split('; ', 1)[1]}")
        self.stdout.write(f"job {job.name} cancelled; no process of it remains on its nodes")
