"""Energy per job and attempt (docs/power.md): what the GPUs an attempt held used while it held them, its hosts' CPU
package energy where RAPL is readable, and what that cost at cluster.yaml's `power.price_per_kwh`.

Each GPU is a meter read by every health sample (cluster/node/probe.py): NVML's total energy counter (`energy_mj`)
where the GPU has one, its power draw (`power_w`) always where it reports one. Between two successive readings of a
meter the energy is the counter's difference where both readings have it (a counter that went back, a driver
reload, is not counted), else the trapezoid of the two power readings where both have one and they are at most
MAX_GAP_S apart; anything else is a gap: not counted, and the figure is "partial". A segment that straddles the
attempt's start or end counts for the part inside. A host's RAPL zones are meters too (a counter that wraps at its
`max_uj`; no power readings), counted in the share of the node's GPUs the attempt held. A GPU with no counted
segment is "not measured", never 0: an attempt none of whose GPUs was measured has no energy and no cost.

The state of every meter (energy so far, the last reading) is kept on the attempt (`Attempt.energy`): folded in by
the running loop every FOLD_EVERY_S (so raw samples, kept a day, are never needed again), and made final by it
FOLD_LAG_S after the attempt ended; what a page asks is that state plus the samples after it (`attempt_energy`,
`jobs_attempts_energy` for a list), so a running job shows its energy so far.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Q, QuerySet
from django.utils import timezone

from cluster.health import POLL_JOB_S
from cluster.models import ClusterSettings, HealthSample

from .models import Attempt, Job, Rank

MAX_GAP_S = 3 * POLL_JOB_S  # power samples further apart than this are not integrated (a node silent or not polled)
FOLD_EVERY_S = 60.0  # the running loop folds new samples into a running attempt's state this often
FOLD_LAG_S = 30.0  # a stored state stops this long before now: a slower poll may still commit an earlier sample
RECENT_END_S = 3600.0  # an attempt that ended is made final by the running loop within this long
J_PER_WH = 3600.0

# (time in epoch seconds, counter in joules or None, power in watts or None)
Reading = tuple[float, float | None, float | None]


def _number(value: Any) -> float | None:
    """A finite, non-negative number, or None for anything unreported or unusable."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def fold(meter: Mapping[str, Any] | None, readings: Iterable[Reading], start: float, end: float,
         wrap_j: float | None = None) -> dict[str, Any]:  # fmt: skip
    """A meter's state with these readings (in time order) added, counting only what lies in [start, end].

    The state: `j` (energy counted, joules), `covered_s` (time counted), `gap_s` (time in the window between
    readings that could not be counted), `how` (counter, power) and `last` (the last reading, where the next
    segment starts). `wrap_j`: where the counter wraps (RAPL's max_energy_range_uj); such a counter is read only
    over segments of at most MAX_GAP_S, in which it wraps at most once.
    """
    m: dict[str, Any] = {"j": 0.0, "covered_s": 0.0, "gap_s": 0.0, "how": [], "last": None, **(meter or {})}
    how = set(m["how"])
    last = m["last"]
    for t, counter, power in readings:
        if last is not None and t <= last[0]:
            continue
        if last is not None:
            t0, c0, w0 = last
            dt = t - t0
            inside = max(0.0, min(t, end) - max(t0, start))
            joules, kind = None, ""
            if c0 is not None and counter is not None and (wrap_j is None or dt <= MAX_GAP_S):
                diff = counter - c0
                if diff < 0 and wrap_j:
                    diff += wrap_j
                if diff >= 0:
                    joules, kind = diff, "counter"
            if joules is None and w0 is not None and power is not None and dt <= MAX_GAP_S:
                joules, kind = (w0 + power) / 2 * dt, "power"
            if inside > 0:
                if joules is None:
                    m["gap_s"] += inside
                else:
                    m["j"] += joules * inside / dt
                    m["covered_s"] += inside
                    how.add(kind)
        last = [t, counter, power]
    m["how"], m["last"] = sorted(how), last
    return m


@dataclass
class Energy:
    """An attempt's (or a job's, summed) energy as every surface shows it."""

    gpu_wh: float | None = None  # None: not measured (no GPU, or none of them reported power)
    cpu_wh: float | None = None  # None: not measured (RAPL not readable) or no host
    gpus: int = 0  # GPUs held
    not_measured: list[str] = field(default_factory=list)  # GPUs ("node:index") with no counted reading
    partial: bool = False  # a gap or a counter reset inside the window, or some GPUs not measured
    how: list[str] = field(default_factory=list)
    price_per_kwh: float | None = None
    currency: str = ""

    @property
    def measured(self) -> bool:
        return self.gpu_wh is not None or (self.gpus == 0 and self.cpu_wh is not None)

    @property
    def wh(self) -> float | None:
        """GPU and host CPU energy together; None when the GPUs were not measured."""
        if not self.measured:
            return None
        return (self.gpu_wh or 0.0) + (self.cpu_wh or 0.0)

    @property
    def kwh(self) -> float | None:
        return None if self.wh is None else self.wh / 1000

    @property
    def cost(self) -> float | None:
        return None if self.kwh is None or self.price_per_kwh is None else self.kwh * self.price_per_kwh

    def __add__(self, other: Energy) -> Energy:
        def plus(a: float | None, b: float | None) -> float | None:
            return None if a is None and b is None else (a or 0.0) + (b or 0.0)

        return Energy(
            plus(self.gpu_wh, other.gpu_wh), plus(self.cpu_wh, other.cpu_wh), self.gpus + other.gpus,
            self.not_measured + other.not_measured, self.partial or other.partial, sorted({*self.how, *other.how}),
            self.price_per_kwh, self.currency,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """The API's, `status --json`'s and `results --json`'s form: null where not measured."""

        def r(v: float | None, n: int = 3) -> float | None:
            return None if v is None else round(v, n)

        return {
            "measured": self.measured, "wh": r(self.wh), "kwh": r(self.kwh, 6), "gpu_wh": r(self.gpu_wh),
            "cpu_wh": r(self.cpu_wh), "cost": r(self.cost, 4), "currency": self.currency, "partial": self.partial,
            "not_measured": self.not_measured, "how": self.how, "text": self.text(), "detail": self.detail(),
        }  # fmt: skip

    def text(self) -> str:
        """`1.24 kWh (0.37 EUR)`, `85.2 Wh, partial`, `not measured`: what people read."""
        if self.wh is None:
            return "not measured"
        amount = f"{self.wh / 1000:.2f} kWh" if self.wh >= 1000 else f"{self.wh:.1f} Wh"
        if self.cost is not None:
            amount += f" ({self.cost:.2f}{' ' + self.currency if self.currency else ''})"
        return amount + (", partial" if self.partial else "")

    def detail(self) -> str:
        """Where the figure comes from, one line: `GPUs 85.2 Wh (counter), host CPUs not measured`."""
        how = {"counter": "NVML's energy counter", "power": "power samples"}
        gpus = "no GPU" if not self.gpus else (
            "GPUs not measured" if self.gpu_wh is None else
            f"GPUs {self.gpu_wh:.1f} Wh ({', '.join(how.get(h, h) for h in self.how) or '-'})"
        )  # fmt: skip
        cpus = f"host CPUs {self.cpu_wh:.1f} Wh" if self.cpu_wh is not None else "host CPUs not measured (no RAPL)"
        missing = f"; not measured: {', '.join(self.not_measured)}" if self.not_measured else ""
        return f"{gpus}, {cpus}{missing}"


def _at(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


def _gpu_readings(rows: list[tuple[float, list, Any]], index: int) -> list[Reading]:
    out = []
    for t, gpus, _ in rows:
        for pos, gpu in enumerate(gpus or []):
            if isinstance(gpu, Mapping) and gpu.get("index", pos) == index:
                mj = _number(gpu.get("energy_mj"))
                out.append((t, None if mj is None else mj / 1000, _number(gpu.get("power_w"))))
                break
    return out


def _rapl_readings(rows: list[tuple[float, list, Any]]) -> dict[str, tuple[list[Reading], float | None]]:
    """Per RAPL zone of a node: its readings and where its counter wraps (joules)."""
    zones: dict[str, tuple[list[Reading], float | None]] = {}
    for t, _, rapl in rows:
        for zone in rapl or []:
            if not isinstance(zone, Mapping) or not isinstance(zone.get("zone"), str):
                continue
            uj, max_uj = _number(zone.get("energy_uj")), _number(zone.get("max_uj"))
            if uj is None:
                continue
            readings, _ = zones.setdefault(zone["zone"], ([], None))
            readings.append((t, uj / 1e6, None))
            zones[zone["zone"]] = (readings, max_uj / 1e6 if max_uj else None)
    return zones


def _ranks(attempt: Attempt) -> list[Rank]:
    return list(attempt.ranks.select_related("node"))


@dataclass
class _Fold:
    """One attempt's state to fold samples into: its window [start, stop] and the samples it wants (after since)."""

    attempt: Attempt
    state: dict[str, Any]
    ranks: list[Rank]
    start: float
    stop: float
    since: float

    @classmethod
    def of(cls, attempt: Attempt, state: Mapping[str, Any] | None, end: datetime, ranks: list[Rank]) -> _Fold:
        st: dict[str, Any] = {"until": None, "gpus": {}, "hosts": {}, **(state or {})}
        start = attempt.started_at.timestamp() if attempt.started_at else 0.0
        stop = min(end, attempt.finished_at or end).timestamp()
        since = st["until"] if st["until"] is not None else start - MAX_GAP_S
        return cls(attempt, st, ranks, start, stop, since)

    def wants(self) -> Q:
        return Q(node_id__in=[r.node_id for r in self.ranks], time__gt=_at(self.since), time__lte=_at(self.stop))

    def folded(self, samples: Iterable[tuple[int, datetime, list, Any]]) -> dict[str, Any]:
        """The state with these samples (in time order; those outside its nodes and times are passed over)."""
        nodes = {r.node_id for r in self.ranks}
        by_node: dict[int, list[tuple[float, list, Any]]] = {}
        until = self.since
        for node_id, time, gpus, rapl in samples:
            t = time.timestamp()
            if node_id in nodes and self.since < t <= self.stop:
                by_node.setdefault(node_id, []).append((t, gpus, rapl))
                until = max(until, t)
        gpu_meters, host_meters = dict(self.state["gpus"]), dict(self.state["hosts"])
        for rank in self.ranks:
            rows = by_node.get(rank.node_id, [])
            for index in rank.gpu_indices or []:
                key = f"{rank.node.name}:{index}"
                gpu_meters[key] = fold(gpu_meters.get(key), _gpu_readings(rows, index), self.start, self.stop)
            for zone, (readings, wrap_j) in _rapl_readings(rows).items():
                key = f"{rank.node.name}:{zone}"
                host_meters[key] = fold(host_meters.get(key), readings, self.start, self.stop, wrap_j)
        return {**self.state, "until": until, "gpus": gpu_meters, "hosts": host_meters}


def _samples(folds: list[_Fold]) -> list[tuple[int, datetime, list, Any]]:
    """The raw samples any of these folds wants, in time order, in one query."""
    if not folds:
        return []
    wanted = Q()
    for f in folds:
        wanted |= f.wants()
    rows = HealthSample.objects.filter(wanted, kind=HealthSample.Kind.RAW, ok=True)
    return list(rows.order_by("time").values_list("node_id", "time", "gpus", "rapl"))


def fold_samples(attempt: Attempt, state: Mapping[str, Any] | None, end: datetime,
                 ranks: list[Rank] | None = None) -> dict[str, Any]:  # fmt: skip
    """The attempt's energy state with the raw health samples of its nodes up to `end` folded in (those after
    the state's `until`; from MAX_GAP_S before its start for a new state)."""
    if attempt.started_at is None:
        return {"until": None, "gpus": {}, "hosts": {}, **(state or {})}
    f = _Fold.of(attempt, state, end, _ranks(attempt) if ranks is None else ranks)
    return f.folded(_samples([f]))


def summarize(attempt: Attempt, state: Mapping[str, Any], settings: ClusterSettings | None = None,
              ranks: list[Rank] | None = None) -> Energy:  # fmt: skip
    """The Energy a state says: every GPU the attempt held (one never read is not measured), its hosts' CPU
    energy in the share of each node's GPUs it held, the price from the cluster's settings."""
    cs = settings or ClusterSettings.load()
    gpu_meters, host_meters = state.get("gpus") or {}, state.get("hosts") or {}
    e = Energy(price_per_kwh=cs.price_per_kwh, currency=cs.currency)
    gpu_j, cpu_j, cpu_read, how = 0.0, 0.0, False, set()
    for rank in _ranks(attempt) if ranks is None else ranks:
        held = rank.gpu_indices or []
        for index in held:
            key = f"{rank.node.name}:{index}"
            meter = gpu_meters.get(key) or {}
            e.gpus += 1
            if meter.get("covered_s", 0) > 0:
                gpu_j += meter["j"]
                e.partial = e.partial or meter.get("gap_s", 0) > 0
                how.update(meter.get("how") or [])
            else:
                e.not_measured.append(key)
        share = len(held) / rank.node.gpu_count if held and rank.node.gpu_count else 1.0
        for key, meter in host_meters.items():
            if key.startswith(f"{rank.node.name}:") and meter.get("covered_s", 0) > 0:
                cpu_j += meter["j"] * share
                cpu_read = True
    e.partial = e.partial or (bool(e.not_measured) and len(e.not_measured) < e.gpus)
    e.gpu_wh = gpu_j / J_PER_WH if e.gpus > len(e.not_measured) else None
    e.cpu_wh = cpu_j / J_PER_WH if cpu_read else None
    e.how = sorted(how)
    return e


def attempt_energy(attempt: Attempt, now: datetime | None = None, settings: ClusterSettings | None = None) -> Energy:
    """An attempt's energy now: its stored state, and the samples since (none once the state is final)."""
    state, ranks = attempt.energy or {}, _ranks(attempt)
    if attempt.started_at is not None and not state.get("final"):
        state = fold_samples(attempt, state, now or timezone.now(), ranks)
    return summarize(attempt, state, settings, ranks)


def jobs_attempts_energy(jobs: Iterable[Job], now: datetime | None = None, settings: ClusterSettings | None = None
                         ) -> dict[int, list[tuple[Attempt, Energy]]]:  # fmt: skip
    """Each job's started attempts with their energy, for many jobs in four queries (a list costs no more)."""
    cs = settings or ClusterSettings.load()
    ids = [j.pk for j in jobs]
    attempts = list(Attempt.objects.filter(job_id__in=ids, started_at__isnull=False).order_by("job_id", "number"))
    ranks: dict[int, list[Rank]] = {}
    for rank in Rank.objects.filter(attempt__in=[a.pk for a in attempts]).select_related("node"):
        ranks.setdefault(rank.attempt_id, []).append(rank)
    end = now or timezone.now()
    live = [a for a in attempts if not (a.energy or {}).get("final")]
    folds = {a.pk: _Fold.of(a, a.energy, end, ranks.get(a.pk, [])) for a in live}
    samples = _samples(list(folds.values()))
    out: dict[int, list[tuple[Attempt, Energy]]] = {pk: [] for pk in ids}
    for a in attempts:
        state = folds[a.pk].folded(samples) if a.pk in folds else a.energy
        out[a.job_id].append((a, summarize(a, state, cs, ranks.get(a.pk, []))))
    return out


def _total(each: list[tuple[Attempt, Energy]], cs: ClusterSettings) -> Energy:
    total = Energy(price_per_kwh=cs.price_per_kwh, currency=cs.currency)
    for _, e in each:
        total = total + e
    return total


def job_energies(jobs: Iterable[Job], now: datetime | None = None) -> dict[int, Energy]:
    """Each job's energy (its attempts' summed), for many jobs in four queries: tables and Prometheus."""
    cs = ClusterSettings.load()
    return {pk: _total(each, cs) for pk, each in jobs_attempts_energy(jobs, now, cs).items()}


def job_energy(job: Job, now: datetime | None = None) -> Energy:
    """A job's energy: its attempts' summed (an attempt never started adds nothing)."""
    return job_energies([job], now)[job.pk]


def energy_records(jobs: Iterable[Job]) -> dict[int, dict[str, Any]]:
    """Each job's energy as JSON (`status --json`, `results --json`, the API): the total and each attempt's."""
    cs = ClusterSettings.load()
    return {
        pk: {**_total(each, cs).to_dict(), "attempts": [{"attempt": a.number, **e.to_dict()} for a, e in each]}
        for pk, each in jobs_attempts_energy(jobs, settings=cs).items()
    }


def energy_record(job: Job) -> dict[str, Any]:
    """One job's `energy_records`."""
    return energy_records([job])[job.pk]


def record(attempt: Attempt, now: datetime | None = None) -> bool:
    """Fold the samples up to FOLD_LAG_S ago into the stored state (final once the attempt ended that long ago).

    A conditional update from the state read: of two workers folding at once, one writes. True if this one did.
    """
    now = now or timezone.now()
    old = attempt.energy or {}
    if attempt.started_at is None or old.get("final"):
        return False
    new = fold_samples(attempt, old, now - timedelta(seconds=FOLD_LAG_S))
    ended = attempt.finished_at is not None and (now - attempt.finished_at).total_seconds() >= FOLD_LAG_S
    new["final"] = ended
    done = Attempt.objects.filter(pk=attempt.pk, energy=old).update(energy=new)
    if done:
        attempt.energy = new
    return bool(done)


def record_due(jobs: QuerySet[Job], now: datetime | None = None) -> int:
    """The running loop's rule: fold the current attempt of each running job whose state is FOLD_EVERY_S old (or
    new), and make final each attempt that ended in the last RECENT_END_S, once FOLD_LAG_S after its end.
    Returns how many were written."""
    now = now or timezone.now()
    running = Attempt.objects.filter(pk__in=jobs.filter(state=Job.State.RUNNING).values("current"))
    ended = Attempt.objects.filter(
        job__in=jobs,
        finished_at__gte=now - timedelta(seconds=RECENT_END_S),
        finished_at__lte=now - timedelta(seconds=FOLD_LAG_S),
        started_at__isnull=False,
    )
    folded = 0
    for attempt in running.filter(started_at__isnull=False):
        until = (attempt.energy or {}).get("until")
        if until is None or now.timestamp() - FOLD_LAG_S - until >= FOLD_EVERY_S:
            folded += record(attempt, now)
    for attempt in ended:
        if not (attempt.energy or {}).get("final"):
            folded += record(attempt, now)
    return folded
