"""Admin views of jobs and ranks (read-mostly: jobs are changed through launch/cancel)."""

from __future__ import annotations

from django.contrib import admin

from .models import Job, Rank


class RankInline(admin.TabularInline):
    model = Rank
    extra = 0
    can_delete = False
    fields = ("index", "node", "state", "exit_code", "pid", "log_lines", "log_offset", "active")
    readonly_fields = fields


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("name", "state", "priority", "created_at", "started_at", "finished_at", "launch_spread_s")
    list_filter = ("state",)
    search_fields = ("name", "tag")
    inlines = [RankInline]
    readonly_fields = ("tag", "rdzv_endpoint", "launch_spread_s", "failure_reason", "follower", "follower_until",
                       "metrics_bytes", "started_at", "running_at", "finished_at")  # fmt: skip
