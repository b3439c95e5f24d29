from __future__ import annotations

import json

from django.core.management.base import CommandError

from accounts.commands import UserCommand
from cluster.alerts import alert_record
from cluster.models import Alert


class Command(UserCommand):
    help = "List open alerts (newest first); --all lists resolved ones and INFO events too."

    def add_arguments(self, parser):
        parser.add_argument("--all", action="store_true", dest="show_all")
        parser.add_argument("--limit", type=int, default=50)
        parser.add_argument("--json", action="store_true", dest="as_json", help="Machine-readable output.")

    def handle(self, show_all=False, limit=50, as_json=False, **options):
        if limit < 1:
            raise CommandError("--limit must be at least 1")
        alerts = Alert.objects.select_related("node")
        if not show_all:
            alerts = alerts.filter(resolved_at__isnull=True)
        alerts = list(alerts[:limit])
        if as_json:
            self.stdout.write(json.dumps({"alerts": [alert_record(a) for a in alerts]}, indent=2))
            return
        if not alerts:
            self.stdout.write("no open alerts" if not show_all else "no alerts")
            return
        for a in alerts:
            where = a.node.name if a.node_id else (a.job_name or "cluster")
            state = "open" if a.is_open else f"resolved {a.resolved_at:%Y-%m-%d %H:%M:%S}"
            when = f"{a.opened_at:%Y-%m-%d %H:%M:%S}"
            self.stdout.write(f"{when} {a.severity.upper():<8} {where:<12} {a.message} ({state})")
