from __future__ import annotations

from accounts.commands import UserCommand
from cluster.models import Alert


class Command(UserCommand):
    help = "List open alerts (newest first); --all lists resolved ones and INFO events too."

    def add_arguments(self, parser):
        parser.add_argument("--all", action="store_true", dest="show_all")
        parser.add_argument("--limit", type=int, default=50)

    def handle(self, show_all=False, limit=50, **options):
        alerts = Alert.objects.select_related("node")
        if not show_all:
            alerts = alerts.filter(resolved_at__isnull=True)
        alerts = list(alerts[:limit])
        if not alerts:
            self.stdout.write("no open alerts" if not show_all else "no alerts")
            return
        for a in alerts:
            where = a.node.name if a.node_id else (a.job_name or "cluster")
            state = "open" if a.is_open else f"resolved {a.resolved_at:%Y-%m-%d %H:%M:%S}"
            when = f"{a.opened_at:%Y-%m-%d %H:%M:%S}"
            self.stdout.write(f"{when} {a.severity.upper():<8} {where:<12} {a.message} ({state})")
