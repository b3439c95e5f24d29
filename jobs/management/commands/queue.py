from __future__ import annotations

from django.core.management.base import BaseCommand

from jobs.report import queue_table
from jobs.snapshot import Snapshot, holders_by_job, queue


class Command(BaseCommand):
    help = "Waiting jobs in the order they will start: position, why each waits, estimated start; and who holds GPUs."

    def handle(self, **options):
        snap = Snapshot()
        entries = queue(snap)
        holders = holders_by_job(snap)
        if not entries:
            self.stdout.write("queue is empty")
            if not holders:
                return
        for row in queue_table(entries, holders) if entries else queue_table([], holders)[1:]:
            self.stdout.write(row)
