"""The API's one permission class: each view names its action per method; accounts.policy decides."""

from __future__ import annotations

from rest_framework.permissions import BasePermission

from accounts import policy


class PolicyPermission(BasePermission):
    """A view's `policy_actions` ({"GET": "view", "POST": "launch"}) checked against the user's role
    and, with a token, its scope. Job-level rules (only one's own jobs) are checked by accounts.actions."""

    message = "not allowed"

    def has_permission(self, request, view) -> bool:
        actions = getattr(view, "policy_actions", {})
        action = actions.get(request.method) or actions.get("GET" if request.method in ("HEAD", "OPTIONS") else "")
        if action is None:
            self.message = f"{request.method} is not allowed here"
            return False
        token = request.auth if hasattr(request.auth, "scope") else None
        why = policy.reason(request.user, action, scope=token.scope if token else None)
        if why is not None:
            self.message = why
            return False
        return True
