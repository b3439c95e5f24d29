"""Tests of cluster/health.py: scoring, status, poll intervals, the breaker and alert conditions.

Pure functions over plain dicts: no database, no clock, no network.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from cluster.health import (
    Breaker,
    HealthResult,
    Thresholds,
    alert_conditions,
    poll_interval,
    score_sample,
)


def gpu(index: int = 0, temp: float | None = 50, used: float | None = 500, total: float | None = 12282) -> dict:
    return {
        "index": index,
        "name": "NVIDIA GeForce RTX 4070",
        "uuid": f"GPU-{index}",
        "util_percent": 10,
        "mem_used_mb": used,
        "mem_total_mb": total,
        "temp_c": temp,
        "power_w": 40.0,
    }


def sample(**overrides: Any) -> dict:
    """A healthy one-GPU, idle node sample; keyword arguments replace fields."""
    base: dict[str, Any] = {
        "time": 1_700_000_000.0,
        "hostname": "node-a",
        "uptime_s": 3600.0,
        "load": [0.5, 0.4, 0.3],
        "cpu_percent": 12.0,
        "ram_percent": 40.0,
        "ram_total_mb": 32000.0,
        "disk_percent": 50.0,
        "disk_free_gb": 200.0,
        "gpus": [gpu(0)],
        "gpu_source": "nvml",
        "gpu_error": None,
        "job_procs": [],
        "rtt_ms": 5.0,
        "expected_job": None,
    }
    base.update(overrides)
    return base


def check(result: HealthResult, name: str):
    (found,) = [c for c in result.checks if c.name == name]
    return found


def keys(alerts: list[tuple[str, str, str]]) -> dict[str, str]:
    return {key: severity for key, severity, _ in alerts}


# -- score and status ------------------------------------------------------------------------


def test_healthy_node_scores_full_marks() -> None:
    # Given a cool, idle one-GPU node on a fast link
    # When it is scored
    result = score_sample(sample(), declared_gpus=1, thresholds=Thresholds())
    # Then every part is full and the node is healthy with no failed checks
    assert result.score == 100 and result.status == "healthy"
    assert result.parts == {"gpu": 40.0, "system": 30.0, "network": 20.0, "processes": 10.0}
    assert result.failed == [] and result.reason() == ""
    assert alert_conditions(result, sample(), Thresholds()) == []
    json.dumps(result.to_dict())


def test_node_without_declared_gpus_gets_full_gpu_marks() -> None:
    # Given a CPU-only node declared with 0 GPUs and no GPU tools
    s = sample(gpus=[], gpu_source="none", gpu_error="nvidia-smi was not found on PATH")
    # Then missing GPUs are not held against it
    result = score_sample(s, declared_gpus=0, thresholds=Thresholds())
    assert result.score == 100 and result.status == "healthy"
    assert check(result, "gpu_count").ok


def test_missing_declared_gpu_is_critical_with_the_reason() -> None:
    # Given a node declared with 2 GPUs of which the driver shows 1
    s = sample(gpus=[gpu(0)], gpu_error=None, gpu_source="nvidia-smi")
    # When it is scored
    result = score_sample(s, declared_gpus=2, thresholds=Thresholds())
    # Then it loses that GPU's share and is degraded by a critical check
    assert result.parts["gpu"] == 20.0 and result.score == 80
    assert result.status == "degraded"
    count = check(result, "gpu_count")
    assert not count.ok and count.severity == "critical" and "1 of 2" in count.detail
    assert keys(alert_conditions(result, s, Thresholds()))["gpu_count"] == "critical"


def test_no_gpus_visible_carries_the_probe_error() -> None:
    s = sample(gpus=[], gpu_source="none", gpu_error="NVML did not initialise (Driver Not Loaded)")
    result = score_sample(s, declared_gpus=1, thresholds=Thresholds())
    assert result.parts["gpu"] == 0.0 and result.score == 60 and result.status == "degraded"
    assert "Driver Not Loaded" in result.reason()


def test_extra_gpus_are_not_penalised() -> None:
    result = score_sample(sample(gpus=[gpu(0), gpu(1)]), declared_gpus=1, thresholds=Thresholds())
    assert result.score == 100 and check(result, "gpu_count").ok


@pytest.mark.parametrize(
    ("temp", "gpu_points", "status", "severity"),
    [
        (80, 40.0, "healthy", "info"),  # at the warning line: still fine
        (82, 35.0, "healthy", "warning"),  # warm: a quarter of a GPU's share, halved
        (85, 35.0, "healthy", "warning"),  # at the critical line: still only a warning
        (90, 30.0, "degraded", "critical"),  # too hot: critical
    ],
)
def test_gpu_temperature(temp: float, gpu_points: float, status: str, severity: str) -> None:
    # Given one GPU at the given temperature
    result = score_sample(sample(gpus=[gpu(0, temp=temp)]), declared_gpus=1, thresholds=Thresholds())
    # Then the GPU part, the status and the check's severity follow the thresholds
    assert result.parts["gpu"] == gpu_points
    assert result.status == status
    assert check(result, "gpu_temp:0").severity == severity


def test_unreported_gpu_readings_are_not_penalised() -> None:
    s = sample(gpus=[gpu(0, temp=None, used=None, total=None)])
    assert score_sample(s, declared_gpus=1, thresholds=Thresholds()).score == 100


def test_gpu_memory_held_on_an_idle_node_is_a_warning() -> None:
    # Given an idle node (no job expected) whose GPU has only 500 MB free
    s = sample(gpus=[gpu(0, used=11782, total=12282)])
    # Then the memory quarter of the GPU share is lost, as a warning
    result = score_sample(s, declared_gpus=1, thresholds=Thresholds())
    assert result.parts["gpu"] == 30.0 and result.status == "healthy"
    assert check(result, "gpu_mem:0").severity == "warning"


def test_gpu_memory_full_during_a_job_is_expected() -> None:
    # Given the same full GPU while our job runs on the node
    procs = [{"pid": 10, "job": "j1", "node": "a", "cmd": "python train.py"}]
    s = sample(gpus=[gpu(0, used=11782, total=12282)], expected_job="j1", job_procs=procs)
    # Then it costs nothing
    result = score_sample(s, declared_gpus=1, thresholds=Thresholds())
    assert result.score == 100 and not [c for c in result.checks if c.name.startswith("gpu_mem")]


@pytest.mark.parametrize(
    ("ram", "points", "severity", "status"),
    [(90, 30.0, "info", "healthy"), (92, 25.0, "warning", "healthy"), (96, 20.0, "critical", "degraded")],
)
def test_ram(ram: float, points: float, severity: str, status: str) -> None:
    result = score_sample(sample(ram_percent=ram), declared_gpus=1, thresholds=Thresholds())
    assert result.parts["system"] == points
    assert check(result, "ram").severity == severity and result.status == status


@pytest.mark.parametrize(("disk", "points"), [(90, 30.0), (95, 25.0), (100, 20.0)])
def test_disk_falls_off_above_the_warning_line(disk: float, points: float) -> None:
    result = score_sample(sample(disk_percent=disk), declared_gpus=1, thresholds=Thresholds())
    assert result.parts["system"] == points
    assert check(result, "disk").ok is (disk <= 90)


def test_busy_cpu_costs_only_near_saturation() -> None:
    calm = score_sample(sample(cpu_percent=94), declared_gpus=1, thresholds=Thresholds())
    pegged = score_sample(sample(cpu_percent=100), declared_gpus=1, thresholds=Thresholds())
    assert calm.parts["system"] == 30.0 and check(calm, "cpu").ok
    assert pegged.parts["system"] == 20.0 and check(pegged, "cpu").severity == "warning"


@pytest.mark.parametrize(
    ("rtt", "points"),
    [(None, 20.0), (5, 20.0), (49.9, 20.0), (50, 20.0), (525, 10.0), (1000, 0.0), (5000, 0.0)],
)
def test_network_points_from_round_trip(rtt: float | None, points: float) -> None:
    result = score_sample(sample(rtt_ms=rtt), declared_gpus=1, thresholds=Thresholds())
    assert result.parts["network"] == points


def test_expected_job_without_processes() -> None:
    # Given a node that should be running job j1 but has no processes of it
    result = score_sample(sample(expected_job="j1", job_procs=[]), declared_gpus=1, thresholds=Thresholds())
    # Then the process part is lost, as a warning
    assert result.parts["processes"] == 0.0 and result.score == 90
    assert check(result, "job_procs").severity == "warning" and "j1" in result.reason()


def test_stray_job_processes_cost_half() -> None:
    # Given leftovers of an old job on an idle node
    procs = [{"pid": 7, "job": "old", "node": "a", "cmd": "torchrun"}]
    result = score_sample(sample(job_procs=procs), declared_gpus=1, thresholds=Thresholds())
    assert result.parts["processes"] == 5.0 and "old" in check(result, "job_procs").detail


def test_other_nodes_processes_are_ignored() -> None:
    # Given two loopback nodes sharing one machine, node b's ranks visible from node a
    procs = [{"pid": 8, "job": "j1", "node": "b", "cmd": "python train.py"}]
    s = sample(node="a", expected_job="j1", job_procs=procs)
    # Then they do not count as node a's job processes
    assert score_sample(s, declared_gpus=1, thresholds=Thresholds()).parts["processes"] == 0.0


def test_low_score_alone_is_degraded() -> None:
    # Given only warnings, but enough of them to drop under score_warn
    s = sample(rtt_ms=1000, disk_percent=100, cpu_percent=100)
    result = score_sample(s, declared_gpus=1, thresholds=Thresholds())
    # Then the node is degraded with a score warning and no critical checks
    assert result.score == 60 and result.status == "degraded"
    assert not any(c.severity == "critical" for c in result.failed)
    assert keys(alert_conditions(result, s, Thresholds()))["score"] == "warning"


def test_score_below_critical_raises_a_critical_alert() -> None:
    s = sample(gpus=[], gpu_error="no driver", rtt_ms=2000)
    result = score_sample(s, declared_gpus=2, thresholds=Thresholds())
    assert result.score == 40
    assert keys(alert_conditions(result, s, Thresholds()))["score"] == "critical"


def test_score_sample_never_says_down() -> None:
    worst = sample(gpus=[], rtt_ms=5000, ram_percent=99, disk_percent=100, cpu_percent=100, expected_job="j")
    result = score_sample(worst, declared_gpus=4, thresholds=Thresholds())
    assert result.score == 0 and result.status == "degraded"


# -- thresholds ----------------------------------------------------------------------------------


def test_overridden_thresholds_are_used() -> None:
    t = Thresholds(gpu_temp_warn=60, gpu_temp_crit=70)
    s = sample(gpus=[gpu(0, temp=72)])
    result = score_sample(s, declared_gpus=1, thresholds=t)
    assert result.status == "degraded"
    assert keys(alert_conditions(result, s, t))["gpu_temp:0"] == "critical"


# -- poll interval -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("running", "age", "interval"),
    [
        (True, None, 5.0),
        (True, 10 * 3600, 5.0),
        (False, 0.0, 10.0),
        (False, 30 * 60, 10.0),
        (False, 30 * 60 + 1, 20.0),
        (False, 2 * 3600, 20.0),
        (False, 2 * 3600 + 1, 40.0),
        (False, 30 * 86400, 40.0),
        (False, None, 40.0),
    ],
)
def test_poll_interval(running: bool, age: float | None, interval: float) -> None:
    assert poll_interval(running, age) == interval
    assert poll_interval(running, age) <= 60


# -- breaker --------------------------------------------------------------------------------------------

NO_JITTER = 0.5  # rng() == 0.5 puts the jitter factor at exactly 1


def test_breaker_trips_on_the_third_consecutive_failure() -> None:
    # Given a fresh breaker
    b = Breaker()
    # When two probes fail, the node is not down yet and polling goes on as usual
    assert b.record_failure(100.0, rng=lambda: NO_JITTER) is False
    assert b.record_failure(105.0, rng=lambda: NO_JITTER) is False
    assert b.state == "closed" and b.should_try(105.1)
    # Then the third failure takes it down, and the next try waits 5 s
    assert b.record_failure(110.0, rng=lambda: NO_JITTER) is True
    assert b.state == "open" and b.open_until == 115.0
    assert not b.should_try(114.9) and b.should_try(115.0)


def test_breaker_backoff_doubles_to_the_cap() -> None:
    b = Breaker()
    for _ in range(2):
        b.record_failure(0.0, rng=lambda: NO_JITTER)
    waits = []
    now = 0.0
    for _ in range(9):
        b.record_failure(now, rng=lambda: NO_JITTER)
        waits.append(b.open_until - now)
        now = b.open_until
    assert waits == [5, 10, 20, 40, 80, 160, 300, 300, 300]


def test_breaker_only_reports_down_once() -> None:
    b = Breaker(failures=3, open_until=50.0, state="open")
    assert b.record_failure(60.0, rng=lambda: NO_JITTER) is False
    assert b.state == "open" and b.open_until == 70.0


@pytest.mark.parametrize(
    ("failures", "rng", "wait"),
    [(2, 0.0, 4.0), (2, 1.0, 6.0), (20, 0.0, 240.0), (20, 1.0, 300.0)],
)
def test_breaker_jitter_is_twenty_percent_and_never_past_the_cap(failures: int, rng: float, wait: float) -> None:
    b = Breaker(failures=failures, state="open" if failures >= 3 else "closed")
    b.record_failure(1000.0, rng=lambda: rng)
    assert b.open_until == pytest.approx(1000.0 + wait)


def test_breaker_recovery() -> None:
    # Given a node that is down
    b = Breaker(failures=5, open_until=200.0, state="open")
    # When a probe succeeds, that is a recovery and the breaker resets
    assert b.record_success(210.0) is True
    assert b == Breaker()
    # And a success on a closed breaker is not a recovery, but clears earlier failures
    b.record_failure(211.0)
    assert b.record_success(212.0) is False and b.failures == 0


def test_breaker_trip_opens_at_once_and_reports_down_once() -> None:
    # Given a node that has never answered: one failed poll may take it down
    b = Breaker(failures=1)
    assert b.trip(100.0, rng=lambda: NO_JITTER) is True
    assert b.state == "open" and b.failures == 3 and b.open_until == 105.0
    assert b.trip(106.0, rng=lambda: NO_JITTER) is False


def test_a_node_with_failed_probes_is_due_on_the_next_tick() -> None:
    from datetime import UTC, datetime

    from cluster.models import Node
    from cluster.monitor import is_due

    now = 1_000_000.0
    just_polled = datetime.fromtimestamp(now - 1, tz=UTC)
    # Given an idle node polled a second ago: not due for 40 s
    quiet = Node(last_poll_at=just_polled, breaker={})
    assert not is_due(quiet, now, None, None)
    # When that poll failed (closed breaker, failures counted): it is due at once, to confirm
    suspect = Node(last_poll_at=just_polled, breaker={"failures": 2, "state": "closed"})
    assert is_due(suspect, now, None, None)
    # And once DOWN, the breaker's backoff decides again
    down = Node(last_poll_at=just_polled, breaker={"failures": 3, "state": "open", "open_until": now + 5})
    assert not is_due(down, now, None, None)


def test_breaker_round_trips_through_json() -> None:
    b = Breaker()
    for t in (1.0, 2.0, 3.0):
        b.record_failure(t, rng=lambda: NO_JITTER)
    restored = Breaker.from_dict(json.loads(json.dumps(b.to_dict())))
    assert restored == b
    assert Breaker.from_dict({}) == Breaker() and Breaker.from_dict(None) == Breaker()


# -- alerts ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("temp", "expected"),
    [(80, None), (80.5, "warning"), (85, "warning"), (85.5, "critical")],
)
def test_gpu_temperature_alerts_per_gpu(temp: float, expected: str | None) -> None:
    # Given a 2-GPU node whose second GPU is at the given temperature
    s = sample(gpus=[gpu(0), gpu(1, temp=temp)])
    result = score_sample(s, declared_gpus=2, thresholds=Thresholds())
    # Then only that GPU's stable key alerts, at the expected severity
    alerts = keys(alert_conditions(result, s, Thresholds()))
    assert alerts.get("gpu_temp:1") == expected and "gpu_temp:0" not in alerts


@pytest.mark.parametrize(("ram", "expected"), [(90, None), (91, "warning"), (95, "warning"), (95.1, "critical")])
def test_ram_alerts(ram: float, expected: str | None) -> None:
    s = sample(ram_percent=ram)
    result = score_sample(s, declared_gpus=1, thresholds=Thresholds())
    assert keys(alert_conditions(result, s, Thresholds())).get("ram") == expected


def test_disk_alert_is_a_warning_with_a_message() -> None:
    s = sample(disk_percent=97.5)
    result = score_sample(s, declared_gpus=1, thresholds=Thresholds())
    assert ("disk", "warning", "disk 97.5 % used") in alert_conditions(result, s, Thresholds())


def test_alert_keys_do_not_depend_on_severity() -> None:
    # Given the same condition getting worse
    warm, hot = sample(ram_percent=92), sample(ram_percent=97)
    t = Thresholds()
    a = alert_conditions(score_sample(warm, 1, t), warm, t)
    b = alert_conditions(score_sample(hot, 1, t), hot, t)
    # Then the key stays the same so the caller can escalate one open alert
    assert [k for k, _, _ in a] == [k for k, _, _ in b] == ["ram"]
