from __future__ import annotations

from django.core.management.base import CommandError

from accounts import actions, policy
from accounts.commands import UserCommand
from jobs.recovery import RecoveryError
from jobs.report import get_job
from jobs.scheduler import hand_to_worker
from ugro_site.celery import NoWorker, require_worker


class Command(UserCommand):
    action = "resume"
    help = "Resume a failed or cancelled job as its next attempt, from a checkpoint (same name, same curve)."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument(
            "--from", dest="wanted", default="latest",
            help="checkpoint step to resume from, 'latest' (default) or 'scratch'",
        )  # fmt: skip
        parser.add_argument("--node", action="append", default=[], dest="nodes", help="a node to use (repeatable)")
        parser.add_argument("--nodes", dest="node_list", default="", help="nodes to use, comma-separated")
        parser.add_argument("--detach", action="store_true", help="queue it and return (default: start it now)")

    def handle(self, name, wanted="latest", nodes=None, node_list="", detach=False, **options):
        job = get_job(name)
        names = list(nodes or []) + [n.strip() for n in node_list.split(",") if n.strip()]
        try:
            require_worker()
            job = actions.resume(self.user, job, wanted, names or None, self.source)
        except (RecoveryError, policy.Refused, NoWorker) as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"job {job.name} queued as attempt {job.attempt}: {job.recovery_note}")
        if detach:
            return
        job = hand_to_worker(job)
        where = ", ".join(f"rank {r.index} on {r.node.name}" for r in job.ranks.select_related("node"))
        self.stdout.write(f"job {job.name} {job.state}" + (f": {where}" if where else ""))
        if job.state == job.State.FAILED:
            raise CommandError(f"job {job.name} attempt {job.attempt} failed: {job.failure_reason}")
