"""Who may do what: the one policy every surface asks (pages, JSON, websockets, commands, the API).

Roles are Django groups made of the permissions on `accounts.Access` (migration 0002_roles):

    viewer    sees everything, changes nothing
    launcher  also launches jobs, cancels and resumes its own, priority 0-LAUNCHER_MAX_PRIORITY,
              starts and stops services (serving/), calls their endpoints (infer: viewers too),
              at most LAUNCHER_MAX_QUEUED of its jobs queued at once
    operator  also cancels and resumes anyone's job, any priority (0-100), changes/drains nodes,
              reads the audit log
    superuser everything

An API token narrows what its user may do to its scope (read / infer / launch / operate), never widens it.
"""

from __future__ import annotations

from django.core.exceptions import PermissionDenied

from jobs.launch import PRIORITY_MAX, PRIORITY_MIN
from jobs.models import Job

ROLES = ("viewer", "launcher", "operator")

# action -> the permission it needs (job actions on someone else's job need manage_any_job too)
ACTIONS = {
    "view": "accounts.view_cluster",
    "launch": "accounts.launch_job",
    "cancel": "accounts.launch_job",
    "resume": "accounts.launch_job",
    "nodes": "accounts.manage_nodes",
    "audit": "accounts.view_audit",
    "serve": "accounts.launch_job",  # start and stop a service (serving/)
    "infer": "accounts.view_cluster",  # call a service's endpoint, /serve/<name>/v1/...
}
# how a refusal names an action that is not a verb of its own
ACTION_WORDS = {"view": "view the cluster", "nodes": "manage nodes", "audit": "read the audit log",
                "infer": "call a service's model"}  # fmt: skip
JOB_ACTIONS = ("cancel", "resume")
LAUNCHER_MAX_PRIORITY = 50  # a launcher's highest priority: the upper half is left for operators to jump the queue
LAUNCHER_MAX_QUEUED = 10  # a launcher's most queued jobs: one person's sweep cannot fill the queue for everyone
# what each token scope lets through
SCOPES = {
    "read": {"view"},
    "infer": {"infer"},  # for a program that only calls a service's model
    "launch": {"view", "launch", "cancel", "resume", "serve", "infer"},
    "operate": {"view", "launch", "cancel", "resume", "nodes", "audit", "serve", "infer"},
}


class Refused(PermissionDenied):
    """Refused by the policy; str() is the one-line reason."""


def role_of(user) -> str:
    """superuser, operator, launcher, viewer or none (the highest of the user's roles)."""
    if user is None or not user.is_authenticated or not user.is_active:
        return "none"
    if user.is_superuser:
        return "superuser"
    names = set(user.groups.values_list("name", flat=True))
    for role in reversed(ROLES):
        if role in names:
            return role
    return "none"


def reason(user, action: str, job=None, *, priority: int | None = None, scope: str | None = None) -> str | None:
    """None if `user` may do `action` (on `job`, at `priority`, through a token of `scope`), else why not."""
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}")
    if user is None or not user.is_authenticated:
        return "log in first (or give an API token)"
    who = user.get_username()
    if not user.is_active:
        return f"account {who} is disabled"
    if not user.has_perm(ACTIONS[action]):
        role = role_of(user)
        have = f"role {role}" if role != "none" else "no role (ask an operator for one)"
        return f"{who} has {have}: not allowed to {ACTION_WORDS.get(action, action)}"
    if scope is not None and action not in SCOPES.get(scope, set()):
        return f"this token's scope is {scope}: it cannot {ACTION_WORDS.get(action, action)}"
    if action in JOB_ACTIONS and job is not None and job.owner_id != user.pk:
        if not user.has_perm("accounts.manage_any_job"):
            owner = job.owner.get_username() if job.owner_id else "the system"
            return f"job {job.name} belongs to {owner}: {who} may {action} only their own jobs"
    if action == "launch":
        # outside PRIORITY_MIN-MAX for everyone: jobs.launch's bounds check says so, in its words
        if priority is not None and PRIORITY_MIN <= priority <= PRIORITY_MAX:
            top = PRIORITY_MAX if user.has_perm("accounts.any_priority") else LAUNCHER_MAX_PRIORITY
            if priority > top:
                return f"priority {priority} is out of range for {who}: {PRIORITY_MIN}-{top}"
        if not user.has_perm("accounts.any_priority"):
            queued = Job.objects.filter(owner=user, state=Job.State.QUEUED).count()
            if queued >= LAUNCHER_MAX_QUEUED:
                return f"{who} already has {queued} queued jobs (quota {LAUNCHER_MAX_QUEUED})"
    return None


def allowed(user, action: str, job=None, *, priority: int | None = None, scope: str | None = None) -> bool:
    return reason(user, action, job, priority=priority, scope=scope) is None


def check(user, action: str, job=None, *, priority: int | None = None, scope: str | None = None) -> None:
    """Raise Refused with a one-line reason unless `user` may do `action`."""
    why = reason(user, action, job, priority=priority, scope=scope)
    if why is not None:
        raise Refused(why)
