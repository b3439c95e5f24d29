"""URL routes of the jobs app (included at the site root)."""
from __future__ import annotations

urlpatterns: list = []
