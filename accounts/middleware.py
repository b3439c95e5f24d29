"""The policy for pages and their JSON endpoints: one table from URL name to action, checked before the view.

The admin (Django's own model permissions), the login pages, /metrics (its bearer token) and the REST
API (its own permission class, same policy) are left to themselves. A GET this table does not name
needs `view`; any other method it does not name is for operators (a new action must be added here).
"""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse

from jobs.models import Job

from . import audit, policy

RULES = {
    "cluster-overview": "view",
    "job-board": "view",
    "job-detail": "view",
    "compare": "view",
    "api-job-logs": "view",
    "api-job-checkpoints": "view",
    "api-job-series": "view",
    "api-job-system": "view",
    "node-detail": "view",
    "api-node-history": "view",
    "job-launch": "launch",
    "job-relaunch": "launch",
    "job-cancel": "cancel",
    "job-resume": "resume",
    "job-queue": "view",
    "services": "view",
    "service-start": "serve",
    "service-stop-page": "serve",
    "replica-log": "view",
    "sweep-list": "view",
    "sweep-detail": "view",
    "sweep-cancel": "launch",  # and each trial's own cancel rule, in accounts.actions.cancel_sweep_as
}
EXEMPT_NAMES = {"prometheus-metrics", "login", "logout", "password_change", "password_change_done", "favicon"}
EXEMPT_NAMESPACES = {"admin", "api", "djdt"}  # /serve/ never reaches Django (serving/endpoint.py)
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


class PolicyMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest):
        return self.get_response(request)

    def process_view(self, request: HttpRequest, view_func, view_args, view_kwargs):
        match = request.resolver_match
        if match is None or match.url_name in EXEMPT_NAMES or set(match.namespaces) & EXEMPT_NAMESPACES:
            return None
        if match.url_name and match.url_name.startswith("password_reset"):
            return None
        if not request.user.is_authenticated:
            return None  # LoginRequiredMiddleware (before this one) has sent it to the login page
        action = RULES.get(match.url_name or "")
        if action is None:
            action = "view" if request.method in SAFE_METHODS else "nodes"
        job = None
        if action in policy.JOB_ACTIONS and "pk" in view_kwargs:
            job = Job.objects.filter(pk=view_kwargs["pk"]).select_related("owner").first()
        why = policy.reason(request.user, action, job)
        if why is None:
            return None
        if request.method not in SAFE_METHODS:
            target = job.name if job else str(request.POST.get("name") or request.path)[:200]
            audit.record(request.user, action, target, source=audit.web_source(request), outcome=f"refused: {why}")
        if request.path.startswith("/api/"):
            return JsonResponse({"error": why}, status=403)
        raise policy.Refused(why)
