"""Roles' permissions, API tokens and the audit log."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class Access(models.Model):
    """No table: the holder of UGRO's own permissions, which the roles (groups) are made of."""

    class Meta:
        managed = False
        default_permissions = ()
        permissions = [
            ("view_cluster", "See jobs, nodes, logs and metrics"),
            ("launch_job", "Launch jobs; cancel and resume one's own"),
            ("manage_any_job", "Cancel and resume anyone's job"),
            ("any_priority", "Launch at any priority (0-100)"),
            ("manage_nodes", "Change nodes, drain and undrain them"),
            ("view_audit", "Read the audit log"),
        ]


class ApiToken(models.Model):
    """A user's API token. Only its sha256 is kept; its prefix finds it. Shown once, at creation."""

    class Scope(models.TextChoices):
        READ = "read", "read: see jobs, logs, nodes"
        INFER = "infer", "infer: only call services' endpoints"
        LAUNCH = "launch", "launch: also launch, cancel, resume"
        OPERATE = "operate", "operate: also drain and undrain nodes"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, help_text="What it is for, e.g. 'laptop'.")
    prefix = models.CharField(max_length=16, unique=True, help_text="The token's first characters (not secret).")
    digest = models.CharField(max_length=64, help_text="sha256 of the whole token, hex.")
    scope = models.CharField(max_length=8, choices=Scope.choices, default=Scope.READ)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    last_used_from = models.CharField(max_length=64, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"{self.prefix}... ({self.user}, {self.scope})"

    @property
    def active(self) -> bool:
        return self.revoked_at is None


class AuditEvent(models.Model):
    """Who did what, when, from where; for a launch, the script's exact argv."""

    time = models.DateTimeField(default=timezone.now, db_index=True)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    username = models.CharField(max_length=150, blank=True, help_text="Kept when the account is deleted.")
    action = models.CharField(max_length=32, db_index=True)
    target = models.CharField(max_length=200, blank=True, help_text="The job, node or token acted on.")
    source = models.CharField(max_length=200, blank=True, help_text="web/api/cli, address, token prefix.")
    outcome = models.CharField(max_length=300, default="ok", help_text="ok, or the one-line refusal.")
    argv = models.JSONField(default=list, blank=True, help_text="The job's script and arguments, exactly.")
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-time", "-pk"]

    def __str__(self) -> str:
        return f"{self.time:%Y-%m-%d %H:%M:%S} {self.username or '-'} {self.action} {self.target}"
