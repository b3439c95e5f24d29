"""Node health from one probe sample: a score, a status, alert conditions, and when to look again.

Pure functions over the dict the node agent's `probe` op returns (cluster/node/probe.py), plus
`rtt_ms` (the controller's round-trip time for that request), `expected_job` (the tag of the
job that should be running on the node, or None) and optionally `node` (the node's name: job
processes tagged with another UGRO_NODE are ignored). No database access here.

Score (0-100) is the sum of four parts:

* GPU, 40 points. Each declared GPU is worth 40 / max(declared, present) points: half for being
  present, a quarter for temperature (full up to `gpu_temp_warn`, half up to `gpu_temp_crit`,
  none above) and a quarter for memory (at least `gpu_mem_free_min_mb` free; only judged when no
  job is expected, since a training job is meant to fill its GPUs). A missing declared GPU scores
  nothing and is a critical check whose detail carries the probe's `gpu_error`. A node declared
  with 0 GPUs gets the full 40 without any. Unreported readings (None) are not penalised.
* System, 30 points: 10 each for CPU (full below `cpu_warn`, falling to 0 at 100 %), RAM (full
  up to `ram_warn`, half up to `ram_crit`, none above) and disk of the workdir (full up to
  `disk_warn`, falling to 0 at 100 %).
* Network, 20 points from the SSH round trip: full below 50 ms, falling linearly to 0 at
  1000 ms. Not measured => full marks.
* Processes, 10 points: with a job expected, its processes must be on the node (else 0); job
  processes of any other job are strays, worth half the points (they usually hold GPU memory).

Status rule: "healthy" when score >= `score_warn` and no check failed at critical severity;
otherwise "degraded". `score_sample` never returns "down": a node is down only when it cannot be
reached, which the circuit `Breaker` decides (3 consecutive failed probes), not the score.

Critical checks: a missing declared GPU, a GPU above `gpu_temp_crit`, RAM above `ram_crit`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "critical"]
Status = Literal["healthy", "degraded", "down"]

GPU_POINTS = 40.0
SYSTEM_POINTS = 30.0
NETWORK_POINTS = 20.0
PROCESS_POINTS = 10.0
RTT_FULL_MS = 50.0
RTT_ZERO_MS = 1000.0

POLL_JOB_S = 5.0
POLL_ACTIVE_S = 10.0
POLL_RECENT_S = 20.0
POLL_IDLE_S = 40.0
POLL_MAX_S = 60.0
ACTIVE_WINDOW_S = 30 * 60.0
RECENT_WINDOW_S = 2 * 3600.0

BREAKER_TRIP_AFTER = 3
BACKOFF_BASE_S = 5.0
BACKOFF_MAX_S = 300.0
BACKOFF_JITTER = 0.2


@dataclass
class Thresholds:
    """Limits for checks and alerts; percentages are 0-100, temperatures in degrees C."""

    gpu_temp_warn: float = 80
    gpu_temp_crit: float = 85
    ram_warn: float = 90
    ram_crit: float = 95
    disk_warn: float = 90
    score_warn: int = 70
    score_crit: int = 50
    gpu_mem_free_min_mb: float = 1024
    cpu_warn: float = 95


@dataclass
class Check:
    """One judged aspect of a sample; `severity` is "info" when ok."""

    name: str
    ok: bool
    detail: str
    severity: Severity = "info"


@dataclass
class HealthResult:
    """Score 0-100, status, the checks behind them, and the points of each part."""

    score: int
    status: Status
    checks: list[Check] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def reason(self) -> str:
        """A one-line summary of what is wrong, worst first (empty when nothing is)."""
        order = {"critical": 0, "warning": 1, "info": 2}
        bad = sorted(self.failed, key=lambda c: order[c.severity])
        return "; ".join(c.detail for c in bad)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _num(value: Any) -> float | None:
    """A finite number, or None for anything unreported or unusable."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _falling(value: float, full_until: float, zero_at: float) -> float:
    """1 up to `full_until`, linearly down to 0 at `zero_at`."""
    if value <= full_until:
        return 1.0
    if value >= zero_at or zero_at <= full_until:
        return 0.0
    return (zero_at - value) / (zero_at - full_until)


def _gpu_part(sample: Mapping[str, Any], declared: int, t: Thresholds, checks: list[Check]) -> float:
    gpus = [g for g in sample.get("gpus") or [] if isinstance(g, Mapping)]
    if declared <= 0:
        checks.append(Check("gpu_count", True, "no GPUs declared"))
        return GPU_POINTS
    present = len(gpus)
    if present < declared:
        why = sample.get("gpu_error") or f"reader: {sample.get('gpu_source') or 'unknown'}"
        checks.append(Check("gpu_count", False, f"{present} of {declared} declared GPUs visible ({why})", "critical"))
    else:
        checks.append(Check("gpu_count", True, f"{present} of {declared} declared GPUs visible"))
    job_expected = bool(sample.get("expected_job"))
    earned = 0.0
    for pos, gpu in enumerate(gpus):
        label = gpu.get("index", pos)
        temp = _num(gpu.get("temp_c"))
        if temp is None:
            temp_factor = 1.0
        elif temp > t.gpu_temp_crit:
            temp_factor = 0.0
            checks.append(Check(f"gpu_temp:{label}", False, f"GPU {label} at {temp:g} C", "critical"))
        elif temp > t.gpu_temp_warn:
            temp_factor = 0.5
            checks.append(Check(f"gpu_temp:{label}", False, f"GPU {label} at {temp:g} C", "warning"))
        else:
            temp_factor = 1.0
            checks.append(Check(f"gpu_temp:{label}", True, f"GPU {label} at {temp:g} C"))
        used, total = _num(gpu.get("mem_used_mb")), _num(gpu.get("mem_total_mb"))
        mem_factor = 1.0
        if not job_expected and used is not None and total is not None:
            free = total - used
            if free < t.gpu_mem_free_min_mb:
                mem_factor = 0.0
                checks.append(
                    Check(
                        f"gpu_mem:{label}",
                        False,
                        f"GPU {label} has {free:g} MB free with no job expected",
                        "warning",
                    )
                )
        earned += 0.5 + 0.25 * temp_factor + 0.25 * mem_factor
    return GPU_POINTS * earned / max(declared, present)


def _system_part(sample: Mapping[str, Any], t: Thresholds, checks: list[Check]) -> float:
    per = SYSTEM_POINTS / 3
    points = 0.0
    cpu = _num(sample.get("cpu_percent"))
    if cpu is None:
        points += per
    else:
        points += per * _falling(cpu, t.cpu_warn, 100.0)
        ok = cpu < t.cpu_warn
        checks.append(Check("cpu", ok, f"CPU {cpu:g} % busy", "info" if ok else "warning"))
    ram = _num(sample.get("ram_percent"))
    if ram is None:
        points += per
    elif ram > t.ram_crit:
        checks.append(Check("ram", False, f"RAM {ram:g} % used", "critical"))
    elif ram > t.ram_warn:
        points += per / 2
        checks.append(Check("ram", False, f"RAM {ram:g} % used", "warning"))
    else:
        points += per
        checks.append(Check("ram", True, f"RAM {ram:g} % used"))
    disk = _num(sample.get("disk_percent"))
    if disk is None:
        points += per
    else:
        points += per * _falling(disk, t.disk_warn, 100.0)
        ok = disk <= t.disk_warn
        checks.append(Check("disk", ok, f"disk {disk:g} % used", "info" if ok else "warning"))
    return points


def _network_part(sample: Mapping[str, Any], checks: list[Check]) -> float:
    rtt = _num(sample.get("rtt_ms"))
    if rtt is None:
        return NETWORK_POINTS
    factor = 1.0 if rtt < RTT_FULL_MS else _falling(rtt, RTT_FULL_MS, RTT_ZERO_MS)
    # Below half marks the link is slow enough to stretch every control round trip.
    ok = factor >= 0.5
    checks.append(Check("rtt", ok, f"SSH round trip {rtt:.0f} ms", "info" if ok else "warning"))
    return NETWORK_POINTS * factor


def _process_part(sample: Mapping[str, Any], checks: list[Check]) -> float:
    expected = sample.get("expected_job") or None
    node = sample.get("node") or None
    procs = [p for p in sample.get("job_procs") or [] if isinstance(p, Mapping)]
    if node:
        # Loopback test nodes share one machine: another node's ranks are not ours, nor strays.
        procs = [p for p in procs if p.get("node") in (None, node)]
    mine = [p for p in procs if p.get("job") == expected] if expected else []
    strays = sorted({str(p.get("job")) for p in procs if p.get("job") != expected})
    if expected and not mine:
        checks.append(Check("job_procs", False, f"no processes of job {expected} on the node", "warning"))
        return 0.0
    if strays:
        checks.append(Check("job_procs", False, f"leftover processes of job(s) {', '.join(strays)}", "warning"))
        return PROCESS_POINTS / 2
    detail = f"{len(mine)} processes of job {expected}" if expected else "no job expected"
    checks.append(Check("job_procs", True, detail))
    return PROCESS_POINTS


def score_sample(sample: Mapping[str, Any], declared_gpus: int, thresholds: Thresholds | None = None) -> HealthResult:
    """Judge one probe sample (see the module docstring for the weights and the status rule)."""
    t = thresholds or Thresholds()
    checks: list[Check] = []
    parts = {
        "gpu": _gpu_part(sample, int(declared_gpus or 0), t, checks),
        "system": _system_part(sample, t, checks),
        "network": _network_part(sample, checks),
        "processes": _process_part(sample, checks),
    }
    parts = {k: round(v, 1) for k, v in parts.items()}
    score = max(0, min(100, round(sum(parts.values()))))
    critical = any(not c.ok and c.severity == "critical" for c in checks)
    status: Status = "healthy" if score >= t.score_warn and not critical else "degraded"
    return HealthResult(score=score, status=status, checks=checks, parts=parts)


def poll_interval(job_running: bool, last_activity_age_s: float | None) -> float:
    """Seconds until the next probe: often while a job runs, rarely on a long-idle node."""
    if job_running:
        interval = POLL_JOB_S
    elif last_activity_age_s is None:
        interval = POLL_IDLE_S
    elif last_activity_age_s <= ACTIVE_WINDOW_S:
        interval = POLL_ACTIVE_S
    elif last_activity_age_s <= RECENT_WINDOW_S:
        interval = POLL_RECENT_S
    else:
        interval = POLL_IDLE_S
    return min(interval, POLL_MAX_S)


@dataclass
class Breaker:
    """Per-node circuit breaker over probe failures; lives in a JSONField via to/from_dict.

    Closed: every poll tries. The 3rd consecutive failure opens it (the node is DOWN); then
    retries wait 5, 10, 20, 40 ... s (at most 300 s, each +-20 % jitter) between attempts.
    A success closes it again. `now` is any monotonic-enough clock in seconds (epoch time is
    fine and survives restarts).
    """

    failures: int = 0
    open_until: float | None = None
    state: Literal["closed", "open"] = "closed"

    def backoff(self, rng: Callable[[], float] = random.random) -> float:
        """Wait before the next retry after the current number of failures (open state)."""
        step = min(max(self.failures - BREAKER_TRIP_AFTER, 0), 32)  # bounded: no huge powers
        base = min(BACKOFF_BASE_S * 2**step, BACKOFF_MAX_S)
        jittered = base * (1 + BACKOFF_JITTER * (2 * rng() - 1))
        return min(jittered, BACKOFF_MAX_S)

    def record_failure(self, now: float, rng: Callable[[], float] = random.random) -> bool:
        """Count a failed probe; True exactly when this failure takes the node DOWN."""
        self.failures += 1
        if self.failures < BREAKER_TRIP_AFTER:
            return False
        tripped = self.state != "open"
        self.state = "open"
        self.open_until = now + self.backoff(rng)
        return tripped

    def trip(self, now: float, rng: Callable[[], float] = random.random) -> bool:
        """Open at once (a node never reached has no good record to protect); True if it was closed."""
        self.failures = max(self.failures, BREAKER_TRIP_AFTER)
        tripped = self.state != "open"
        self.state = "open"
        self.open_until = now + self.backoff(rng)
        return tripped

    @property
    def suspect(self) -> bool:
        """Closed but with failed probes: probed again on the next tick, whatever its interval."""
        return self.state == "closed" and self.failures > 0

    def should_try(self, now: float) -> bool:
        """Whether a probe may be sent now (always when closed; after the backoff when open)."""
        if self.state != "open":
            return True
        return self.open_until is None or now >= self.open_until

    def record_success(self, now: float) -> bool:
        """Reset after a good probe; True when this was a recovery from DOWN."""
        recovered = self.state == "open"
        self.failures, self.open_until, self.state = 0, None, "closed"
        return recovered

    def to_dict(self) -> dict[str, Any]:
        return {"failures": self.failures, "open_until": self.open_until, "state": self.state}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Breaker:
        """Rebuild from `to_dict` output; an empty or missing value is a fresh, closed breaker."""
        data = data or {}
        state = "open" if data.get("state") == "open" else "closed"
        open_until = data.get("open_until")
        return cls(
            failures=int(data.get("failures") or 0),
            open_until=float(open_until) if open_until is not None else None,
            state=state,
        )


def alert_conditions(
    result: HealthResult, sample: Mapping[str, Any], thresholds: Thresholds | None = None
) -> list[tuple[str, str, str]]:
    """(key, severity, message) for each alert-worthy condition now true.

    Keys are stable per condition ("score", "gpu_temp:<index>", "gpu_count", "ram", "disk") and
    do not include the severity, so the caller keeps one open alert per key and can escalate it.
    """
    t = thresholds or Thresholds()
    alerts: list[tuple[str, str, str]] = []
    if result.score < t.score_crit:
        alerts.append(("score", "critical", f"health score {result.score} (below {t.score_crit})"))
    elif result.score < t.score_warn:
        alerts.append(("score", "warning", f"health score {result.score} (below {t.score_warn})"))
    for check in result.checks:
        # Missing GPUs sink a job placed on the node, so they alert on their own.
        if check.name == "gpu_count" and not check.ok:
            alerts.append(("gpu_count", "critical", check.detail))
    for pos, gpu in enumerate(sample.get("gpus") or []):
        if not isinstance(gpu, Mapping):
            continue
        label = gpu.get("index", pos)
        temp = _num(gpu.get("temp_c"))
        if temp is None:
            continue
        if temp > t.gpu_temp_crit:
            alerts.append((f"gpu_temp:{label}", "critical", f"GPU {label} at {temp:g} C"))
        elif temp > t.gpu_temp_warn:
            alerts.append((f"gpu_temp:{label}", "warning", f"GPU {label} at {temp:g} C"))
    ram = _num(sample.get("ram_percent"))
    if ram is not None and ram > t.ram_crit:
        alerts.append(("ram", "critical", f"RAM {ram:g} % used"))
    elif ram is not None and ram > t.ram_warn:
        alerts.append(("ram", "warning", f"RAM {ram:g} % used"))
    disk = _num(sample.get("disk_percent"))
    if disk is not None and disk > t.disk_warn:
        alerts.append(("disk", "warning", f"disk {disk:g} % used"))
    return alerts
