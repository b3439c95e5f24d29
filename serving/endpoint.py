"""/serve/<name>/v1/...: one OpenAI-compatible endpoint per service, in front of its ready replicas.

A plain ASGI app beside Django's (ugro_site/asgi.py sends every HTTP request under /serve/ here): no Django
request or response object, no URL resolver, no middleware and no per-request thread. Under daphne those cost
more CPU per proxied request than the proxying itself (docs/serving.md has the figures); the endpoint needs none of
them: it checks its own bearer token, sets no cookie and renders no page. The database is read on a thread only
for a token not let in within ADMITTED_S and for a service's ready replicas past their 1 s cache
(serving/balancer.py).

The request goes to one replica over httpx's AsyncClient and the answer is passed on as it arrives (a streamed
completion chunk by chunk), counted per replica in memory and written every few seconds (serving/stats.py). A
replica that fails before it answers (refused, reset, 502-504) is left for another, once. An API token is required
(scope infer, launch or operate); the request's size and the whole exchange's time are bounded; a client that
hangs up ends its relay. Requests name the service as their model (/v1/models lists it); each replica gets the name
its engine answers to.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import re
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from asgiref.sync import sync_to_async
from django.db import close_old_connections

from accounts import policy
from accounts.tokens import digest, find_token, mark_used

from .balancer import Target, balancer
from .scaling import wake
from .stats import TokenCount, flush_every, recorder

log = logging.getLogger(__name__)

PATH = re.compile(r"/serve/([^/]+)/v1/(.+)")
# what an OpenAI-compatible engine answers with; anything else (an HTML page on this origin) is sent as bytes
CONTENT_TYPE = re.compile(r"(application/json|text/event-stream|text/plain)( *; *[A-Za-z0-9_-]+=[A-Za-z0-9_.\"-]+)*")
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


class Disconnected(Exception):
    """The client hung up before its request was read."""


@dataclass
class Call:
    """What the endpoint reads of one HTTP request."""

    method: str
    headers: dict[str, str]  # lower-cased names
    client: str  # the peer's address, as the audit and a token's last use record it


@dataclass
class Answer:
    """A response: a whole body, or chunks relayed as they come."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    chunks: AsyncIterator[bytes] | None = None


def error(status: int, message: str, **headers: str) -> Answer:
    body = json.dumps({"error": {"message": message, "type": "ugro_error", "code": status}}).encode()
    return Answer(status, body, headers=list(headers.items()))


async def app(scope, receive, send) -> None:
    """The ASGI application for HTTP requests under /serve/."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
    client = scope.get("client") or ("?", 0)
    call = Call(scope["method"], headers, str(client[0]))
    match = PATH.fullmatch(scope.get("path", ""))
    try:
        if match is None:
            served = ", ".join(sorted(ROUTES))
            answer = error(404, f"{scope.get('path', '')} is not served: /serve/NAME/v1/ takes {served}")
        else:
            answer = await _answer(call, receive, *match.groups())
    except Disconnected:
        return
    except Exception:  # one clear line to the client; the trace to the web server's log
        log.exception("/serve/: %s %s failed", call.method, scope.get("path"))
        answer = error(500, "the endpoint failed on this request: the web server's log says why")
    await _respond(answer, receive, send)


async def _respond(answer: Answer, receive, send) -> None:
    headers = [(b"content-type", answer.content_type.encode("latin-1")), (b"x-content-type-options", b"nosniff")]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers]
    if answer.chunks is None:
        headers.append((b"content-length", str(len(answer.body)).encode()))
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})
        return
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    pump = asyncio.ensure_future(_pump(answer.chunks, send))
    hangup = asyncio.ensure_future(_hangup(receive))
    try:
        await asyncio.wait({pump, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (pump, hangup):
            if not task.done():
                task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump  # its relay's `finally` has run: the replica's count and stats are settled
    if pump.done() and not pump.cancelled() and pump.exception() is not None:
        log.warning("/serve/: a relay ended early: %r", pump.exception())


async def _pump(chunks: AsyncIterator[bytes], send) -> None:
    try:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    finally:
        await chunks.aclose()


async def _hangup(receive) -> None:
    """Returns when the client has gone (the request itself was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _body(receive) -> bytes | None:
    """The request's body; None past MAX_REQUEST_BYTES (the rest is not read)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_REQUEST_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _client() -> httpx.AsyncClient:
    """This event loop's client (daphne runs one loop; its connections to the replicas are kept)."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=256, keepalive_expiry=KEEPALIVE_S)
        client = _clients[loop] = httpx.AsyncClient(timeout=timeout, limits=limits)
    return client


def _bearer(call: Call) -> str:
    kind, _, token = call.headers.get("authorization", "").partition(" ")
    return token.strip() if kind.lower() in ("bearer", "token") else ""


def _admitted(token: str) -> bool:
    """Whether this token was let in within the last ADMITTED_S seconds (no database read, no thread hop)."""
    until = _admissions.get(digest(token))
    return until is not None and until > time.monotonic()


def _in_thread(fn):
    """fn on the thread that holds the endpoint's database connection, one Django would not have kept past its
    age or after it broke (what a request's start and end do for Django's own views)."""

    def run(*args):
        close_old_connections()
        try:
            return fn(*args)
        finally:
            close_old_connections()

    return sync_to_async(run)


def _refusal(call: Call, token: str) -> tuple[int, str] | None:
    """(status, why) unless the token's user may call services; a token let in is remembered ADMITTED_S."""
    if not token:
        return 401, "an API token is required: Authorization: Bearer ugro_... (manage.py token create)"
    row = find_token(token)
    if row is None:
        return 401, "the API token is unknown or revoked"
    why = policy.reason(row.user, "infer", scope=row.scope)
    if why:
        return 403, why
    mark_used(row, call.client)
    if len(_admissions) > 10_000:  # tokens are few; this bounds memory against a flood of distinct ones
        _admissions.clear()
    _admissions[digest(token)] = time.monotonic() + ADMITTED_S
    return None


async def _ready(name: str) -> list[int] | None:
    """The service's ready replicas: from the balancer's cache on the event loop, read on a thread past it."""
    cached = balancer.cached(name)
    return cached if cached is not None else await _in_thread(balancer.refresh)(name)


async def _answer(call: Call, receive, name: str, route: str) -> Answer:
    method = ROUTES.get(route)
    if method is None:
        return error(404, f"/serve/{name}/v1/{route} is not served: {', '.join(sorted(ROUTES))}")
    if call.method != method:
        return error(405, f"/v1/{route} takes {method}")
    token = _bearer(call)
    if not (token and _admitted(token)):
        refused = await _in_thread(_refusal)(call, token)
        if refused:
            return error(*refused)
    try:
        size = int(call.headers.get("content-length") or 0)
    except ValueError:
        return error(400, "the Content-Length header is not a number")
    if size > MAX_REQUEST_BYTES:
        return error(413, f"the request is {size} bytes: at most {MAX_REQUEST_BYTES}")
    body = await _body(receive) if method == "POST" else b""
    if body is None:
        return error(413, f"the request is over {MAX_REQUEST_BYTES} bytes")
    keys = await _ready(name)
    if keys is None:
        return error(404, f"no service named {name} is running")
    if route == "models":  # one model per service, named as the service, whatever each engine calls it
        listed = {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "ugro"}]}
        return Answer(200, json.dumps(listed).encode())
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        return error(400, "the request body must be a JSON object")
    if not keys:
        keys = await _woken(name)
    if not keys:
        waking = balancer.waking.get(name)
        retry = str(waking.retry_after_s if waking else 10)
        if waking and waking.gave_up:
            return error(503, f"service {name} {waking.gave_up}", **{"Retry-After": retry})
        why = f"waited {waking.timeout_s:g} s for it to wake" if waking and waking.wakes else "ugro serve --list"
        return error(503, f"no replica of service {name} is ready yet ({why})", **{"Retry-After": retry})
    headers = {h: call.headers[h] for h in FORWARDED_HEADERS if h in call.headers}
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
        kind = upstream.headers.get("content-type", "application/json")
        if not CONTENT_TYPE.fullmatch(kind.strip()):  # with nosniff, never rendered as a page of this origin
            kind = "application/octet-stream"
        relay = _relay(upstream, target, deadline, began)
        return Answer(upstream.status_code, content_type=kind, headers=[("Cache-Control", "no-cache")], chunks=relay)
    return error(502, f"no replica of service {name} answered: {why}")


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
    await _in_thread(wake)(name)
    balancer.ready.pop(name, None)  # read it again: a note of an earlier wake that failed is not this one's
    deadline = time.monotonic() + waking.timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(WAKE_POLL_S)  # the ready replicas are read at most once a second (READY_CACHE_S)
        keys = await _ready(name)
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
