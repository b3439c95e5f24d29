from __future__ import annotations

from django.core.management.base import BaseCommand

from cluster import monitor


class Command(BaseCommand):
    help = "Run the health monitor in the foreground (for setups without Celery beat)."

    def add_arguments(self, parser):
        parser.add_argument("--seconds", type=float, default=float("inf"), help="Stop after this long.")
        parser.add_argument("--tick", type=float, default=5.0, help="Seconds between monitor steps.")

    def handle(self, seconds, tick, **options):
        polls = monitor.run(seconds, tick)
        self.stdout.write(f"{polls} monitor steps")
