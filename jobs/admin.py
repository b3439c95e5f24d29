"""Admin views of jobs and ranks (read-mostly: jobs are changed through launch/cancel)."""

from __future__ import annotations

from django.contrib import admin

from .models import Allocation, Job, Rank, Sweep


class RankInline(admin.TabularInline):
    model = Rank
    extra = 0
    can_delete = False
    fields = ("attempt", "index", "node", "state", "exit_code", "pid", "log_lines", "log_offset", "active")
    readonly_fields = fields


class AllocationInline(admin.TabularInline):
    model = Allocation
    extra = 0
    can_delete = False
    fields = ("node", "gpu_index", "active", "created_at")
    readonly_fields = fields


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("name", "state", "priority", "created_at", "started_at", "finished_at", "launch_spread_s")
    list_filter = ("state",)
    search_fields = ("name", "current__tag")
    inlines = [RankInline, AllocationInline]
    readonly_fields = ("tag", "rdzv_endpoint", "launch_spread_s", "failure_reason", "follower", "follower_until",
                       "metrics_bytes", "started_at", "running_at", "finished_at")  # fmt: skip


@admin.register(Sweep)
class SweepAdmin(admin.ModelAdmin):
    list_display = ("name", "metric", "mode", "max_concurrent", "created_at", "cancelled_at")
    search_fields = ("name",)
    readonly_fields = ("spec", "base", "created_at", "cancelled_at")
