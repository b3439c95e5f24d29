"""URL routes of the jobs app (included at the site root)."""

from __future__ import annotations

from django.urls import path

from . import views

urlpatterns = [
    path("jobs/", views.board, name="job-board"),
    path("jobs/launch/", views.launch, name="job-launch"),
    path("jobs/queue/", views.queue_page, name="job-queue"),
    path("sweeps/", views.sweeps, name="sweep-list"),
    path("sweeps/<int:pk>/", views.sweep_detail, name="sweep-detail"),
    path("sweeps/<int:pk>/cancel/", views.sweep_cancel, name="sweep-cancel"),
    path("jobs/<int:pk>/", views.detail, name="job-detail"),
    path("jobs/<int:pk>/cancel/", views.cancel, name="job-cancel"),
    path("jobs/<int:pk>/relaunch/", views.relaunch, name="job-relaunch"),
    path("jobs/<int:pk>/resume/", views.resume, name="job-resume"),
    path("api/jobs/<int:pk>/logs", views.api_logs, name="api-job-logs"),
    path("api/jobs/<int:pk>/checkpoints", views.api_checkpoints, name="api-job-checkpoints"),
    path("api/jobs/<int:pk>/system", views.api_system, name="api-job-system"),
]
