"""Talking to many nodes at once: one thread per node, warm links underneath."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

from django.db import connections

from .links import AgentRequestError, LinkBusy, LinkError
from .models import Node

T = TypeVar("T")


class Late(LinkBusy):
    """on_each's `within` passed before this item's call answered (the call goes on by itself)."""


def on_each[T](
    items: Iterable[T], fn: Callable[[T], Any], pool: ThreadPoolExecutor | None = None, within: float | None = None
) -> list[tuple[T, Any, Exception | None]]:
    """Run fn on every item concurrently; return (item, result, error) in input order.

    pool: an executor whose threads are kept, so that a caller that runs every pass (the follower's node reads)
    does not start a thread per node each time; fn must not wait for other work of the same pool.
    Without it, threads of this call's own. within (with a pool): return after that many seconds with what
    has answered; a call still running is left to finish on its own, its result unused, and its item gets
    Late (a LinkBusy: not a sign of an unreachable node)."""
    items = list(items)
    if not items:
        return []

    def call(item: T) -> tuple[T, Any, Exception | None]:
        try:
            return item, fn(item), None
        except (LinkError, AgentRequestError, OSError) as exc:
            return item, None, exc
        finally:
            connections.close_all()  # this pool thread's own connections, if it opened any

    if pool is not None:
        futures = [pool.submit(call, item) for item in items]
        if within is None:
            return [f.result() for f in futures]
        done, _ = wait(futures, timeout=within)
        late = f"no answer within {within:g} s; left to finish"
        return [f.result() if f in done else (item, None, Late(late))
                for item, f in zip(items, futures, strict=True)]  # fmt: skip
    with ThreadPoolExecutor(max_workers=min(len(items), 64)) as ex:
        return list(ex.map(call, items))


def node_request(target: Node, op: str, /, timeout: float = 30.0, when_silent: bool = True,
                 **fields: Any) -> dict[str, Any]:  # fmt: skip
    return target.link().request(op, timeout=timeout, when_silent=when_silent, **fields)


def unreachable(err: Exception | None) -> bool:
    """Whether an error says the node could not be reached (connecting failed, the link was found dead
    before the request was written, or the socket failed), as opposed to a node that answered with an
    error or a request it took but answered late. Only the first counts as silence towards calling a
    rank lost: a controller too busy to read answers in time must not fail jobs whose nodes are fine. A
    node that really fell off is unreachable on the very next request: the late answer drops the link and
    marks it silent, and the requests after it fail at once (cluster/links.py) or cannot connect. A link
    merely busy with another long request is not silence."""
    if isinstance(err, LinkBusy):
        return False
    if isinstance(err, LinkError):
        return not err.delivered
    return isinstance(err, OSError)
