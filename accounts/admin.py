"""Admin: API tokens (created here, shown once; revocable) and the audit log (read-only)."""

from __future__ import annotations

from django.contrib import admin, messages
from django.utils import timezone

from . import audit
from .models import ApiToken, AuditEvent
from .tokens import create_token


@admin.action(description="Revoke the selected tokens")
def revoke_tokens(modeladmin, request, queryset):
    for row in queryset.filter(revoked_at__isnull=True):
        ApiToken.objects.filter(pk=row.pk).update(revoked_at=timezone.now())
        audit.record(request.user, "token_revoke", f"{row.prefix} ({row.user})", source=audit.web_source(request))


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Adding a token generates its secret and shows it once, in the message after saving."""

    list_display = ("prefix", "user", "name", "scope", "created_at", "last_used_at", "last_used_from", "revoked_at")
    list_filter = ("scope", ("revoked_at", admin.EmptyFieldListFilter))
    search_fields = ("prefix", "name", "user__username")
    actions = [revoke_tokens]

    def get_fields(self, request, obj=None):
        if obj is None:
            return ("user", "name", "scope")
        return ("user", "name", "scope", "prefix", "created_at", "last_used_at", "last_used_from", "revoked_at")

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ()
        return ("user", "scope", "prefix", "created_at", "last_used_at", "last_used_from", "revoked_at")

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        row, token = create_token(obj.user, obj.name, obj.scope)
        obj.pk, obj.prefix, obj.digest, obj.created_at = row.pk, row.prefix, row.digest, row.created_at
        obj._state.adding = False
        audit.record(request.user, "token_create", f"{row.prefix} ({row.user})", source=audit.web_source(request),
                     scope=row.scope)  # fmt: skip
        messages.warning(request, f"The new token (shown once, copy it now): {token}")

    def has_delete_permission(self, request, obj=None):
        return False  # revoke instead: the row stays for the record


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ("time", "username", "action", "target", "source", "outcome")
    list_filter = ("action", "username")
    search_fields = ("username", "target", "source", "outcome")
    date_hierarchy = "time"
    readonly_fields = ("time", "user", "username", "action", "target", "source", "outcome", "argv", "detail")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
