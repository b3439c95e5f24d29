"""Which replica takes a request: the ready one with the fewest requests outstanding (from this web server),
ties to the one least recently picked; a replica that just failed a request sits out a moment (its health
check, every few seconds in the worker, is slower to notice)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from .engines import COLD_START_S
from .models import Replica, Service

COOLDOWN_S = 5.0
GAVE_UP = "could not wake: "  # the note of a service back asleep after a wake whose replica never answered
READY_CACHE_S = 1.0  # the ready replicas are read from the database at most this often per service


@dataclass
class Target:
    key: int  # the replica's pk
    url: str
    model: str  # what its engine calls the model: requests name the service, the replica gets this
    outstanding: int = 0
    picked: int = 0
    failed_at: float = 0.0
    busy: float = 0.0  # requests in flight times seconds, since the last sample
    changed: float = field(default_factory=time.monotonic)
    sampled: float = field(default_factory=time.monotonic)

    def _tick(self) -> None:
        now = time.monotonic()
        self.busy += self.outstanding * (now - self.changed)
        self.changed = now

    def begin(self) -> None:
        self._tick()
        self.outstanding += 1

    def end(self) -> None:
        self._tick()
        self.outstanding -= 1

    def sample(self) -> tuple[int, float]:
        """Requests in flight now, and on average since the last sample (the autoscaler's load)."""
        self._tick()
        span = max(self.changed - self.sampled, 1e-6)
        mean, self.busy, self.sampled = self.busy / span, 0.0, self.changed
        return self.outstanding, mean


@dataclass
class Waking:
    """What the endpoint needs of a service with no ready replica: whether it wakes (min_replicas 0) and how long
    a request waits for it."""

    wakes: bool
    timeout_s: float
    retry_after_s: int
    gave_up: str = ""  # "could not wake: ..." while the service is back asleep after a wake that failed


class Balancer:
    """Per web server process: its view of each service's ready replicas and its own requests to them."""

    def __init__(self) -> None:
        self.targets: dict[int, Target] = {}
        self.ready: dict[str, tuple[float, list[int]]] = {}
        self.waking: dict[str, Waking] = {}
        self.ticket = itertools.count(1)
        self.reported: set[int] = set()  # targets whose last sample had requests in flight

    def cached(self, service: str) -> list[int] | None:
        """The ready replicas' keys when read within READY_CACHE_S, else None (no database read)."""
        seen = self.ready.get(service)
        return seen[1] if seen is not None and time.monotonic() - seen[0] < READY_CACHE_S else None

    def refresh(self, service: str) -> list[int] | None:
        """The ready replicas' keys (read again past READY_CACHE_S); None when no such service runs."""
        cached = self.cached(service)
        if cached is not None:
            return cached
        now = time.monotonic()
        row = Service.objects.filter(name=service, state__in=Service.AWAKE_OR_ASLEEP).first()
        if row is None:
            self.ready.pop(service, None)
            return None
        timeout = float(row.cold_start_timeout_s or COLD_START_S.get(row.engine, 300))
        retry = max(1, round(row.last_cold_start_s)) if row.last_cold_start_s else 10
        gave_up = row.note if row.state == Service.State.SLEEPING and row.note.startswith(GAVE_UP) else ""
        self.waking[service] = Waking(row.min_replicas == 0, timeout, retry, gave_up)
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

    def samples(self) -> dict[int, tuple[int, float]]:
        """Each replica's requests in flight now and on average since the last call, for those that had or have
        any (a replica that had some is reported once more at zero). Called on the event loop, by the flusher."""
        out = {}
        for key, target in self.targets.items():
            outstanding, mean = target.sample()
            if outstanding or mean > 0 or key in self.reported:
                out[key] = (outstanding, mean)
        self.reported = {key for key, (n, mean) in out.items() if n or mean > 0}
        return out


def served_model(replica: Replica) -> str:
    """The model name the replica's engine answers to: transformers serve is pinned to the checkpoint's path;
    vLLM and SGLang are started with --served-model-name NAME; a custom command is given {name}."""
    if replica.service.engine == Service.Engine.TRANSFORMERS:
        return replica.model_path
    return replica.service.name


balancer = Balancer()
