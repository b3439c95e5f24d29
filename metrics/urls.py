"""URL routes of the metrics app (included at the site root)."""

from __future__ import annotations

from django.urls import path

from . import views

urlpatterns = [
    path("compare/", views.compare, name="compare"),
    path("api/jobs/<int:pk>/series", views.api_series, name="api-job-series"),
    path("api/jobs/<int:pk>/panels", views.api_panels, name="api-job-panels"),
]
