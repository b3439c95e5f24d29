"""Admin for node configuration and cluster settings (staff only)."""
from __future__ import annotations

from django.contrib import admin

from .models import ClusterSettings, Node


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("name", "address", "role", "gpu_label", "transport", "enabled", "status", "last_seen")
    list_filter = ("role", "enabled", "status", "transport")
    search_fields = ("name", "address", "hostname", "gpu_model")
    readonly_fields = ("status", "status_reason", "last_seen")
    fieldsets = (
        (None, {"fields": ("name", "hostname", "role", "order", "enabled")}),
        ("Reaching it", {"fields": ("transport", "address", "ssh_port", "user", "key_path", "agent_python")}),
        ("GPUs", {"fields": ("gpu_count", "gpu_model", "gpu_vram_gb")}),
        ("Training environment", {"fields": ("torchrun_command", "workdir", "env")}),
        ("Health", {"fields": ("status", "status_reason", "last_seen")}),
    )


@admin.register(ClusterSettings)
class ClusterSettingsAdmin(admin.ModelAdmin):
    list_display = ("name", "master_address", "rendezvous_port", "default_script")

    def has_add_permission(self, request):
        return not ClusterSettings.objects.exists()
