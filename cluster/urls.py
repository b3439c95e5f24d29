"""URL routes of the cluster app (included at the site root)."""
from __future__ import annotations

from django.urls import path

from . import metrics_view, views

urlpatterns: list = [
    path("", views.overview, name="cluster-overview"),
    path("metrics", metrics_view.prometheus, name="prometheus-metrics"),
    path("nodes/<str:name>/", views.node_detail, name="node-detail"),
    path("api/nodes/<str:name>/history", views.api_node_history, name="api-node-history"),
]
