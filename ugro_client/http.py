"""HTTP to the UGRO API with urllib: JSON in, JSON out, one-line errors."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8099"

# exit codes (README, "The ugro client")
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED, EXIT_DENIED, EXIT_UNREACHABLE = 0, 1, 2, 3, 4, 5


class ApiError(Exception):
    """A request that did not succeed; str() is one line, `code` the exit code it means."""

    def __init__(self, message: str, code: int, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


def token_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "ugro" / "token"


def find_token() -> str:
    token = os.environ.get("UGRO_TOKEN", "").strip()
    if token:
        return token
    path = token_path()
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise ApiError(
            f"no API token: set UGRO_TOKEN or put one in {path} "
            "(on the controller: manage.py token create NAME --scope launch --save)",
            EXIT_UNREACHABLE,
        ) from None
    except OSError as exc:
        raise ApiError(f"cannot read the token file {path}: {exc.strerror}", EXIT_UNREACHABLE) from None


class Client:
    """Calls /api/v1/... on UGRO_URL with the user's token."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = (url or os.environ.get("UGRO_URL") or DEFAULT_URL).rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ApiError(f"UGRO_URL must start with http:// or https://, not {self.url!r}", EXIT_USAGE)
        self.token = token if token is not None else find_token()
        self.timeout = timeout

    def get(self, path: str, **params: Any) -> Any:
        query = {k: v for k, v in params.items() if v is not None}
        return self._call("GET", path + (("?" + urllib.parse.urlencode(query)) if query else ""))

    def post(self, path: str, body: dict | None = None) -> Any:
        return self._call("POST", path, body)

    def post_bytes(self, path: str, data: bytes, content_type: str) -> Any:
        """POST a raw body (e.g. a tar of files to sync)."""
        return self._call("POST", path, raw=data, content_type=content_type)

    def _call(self, method: str, path: str, body: dict | None = None, raw: bytes | None = None,
              content_type: str = "application/json") -> Any:  # fmt: skip
        data = raw if raw is not None else json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + "/api/v1/" + path.lstrip("/"), data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise _http_error(exc) from None
        except (urllib.error.URLError, OSError) as exc:
            why = getattr(exc, "reason", exc)
            raise ApiError(f"cannot reach UGRO at {self.url}: {why}", EXIT_UNREACHABLE) from None
        except json.JSONDecodeError:
            raise ApiError(
                f"{self.url} did not answer with JSON: is UGRO_URL a UGRO server?", EXIT_UNREACHABLE
            ) from None


def _http_error(exc: urllib.error.HTTPError) -> ApiError:
    try:
        message = json.loads(exc.read() or b"{}").get("error") or exc.reason
    except (json.JSONDecodeError, AttributeError, OSError):
        message = exc.reason
    message = " ".join(str(message).split())  # one line, whatever came back
    if exc.code in (401, 403):
        return ApiError(message, EXIT_DENIED, exc.code)
    if exc.code >= 500:
        return ApiError(f"the UGRO server failed ({exc.code}): {message}", EXIT_UNREACHABLE, exc.code)
    return ApiError(message, EXIT_REFUSED, exc.code)
