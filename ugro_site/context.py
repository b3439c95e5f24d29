"""Template context for every page."""

from __future__ import annotations

from ugro_site.celery import NO_SCHEDULER, scheduler_alive


def controller(request) -> dict:
    """The banner every page shows while no worker's scheduler runs (nothing would start or follow a job)."""
    if not getattr(request, "user", None) or not request.user.is_authenticated:
        return {}
    return {"controller_problem": "" if scheduler_alive() else NO_SCHEDULER}
