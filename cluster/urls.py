"""URL routes of the cluster app (included at the site root)."""
from __future__ import annotations

urlpatterns: list = []
