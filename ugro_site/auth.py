"""Login throttling: django-axes' backend, for logins that come with a request."""

from __future__ import annotations

from axes.backends import AxesStandaloneBackend


class LoginThrottleBackend(AxesStandaloneBackend):
    """django-axes' lockout check on every login made through a request (the login page, admin, the
    API). A call with no request is code on the controller itself (a management command, a test
    client's login): there is nobody to throttle, so it is left to the next backend."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)
