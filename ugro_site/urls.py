"""URL routes: each app's pages and JSON endpoints, admin and auth."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("accounts/", include("django.contrib.auth.urls")),
    path("api/", include("api.urls")),
    path("", include("cluster.urls")),
    path("", include("jobs.urls")),
    path("", include("metrics.urls")),
]
