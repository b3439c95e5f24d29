from __future__ import annotations

import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Create the first admin user if there is none, and say how to log in."

    def add_arguments(self, parser):
        parser.add_argument("--username", default="admin")

    def handle(self, username="admin", **options):
        users = get_user_model()
        if users.objects.filter(is_superuser=True).exists():
            self.stdout.write("an admin user exists; log in with it (reset: manage.py changepassword NAME)")
            return
        password = secrets.token_urlsafe(12)
        users.objects.create_superuser(username=username, password=password, email="")
        path = settings.DATA_DIR / "admin_password.txt"
        path.write_text(f"{username} {password}\n")
        path.chmod(0o600)
        path.chmod(0o600)
        self.stdout.write(f"created admin user {username!r} with password {password} (also in {path})")
