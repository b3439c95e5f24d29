from __future__ import annotations

import getpass
import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand


def os_user_name() -> str:
    """The OS user's name when it is a valid account name (then `manage.py` commands need no --as), else admin."""
    try:
        name = getpass.getuser()
        get_user_model().username_validator(name)
    except (OSError, KeyError, ValidationError):
        return "admin"
    return name


class Command(BaseCommand):
    help = "Create the first admin user if there is none (named like your OS user), and say how to log in."

    def add_arguments(self, parser):
        parser.add_argument("--username", default=None, help="default: your OS user's name")

    def handle(self, username=None, **options):
        users = get_user_model()
        if username is None:
            username = os_user_name()
            if users.objects.filter(username=username).exists():
                username = "admin"  # the OS user's name is another account's
        if users.objects.filter(is_superuser=True).exists():
            self.stdout.write("an admin user exists; log in with it (reset: manage.py changepassword NAME)")
            return
        password = secrets.token_urlsafe(12)
        users.objects.create_superuser(username=username, password=password, email="")
        path = settings.DATA_DIR / "admin_password.txt"
        path.write_text(f"{username} {password}\n")
        path.chmod(0o600)
        self.stdout.write(f"created admin user {username!r} with password {password} (also in {path})")
