"""Which replica takes a request: the ready one with the fewest requests outstanding (from this web server),
ties to the one least recently picked; a replica that just failed a request sits out a moment (its health
check, every few seconds in the worker, is slower to notice)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from .models import Replica, Service

COOLDOWN_S = 5.0
READY_CACHE_S = 1.0  # the ready replicas are read from the database at most this often per service


@dataclass
class Target:
    key: int  # the replica's pk
    url: str
    model: str  # what its engine calls the model: requests name the service, the replica gets this
    outstanding: int = 0
    picked: int = 0
    failed_at: float = 0.0


class Balancer:
    """Per web server process: its view of each service's ready replicas and its own requests to them."""

    def __init__(self) -> None:
        self.targets: dict[int, Target] = {}
        self.ready: dict[str, tuple[float, list[int]]] = {}
        self.ticket = itertools.count(1)

    def refresh(self, service: str) -> list[int] | None:
        """The ready replicas' keys (read again past READY_CACHE_S); None when no such service runs."""
        seen = self.ready.get(service)
        now = time.monotonic()
        if seen is not None and now - seen[0] < READY_CACHE_S:
            return seen[1]
        if not Service.objects.filter(name=service, state=Service.State.RUNNING).exists():
            self.ready.pop(service, None)
            return None
        rows = Replica.objects.filter(service__name=service, state=Replica.State.READY)
        rows = rows.select_related("node", "service")
        keys = []
        for r in rows:
            t = self.targets.get(r.pk)
            model = served_model(r)
            if t is None or (t.url, t.model) != (r.url, model):
                self.targets[r.pk] = t = Target(r.pk, r.url, model)
            keys.append(t.key)
        self.ready[service] = (now, keys)
        return keys

    def pick(self, keys: list[int], exclude: set[int] = frozenset()) -> Target | None:
        now = time.monotonic()
        candidates = [self.targets[k] for k in keys if k not in exclude]
        rested = [t for t in candidates if now - t.failed_at >= COOLDOWN_S] or candidates
        if not rested:
            return None
        best = min(rested, key=lambda t: (t.outstanding, t.picked))
        best.picked = next(self.ticket)
        return best

    def failed(self, target: Target) -> None:
        target.failed_at = time.monotonic()


def served_model(replica: Replica) -> str:
    """The model name the replica's engine answers to: transformers serve is pinned to the checkpoint's path;
    vLLM and SGLang are started with --served-model-name NAME; a custom command is given {name}."""
    if replica.service.engine == Service.Engine.TRANSFORMERS:
        return replica.model_path
    return replica.service.name


balancer = Balancer()
