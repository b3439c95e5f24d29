from __future__ import annotations

import json

from accounts.commands import UserCommand
from jobs.energy import energy_records
from jobs.report import job_summary, queue_table
from jobs.snapshot import Snapshot, holders_by_job, queue


class Command(UserCommand):
    help = "Waiting jobs in the order they will start: position, why each waits, estimated start; and who holds GPUs."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", dest="as_json", help="Machine-readable output.")

    def handle(self, as_json=False, **options):
        snap = Snapshot()
        entries = queue(snap)
        holders = holders_by_job(snap)
        if as_json:
            energy = energy_records([e.job for e in entries])
            rows = [
                {
                    "position": e.decision.position,
                    **job_summary(e.job, energy=energy[e.job.pk]),
                    "starts_now": e.decision.start,
                    "reason": None if e.decision.start else e.decision.reason,
                    "detail": e.decision.detail,
                    "estimated_start": e.est_start.isoformat() if e.est_start else None,
                    "gpus": e.placement_text() or None,
                }
                for e in entries
            ]
            self.stdout.write(json.dumps({"queue": rows, "holding": holders}, indent=2))
            return
        if not entries:
            self.stdout.write("queue is empty")
            if not holders:
                return
        for row in queue_table(entries, holders) if entries else queue_table([], holders)[1:]:
            self.stdout.write(row)
