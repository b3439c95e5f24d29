"""URL routes of the metrics app (included at the site root)."""
from __future__ import annotations

urlpatterns: list = []
