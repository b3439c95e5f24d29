from __future__ import annotations

from django.apps import AppConfig
from django.db.models.signals import post_migrate


def _roles_after_migrate(sender, **kwargs) -> None:
    from .roles import ensure_roles

    ensure_roles()


class AccountsConfig(AppConfig):
    name = "accounts"
    verbose_name = "Users, roles, tokens and audit"

    def ready(self) -> None:
        from . import signals  # noqa: F401  (new accounts get the default role)

        # a test database flush drops the groups the data migration made: make them again
        post_migrate.connect(_roles_after_migrate, sender=self)
