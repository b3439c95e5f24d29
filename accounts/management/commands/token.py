from __future__ import annotations

import argparse
import os
from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError
from django.utils import timezone

from accounts import audit
from accounts.commands import UserCommand
from accounts.models import ApiToken
from accounts.tokens import create_token, revoke

DEFAULT_TOKEN_FILE = "~/.config/ugro/token"


class Command(UserCommand):
    help = (
        "API tokens: `token create NAME --scope read|infer|launch|operate [--for USER] [--save]` (the token is shown "
        "once), `token list [--all]`, `token revoke PREFIX`. Your own tokens; a superuser's for anyone."
    )

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="verb", required=True)
        create = sub.add_parser("create", help="a new token, printed once")
        create.add_argument("name", help="what it is for, e.g. laptop")
        create.add_argument("--scope", choices=ApiToken.Scope.values, default="read")
        create.add_argument("--for", dest="for_user", metavar="USER", help="another account's token (superuser)")
        create.add_argument(
            "--save", nargs="?", const=DEFAULT_TOKEN_FILE, metavar="FILE",
            help=f"also write it to FILE (default {DEFAULT_TOKEN_FILE}, mode 0600) for the ugro client",
        )  # fmt: skip
        listing = sub.add_parser("list", help="tokens: prefix, owner, scope, created, last used, revoked")
        listing.add_argument("--all", action="store_true", help="every account's tokens (superuser)")
        rev = sub.add_parser("revoke", help="revoke a token by its prefix")
        rev.add_argument("prefix")
        for verb in (create, listing, rev):  # `token create NAME --as USER` reads naturally too
            verb.add_argument("--as", dest="as_user", metavar="USER", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def handle(self, verb, **o):
        return getattr(self, f"_{verb}")(**o)

    def _create(self, name, scope, for_user=None, save=None, **o):
        owner = self.user
        if for_user:
            if not self.user.is_superuser:
                raise CommandError(f"{self.user} is not a superuser: only your own tokens")
            owner = get_user_model().objects.filter(username=for_user, is_active=True).first()
            if owner is None:
                raise CommandError(f"no active UGRO account named {for_user!r}")
        try:
            row, token = create_token(owner, name, scope)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        audit.record(self.user, "token_create", f"{row.prefix} ({owner})", source=self.source, scope=scope)
        self.stdout.write(f"token {row.prefix} for {owner}, scope {scope} (shown once, keep it secret):")
        self.stdout.write(token)
        if save:
            path = Path(save).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(token + "\n")
            os.chmod(path, 0o600)
            self.stdout.write(f"saved to {path}")

    def _list(self, all=False, **o):
        if all and not self.user.is_superuser:
            raise CommandError(f"{self.user} is not a superuser: --all lists every account's tokens")
        rows = ApiToken.objects.select_related("user")
        if not all:
            rows = rows.filter(user=self.user)
        self.stdout.write(f"{'PREFIX':10} {'USER':12} {'SCOPE':8} {'NAME':16} {'CREATED':17} {'LAST USED':17} STATE")
        for t in rows:
            when = lambda d: timezone.localtime(d).strftime("%Y-%m-%d %H:%M") if d else "-"  # noqa: E731
            state = f"revoked {when(t.revoked_at)}" if t.revoked_at else "active"
            self.stdout.write(f"{t.prefix:10} {t.user.get_username()[:12]:12} {t.scope:8} {t.name[:16]:16} "
                              f"{when(t.created_at):17} {when(t.last_used_at):17} {state}")  # fmt: skip

    def _revoke(self, prefix, **o):
        prefix = prefix.removeprefix("ugro_").split("_")[0]
        row = ApiToken.objects.select_related("user").filter(prefix=prefix).first()
        if row is None or (row.user_id != self.user.pk and not self.user.is_superuser):
            raise CommandError(f"no token {prefix!r} of yours (see: manage.py token list)")
        if not revoke(row):
            raise CommandError(f"token {prefix} was already revoked")
        audit.record(self.user, "token_revoke", f"{row.prefix} ({row.user})", source=self.source)
        self.stdout.write(f"token {prefix} revoked")
