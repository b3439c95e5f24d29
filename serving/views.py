"""/serve/<name>/v1/...: one OpenAI-compatible endpoint per service, in front of its ready replicas.

An async view on the ASGI server: the request goes to one replica over httpx's AsyncClient and the answer is
passed on as it arrives (a streamed completion chunk by chunk), counted per replica in memory and written
every few seconds (serving/stats.py). A replica that fails before it answers (refused, reset, 502-504) is
left for another, once. An API token is required (scope infer, launch or operate; one let in is trusted for
ADMITTED_S); the request's size and the whole exchange's time are bounded. Requests name the service as their
model (/v1/models lists it); each replica gets the name its engine answers to. No page middleware runs here
(serving/endpoint_handler.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
import weakref

import httpx
from asgiref.sync import sync_to_async
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from accounts import policy
from accounts.audit import client_address
from accounts.tokens import digest, find_token, mark_used

from .balancer import Target, balancer
from .scaling import wake
from .stats import TokenCount, flush_every, recorder

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1024 * 1024
REQUEST_TIMEOUT_S = 600.0  # the whole exchange, a long streamed completion included
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 120.0  # silence from a replica, before its first byte or between chunks
ROUTES = {"chat/completions": "POST", "completions": "POST", "models": "GET"}
RETRY_STATUSES = (502, 503, 504)
FORWARDED_HEADERS = ("content-type", "accept")
# a token let in is not read again for this long: revoking it, or its user's role, bites within these seconds
ADMITTED_S = 5.0
WAKE_POLL_S = 0.25  # a request held for a waking service looks for a ready replica this often
KEEPALIVE_S = 4.0  # below uvicorn's 5 s (transformers serve, vLLM): never reuse a connection it is closing
_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_flushers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_admissions: dict[str, float] = {}  # token digest -> until when (time.monotonic)


def _client() -> httpx.AsyncClient:
    """This event loop's client (daphne runs one loop; its connections to the replicas are kept)."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=256, keepalive_expiry=KEEPALIVE_S)
        client = _clients[loop] = httpx.AsyncClient(timeout=timeout, limits=limits)
    return client


def _error(status: int, message: str) -> JsonResponse:
    return JsonResponse({"error": {"message": message, "type": "ugro_error", "code": status}}, status=status)


def _bearer(request: HttpRequest) -> str:
    kind, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    return token.strip() if kind.lower() in ("bearer", "token") else ""


def _admitted(token: str) -> bool:
    """Whether this token was let in within the last ADMITTED_S seconds (no database read, no thread hop)."""
    until = _admissions.get(digest(token))
    return until is not None and until > time.monotonic()


def _refusal(request: HttpRequest, token: str) -> tuple[int, str] | None:
    """(status, why) unless the token's user may call services; a token let in is remembered ADMITTED_S."""
    if not token:
        return 401, "an API token is required: Authorization: Bearer ugro_... (manage.py token create)"
    row = find_token(token)
    if row is None:
        return 401, "the API token is unknown or revoked"
    why = policy.reason(row.user, "infer", scope=row.scope)
    if why:
        return 403, why
    mark_used(row, client_address(request))
    if len(_admissions) > 10_000:  # tokens are few; this bounds memory against a flood of distinct ones
        _admissions.clear()
    _admissions[digest(token)] = time.monotonic() + ADMITTED_S
    return None


@csrf_exempt
@login_not_required
async def proxy(request: HttpRequest, name: str, route: str) -> HttpResponse:
    response = await _answer(request, name, route)
    response["X-Content-Type-Options"] = "nosniff"  # as SecurityMiddleware sets on pages (none runs here)
    return response


async def _answer(request: HttpRequest, name: str, route: str) -> HttpResponse:
    method = ROUTES.get(route)
    if method is None:
        return _error(404, f"/serve/{name}/v1/{route} is not served: {', '.join(sorted(ROUTES))}")
    if request.method != method:
        return _error(405, f"/v1/{route} takes {method}")
    token = _bearer(request)
    if not (token and _admitted(token)):
        refused = await sync_to_async(_refusal)(request, token)
        if refused:
            return _error(*refused)
    size = int(request.META.get("CONTENT_LENGTH") or 0)
    if size > MAX_REQUEST_BYTES:
        return _error(413, f"the request is {size} bytes: at most {MAX_REQUEST_BYTES}")
    body = request.body if method == "POST" else b""
    if len(body) > MAX_REQUEST_BYTES:
        return _error(413, f"the request is {len(body)} bytes: at most {MAX_REQUEST_BYTES}")
    keys = await sync_to_async(balancer.refresh)(name)
    if keys is None:
        return _error(404, f"no service named {name} is running")
    if route == "models":  # one model per service, named as the service, whatever each engine calls it
        return JsonResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "ugro"}]})
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        return _error(400, "the request body must be a JSON object")
    if not keys:
        keys = await _woken(name)
    if not keys:
        waking = balancer.waking.get(name)
        retry = waking.retry_after_s if waking else 10
        if waking and waking.gave_up:
            response = _error(503, f"service {name} {waking.gave_up}")
        else:
            why = f"waited {waking.timeout_s:g} s for it to wake" if waking and waking.wakes else "ugro serve --list"
            response = _error(503, f"no replica of service {name} is ready yet ({why})")
        response["Retry-After"] = str(retry)
        return response
    headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    client = _client()
    tried: set[int] = set()
    why = ""
    _start_flusher()
    for _attempt in range(2):  # the first replica, then once another
        target = balancer.pick(keys, tried)
        if target is None:
            break
        tried.add(target.key)
        target.begin()
        content = json.dumps({**payload, "model": target.model}).encode()
        began = time.monotonic()
        try:
            upstream = await client.send(
                client.build_request(method, f"{target.url}/v1/{route}", content=content, headers=headers), stream=True
            )
        except httpx.HTTPError as exc:
            target.end()
            balancer.failed(target)
            recorder.record(target.key, None, error=True)
            why = f"{target.url}: {type(exc).__name__}: {exc}"
            continue
        if upstream.status_code in RETRY_STATUSES and len(tried) < 2:
            await upstream.aclose()
            target.end()
            balancer.failed(target)
            recorder.record(target.key, None, error=True)
            why = f"{target.url}: HTTP {upstream.status_code}"
            continue
        response = StreamingHttpResponse(
            _relay(upstream, target, deadline, began), status=upstream.status_code,
            content_type=upstream.headers.get("content-type", "application/json"),
        )  # fmt: skip
        response["Cache-Control"] = "no-cache"
        return response
    return _error(502, f"no replica of service {name} answered: {why}")


async def _relay(upstream: httpx.Response, target: Target, deadline: float, began: float):
    """The replica's answer, chunk by chunk as it comes; cut at the deadline or when the replica fails midway.
    Counted in the replica's stats when it ends: its latency (to the last byte), tokens, and whether it failed."""
    tokens = TokenCount()
    failed = upstream.status_code >= 500
    try:
        async for chunk in upstream.aiter_bytes():
            tokens.feed(chunk)
            yield chunk
            if time.monotonic() > deadline:
                log.warning("%s: cut after %g s", target.url, REQUEST_TIMEOUT_S)
                failed = True
                return
    except httpx.HTTPError as exc:  # the answer has begun: nothing can be retried, the client sees it end
        failed = True
        balancer.failed(target)
        log.warning("%s failed while answering: %s", target.url, exc)
    finally:
        target.end()
        recorder.record(target.key, None if failed else time.monotonic() - began, tokens.tokens, error=failed)
        await upstream.aclose()


async def _woken(name: str) -> list[int]:
    """A service that sleeps when idle (min_replicas 0) and has no ready replica: wake it (serving/scaling.py) and
    hold the request until a replica is ready, at most its cold-start timeout, or until the worker gives the wake up
    (its replica never answered: the service is asleep again saying why); the ready replicas, or []."""
    waking = balancer.waking.get(name)
    if waking is None or not waking.wakes:
        return []
    await sync_to_async(wake)(name)
    balancer.ready.pop(name, None)  # read it again: a note of an earlier wake that failed is not this one's
    deadline = time.monotonic() + waking.timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(WAKE_POLL_S)  # the ready replicas are read at most once a second (READY_CACHE_S)
        keys = await sync_to_async(balancer.refresh)(name)
        if keys is None:  # stopped meanwhile
            return []
        if keys:
            return keys
        now = balancer.waking.get(name)
        if now is not None and now.gave_up:  # set only once our wake() made it WAKING and the worker ended that
            return []
    return []


def _start_flusher() -> None:
    """This event loop's task that writes the request stats every few seconds (serving/stats.py)."""
    loop = asyncio.get_running_loop()
    task = _flushers.get(loop)
    if task is None or task.done():  # a context of its own: not the request's, which ends before it
        _flushers[loop] = loop.create_task(flush_every(sample=balancer.samples), context=contextvars.Context())
