from __future__ import annotations

import json

from django.core.management.base import CommandError
from django.utils import timezone

from accounts.commands import UserCommand
from accounts.models import AuditEvent


class Command(UserCommand):
    help = "The audit log, newest first: who did what, when, from where (operators and superusers)."
    action = "audit"

    def add_arguments(self, parser):
        parser.add_argument("--limit", type=int, default=50)
        parser.add_argument("--action", dest="what", help="only this action (launch, cancel, drain, token_create...)")
        parser.add_argument("--user", help="only this account")
        parser.add_argument("--json", action="store_true", dest="as_json")

    def handle(self, limit=50, what=None, user=None, as_json=False, **o):
        if not 1 <= limit <= 10000:
            raise CommandError("--limit must be between 1 and 10000")
        events = AuditEvent.objects.all()
        if what:
            events = events.filter(action=what)
        if user:
            events = events.filter(username=user)
        for e in events[:limit]:
            if as_json:
                self.stdout.write(json.dumps({
                    "time": e.time.isoformat(), "user": e.username, "action": e.action, "target": e.target,
                    "source": e.source, "outcome": e.outcome, "argv": e.argv, "detail": e.detail,
                }))  # fmt: skip
                continue
            when = timezone.localtime(e.time).strftime("%Y-%m-%d %H:%M:%S")
            argv = f"  argv: {json.dumps(e.argv)}" if e.argv else ""
            self.stdout.write(f"{when} {e.username or '-':12} {e.action:14} {e.target:24} {e.source:28} "
                              f"{e.outcome}{argv}")  # fmt: skip
