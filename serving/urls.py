"""The services' endpoints."""

from __future__ import annotations

from django.urls import path

from . import views

app_name = "serve"
urlpatterns = [path("<str:name>/v1/<path:route>", views.proxy, name="proxy")]
