from __future__ import annotations

from django.core.management.base import CommandError

from accounts import actions, policy
from accounts.commands import UserCommand
from jobs import lifecycle
from jobs.report import get_job


class Command(UserCommand):
    action = "cancel"
    help = "Cancel a job: every process of every rank on every node is stopped (TERM, then KILL)."

    def add_arguments(self, parser):
        parser.add_argument("name")

    def handle(self, name, **options):
        job = get_job(name)
        try:
            job = actions.cancel(self.user, job, self.source)
        except (ValueError, policy.Refused) as exc:
            raise CommandError(str(exc)) from None
        if job.is_stopping:
            lifecycle.teardown(job)  # here and now (a worker may be doing the same: both are safe)
            job.refresh_from_db()
        if job.is_stopping:
            raise CommandError(f"job {job.name} is {job.state}: its processes are still being stopped")
        if job.state != "cancelled":
            raise CommandError(f"job {job.name} {job.state} before it could be cancelled")
        if "not confirmed stopped" in job.failure_reason:
            raise CommandError(f"job {job.name} cancelled, but {job.failure_reason.split('; ', 1)[1]}")
        self.stdout.write(f"job {job.name} cancelled; no process of it remains on its nodes")
