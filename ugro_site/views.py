"""Site-wide responses: the favicon browsers (and the admin) ask for at /favicon.ico."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.http import FileResponse, HttpRequest
from django.views.decorators.cache import cache_control
from django.views.decorators.http import require_GET

FAVICON = settings.BASE_DIR / "static" / "img" / "favicon.ico"


@login_not_required
@require_GET
@cache_control(max_age=86400, public=True)
def favicon(request: HttpRequest) -> FileResponse:
    return FileResponse(FAVICON.open("rb"), content_type="image/x-icon")
