"""Admin for node configuration, cluster settings, health samples and alerts (staff only)."""

from __future__ import annotations

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.utils import timezone

from accounts import audit, policy

from .models import GPU, Alert, AlertSettings, ClusterSettings, HealthSample, Node
from .provision import ProvisionError, probe_node


class GPUInline(admin.TabularInline):
    """One row per device, following gpu_count; the health monitor fills in model and memory."""

    model = GPU
    extra = 0
    can_delete = False
    fields = ("index", "model", "vram_mb", "uuid")
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.action(description="Probe selected nodes")
def probe_nodes(modeladmin, request, queryset):
    """`ugro node probe` for each: GPUs, CPUs, RAM, disk, Python environments and route read again (operators)."""
    if not policy.allowed(request.user, "nodes"):
        raise PermissionDenied(policy.reason(request.user, "nodes"))
    source = audit.web_source(request)
    for node in queryset:
        try:
            result = probe_node(node)
        except ProvisionError as exc:
            audit.record(request.user, "node_probe", node.name, source=source, outcome=f"refused: {exc}")
            modeladmin.message_user(request, str(exc), messages.ERROR)
            continue
        audit.record(request.user, "node_probe", node.name, source=source, changed=result.changed)
        said = "; ".join(result.changed) if result.changed else "nothing changed"
        modeladmin.message_user(request, f"{node.name} probed: {said}", messages.SUCCESS)


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    actions = [probe_nodes]
    list_display = (
        "name", "address", "role", "gpu_label", "transport", "enabled", "status", "health_score", "last_seen",
        "host_key_fingerprint",
    )  # fmt: skip
    list_filter = ("role", "enabled", "status", "transport")
    search_fields = ("name", "address", "hostname", "gpu_model")
    health_fields = ("status", "health_score", "status_reason", "health_checks", "last_seen", "last_poll_at")
    # the pin changes only by first contact or `ugro trust NODE`, never by a form
    host_key_fields = ("host_key_fingerprint", "host_key_source", "host_key_pinned_at", "host_key")
    readonly_fields = health_fields + host_key_fields + ("probed", "power_since", "idle_since")
    inlines = [GPUInline]
    fieldsets = (
        (None, {"fields": ("name", "hostname", "role", "order", "enabled")}),
        ("Reaching it", {"fields": ("transport", "address", "ssh_port", "user", "key_path", "agent_python")}),
        ("SSH host key", {"fields": host_key_fields}),
        ("GPUs", {"fields": ("gpu_count", "gpu_model", "gpu_vram_gb", "gpu_reader")}),
        ("Training environment", {"fields": ("torchrun_command", "workdir", "env")}),
        ("Power (sleep when idle, docs/power.md)", {"fields": ("power", "power_since", "idle_since")}),
        ("Health", {"fields": health_fields}),
        ("What node add / node probe found", {"fields": ("probed",)}),
    )

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("gpus")  # gpu_label reads each node's GPU rows

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        audit.record(request.user, "node_change" if change else "node_add", obj.name,
                     source=audit.web_source(request), fields=sorted(form.changed_data))  # fmt: skip

    def delete_model(self, request, obj):
        name = obj.name
        super().delete_model(request, obj)
        audit.record(request.user, "node_delete", name, source=audit.web_source(request))


@admin.register(ClusterSettings)
class ClusterSettingsAdmin(admin.ModelAdmin):
    list_display = ("name", "master_address", "rendezvous_port", "default_script")

    def has_add_permission(self, request):
        return not ClusterSettings.objects.exists()


@admin.register(HealthSample)
class HealthSampleAdmin(admin.ModelAdmin):
    """Read-only: samples are the monitor's record."""

    list_display = ("time", "node", "kind", "ok", "score", "status", "rtt_ms", "cpu_percent", "ram_percent",
                    "gpu_temp_c", "gpu_util_percent")  # fmt: skip
    list_filter = ("kind", "ok", "node")
    date_hierarchy = "time"
    list_select_related = ("node",)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.action(description="Resolve the selected alerts")
def resolve_alerts(modeladmin, request, queryset):
    now = timezone.now()
    queryset.filter(resolved_at__isnull=True).update(resolved_at=now, updated_at=now)


@admin.register(Alert)
class AlertAdmin(admin.ModelAdmin):
    list_display = ("opened_at", "severity", "node", "job_name", "message", "resolved_at")
    list_filter = ("severity", ("resolved_at", admin.EmptyFieldListFilter), "node")
    search_fields = ("message", "key", "job_name")
    list_select_related = ("node",)
    readonly_fields = ("node", "key", "severity", "message", "job_name", "opened_at", "updated_at", "resolved_at")
    actions = [resolve_alerts]

    def has_add_permission(self, request):
        return False


@admin.register(AlertSettings)
class AlertSettingsAdmin(admin.ModelAdmin):
    list_display = ("__str__", "webhook_url", "min_severity")

    def has_add_permission(self, request):
        return not AlertSettings.objects.exists()
