"""URL routes of the cluster app (included at the site root)."""
from __future__ import annotations

from django.urls import path

from . import views

urlpatterns: list = [
    path("", views.overview, name="cluster-overview"),
]
