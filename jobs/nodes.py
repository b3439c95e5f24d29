"""Talking to all of a job's nodes at once: one thread per node, warm links underneath."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from django.db import connections

from cluster.links import AgentRequestError, LinkError
from cluster.models import Node

T = TypeVar("T")


def on_each[T](items: Iterable[T], fn: Callable[[T], Any]) -> list[tuple[T, Any, Exception | None]]:
    """Run fn on every item concurrently; return (item, result, error) in input order."""
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

    with ThreadPoolExecutor(max_workers=min(len(items), 64)) as ex:
        return list(ex.map(call, items))


def node_request(target: Node, op: str, /, timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
    return target.link().request(op, timeout=timeout, **fields)
