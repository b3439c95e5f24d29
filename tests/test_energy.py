"""Energy per job and attempt (jobs/energy.py, docs/power.md): GPU energy from NVML's counter or integrated power
samples, host CPU energy from RAPL, the cost at cluster.yaml's power.price_per_kwh, and where a GPU reports no
power, "not measured" (never 0)."""

from __future__ import annotations

import importlib.util
import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.urls import reverse
from django.utils import timezone

from cluster import monitor
from cluster.config_yaml import ConfigError, export_cluster, import_cluster
from cluster.models import ClusterSettings, HealthSample, Node
from jobs import energy, report
from jobs.models import Attempt, Job, Rank, Sweep

pytestmark = pytest.mark.django_db

ONE_NODE = """\
nodes:
  gpu1:
    ip: 127.0.0.1
    user: ob
    gpu: RTX 4070
    vram_gb: 8
"""


def test_the_power_block_sets_the_price_and_round_trips():
    import_cluster(ONE_NODE + "power:\n  price_per_kwh: 0.31\n  currency: EUR\n")
    cs = ClusterSettings.load()
    assert (cs.price_per_kwh, cs.currency) == (0.31, "EUR")
    assert "price_per_kwh: 0.31" in export_cluster()
    import_cluster(export_cluster())
    assert ClusterSettings.load().price_per_kwh == 0.31


@pytest.mark.parametrize(
    "block, message",
    [
        ("  price_per_kwh: -0.2\n", r"^power\.price_per_kwh: must be a price per kWh from 0 to 1000.* \(line \d+\)$"),
        ("  price_per_kwh: cheap\n", r"^power\.price_per_kwh: must be int or float"),
        ("  price_per_kwh: .nan\n", r"^power\.price_per_kwh: must be a price"),
        ("  price_per_kwh: 0.3\n  currency: '<b>EUR</b>'\n", r"^power\.currency: must be a short label"),
        ("  price_per_kwh: 0.3\n  watts: 5\n", r"^power\.watts: unknown key \(known: currency, price_per_kwh\)"),
    ],
)
def test_a_bad_power_block_is_refused_in_one_line_and_nothing_is_imported(block, message):
    with pytest.raises(ConfigError, match=message) as err:
        import_cluster(ONE_NODE + "power:\n" + block)
    assert "\n" not in str(err.value)
    assert not Node.objects.exists() and not ClusterSettings.objects.exists()


# -- integration: known answers ----------------------------------------------------------------------------------


def _power(times, watts):
    return [(t, None, w) for t, w in zip(times, watts, strict=True)]


def test_constant_200_w_for_36_s_is_2_wh():
    # Given recorded power samples of 200 W every 4 s from t=0 to t=36
    readings = _power(range(0, 37, 4), [200.0] * 10)
    # When they are folded over the window they cover
    m = energy.fold(None, readings, 0, 36)
    # Then the trapezoid gives 200 W x 36 s = 7200 J = 2 Wh, all of it covered
    assert m["j"] == pytest.approx(7200.0) and m["j"] / energy.J_PER_WH == pytest.approx(2.0)
    assert (m["covered_s"], m["gap_s"], m["how"]) == (36.0, 0.0, ["power"])


def test_a_ramp_is_integrated_by_the_trapezoid_and_clipped_to_the_window():
    # Given power rising 0 -> 100 W over 10 s, sampled at 0 and 10 only, and a window starting at 5 s
    m = energy.fold(None, _power([0, 10], [0.0, 100.0]), 5, 10)
    # Then half of the segment's 500 J counts (a straddling segment counts for the part inside)
    assert m["j"] == pytest.approx(250.0) and m["covered_s"] == 5.0


def test_folding_in_two_steps_equals_folding_at_once():
    readings = _power(range(0, 41, 5), [100, 150, 150, 210, 90, 90, 300, 120, 80])
    whole = energy.fold(None, readings, 0, 40)
    step = energy.fold(energy.fold(None, readings[:4], 0, 40), readings[4:], 0, 40)
    assert step["j"] == pytest.approx(whole["j"]) and step["covered_s"] == whole["covered_s"] == 40.0


def test_the_counter_is_preferred_to_the_power_samples():
    # Given NVML's counter (J) rising 3600 J over 20 s while the sampled power says 100 W (2000 J)
    readings = [(0, 1_000.0, 100.0), (10, 2_800.0, 100.0), (20, 4_600.0, 100.0)]
    m = energy.fold(None, readings, 0, 20)
    # Then the counter's difference is what counts: 1 Wh
    assert m["j"] == pytest.approx(3600.0) and m["how"] == ["counter"]


def test_a_long_gap_in_power_samples_is_not_integrated_and_makes_the_figure_partial():
    # Given 100 W samples with a 60 s silence (longer than MAX_GAP_S) between t=10 and t=70
    assert energy.MAX_GAP_S < 60
    m = energy.fold(None, _power([0, 5, 10, 70, 75], [100.0] * 5), 0, 75)
    # Then only the 15 s around it count (0-10 s and 70-75 s), the 60 s are a gap
    assert m["j"] == pytest.approx(1500.0) and m["gap_s"] == 60.0 and m["covered_s"] == 15.0


def test_the_counter_bridges_a_gap_but_a_reset_is_a_gap():
    # Given a counter read across a 60 s silence (exact: it counted all along), then reset by a driver reload
    readings = [(0, 500.0, None), (60, 6_500.0, None), (65, 20.0, None), (70, 520.0, None)]
    m = energy.fold(None, readings, 0, 70)
    # Then the silence counts (6000 J), the reset's segment does not, the next one does (500 J)
    assert m["j"] == pytest.approx(6500.0) and m["gap_s"] == 5.0


def test_a_rapl_counter_that_wraps_is_unwrapped():
    # Given a RAPL package counter (J) that wraps at 262.143 J... x1000, read every 5 s
    wrap = 262_143.328850
    readings = [(0, wrap - 300.0, None), (5, 200.0, None), (10, 700.0, None)]
    m = energy.fold(None, readings, 0, 10, wrap_j=wrap)
    # Then the wrap adds the range back: 300 + 200 + 500 J
    assert m["j"] == pytest.approx(1000.0) and m["gap_s"] == 0.0
    # And over a long silence a wrapping counter may have wrapped more than once: not counted
    m = energy.fold(None, [(0, 100.0, None), (600, 50.0, None)], 0, 600, wrap_j=wrap)
    assert m["j"] == 0.0 and m["gap_s"] == 600.0


# -- an attempt's energy from its nodes' recorded samples ---------------------------------------------------------

T0 = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)


def _node(name: str = "gpu1", gpus: int = 2) -> Node:
    return Node.objects.create(name=name, address="127.0.0.1", gpu_count=gpus)


def _job(nodes_gpus: list[tuple[Node, list[int]]], seconds: float | None = 36.0, name: str = "train") -> Job:
    """A job whose attempt held these GPUs from T0 for `seconds` (None: still running)."""
    job = Job.objects.create(name=name, script="train.py", state=Job.State.SUCCEEDED if seconds else Job.State.RUNNING)
    finished = T0 + timedelta(seconds=seconds) if seconds is not None else None
    Attempt.objects.filter(pk=job.current_id).update(started_at=T0, running_at=T0, finished_at=finished)
    for i, (node, indices) in enumerate(nodes_gpus):
        Rank.objects.create(job=job, node=node, index=i, gpu_indices=indices)
    job.refresh_from_db()
    return job


def _samples(node: Node, seconds: range, gpus, rapl=None) -> None:
    """Health samples as the monitor records them: `gpus(t)` the per-GPU readings at t seconds after T0."""
    HealthSample.objects.bulk_create(
        HealthSample(node=node, time=T0 + timedelta(seconds=t), gpus=gpus(t), rapl=rapl(t) if rapl else None)
        for t in seconds
    )


def test_an_attempt_held_one_gpu_at_200_w_for_36_s_used_2_wh_and_costs_at_the_price():
    # Given a node with two GPUs, the job holding GPU 1 only, sampled every 4 s (GPU 0 busy with something else)
    node = _node()
    ClusterSettings.objects.update_or_create(pk=1, defaults={"price_per_kwh": 0.5, "currency": "EUR"})
    job = _job([(node, [1])])
    _samples(node, range(-8, 49, 4), lambda t: [{"index": 0, "power_w": 300.0}, {"index": 1, "power_w": 200.0}])
    # When its energy is asked
    e = energy.job_energy(job)
    # Then it is GPU 1's 200 W over the 36 s it held it: 2 Wh, and its cost at 0.5 EUR per kWh
    assert e.wh == pytest.approx(2.0) and e.gpu_wh == pytest.approx(2.0) and e.cpu_wh is None
    assert e.cost == pytest.approx(0.001) and not e.partial and e.how == ["power"]
    assert e.to_dict()["kwh"] == pytest.approx(0.002) and e.text() == "2.0 Wh (0.00 EUR)"


def test_the_nvml_counter_gives_the_energy_where_the_gpu_has_one():
    # Given recorded NVML readings: the counter rising 250 J/s (250 W) while the sampled power reads 200 W
    node = _node(gpus=1)
    job = _job([(node, [0])], seconds=40)
    _samples(node, range(0, 41, 5), lambda t: [{"index": 0, "power_w": 200.0, "energy_mj": 5_000_000 + 250_000 * t}])
    # Then the counter's difference is the energy: 250 W x 40 s = 10000 J
    e = energy.job_energy(job)
    assert e.gpu_wh == pytest.approx(10000 / 3600) and e.how == ["counter"]


def test_a_gpu_that_reports_no_power_is_not_measured_never_zero():
    # Given a GPU whose readings have neither power nor counter (the nvidia-smi reader on a card without sensors)
    node = _node(gpus=1)
    job = _job([(node, [0])])
    _samples(node, range(0, 37, 4), lambda t: [{"index": 0, "power_w": None, "energy_mj": None, "util_percent": 90}])
    e = energy.job_energy(job)
    # Then the job's energy is not measured: no figure, no cost, and never 0
    assert e.wh is None and e.cost is None and e.not_measured == ["gpu1:0"]
    assert e.text() == "not measured" and e.to_dict()["wh"] is None and e.to_dict()["measured"] is False


def test_one_gpu_of_two_without_power_makes_the_figure_partial():
    a, b = _node("gpu1", 1), _node("gpu2", 1)
    job = _job([(a, [0]), (b, [0])])
    _samples(a, range(0, 37, 4), lambda t: [{"index": 0, "power_w": 100.0}])
    _samples(b, range(0, 37, 4), lambda t: [{"index": 0, "power_w": None}])
    e = energy.job_energy(job)
    assert e.gpu_wh == pytest.approx(1.0) and e.partial and e.not_measured == ["gpu2:0"]
    assert e.text() == "1.0 Wh, partial"


def test_host_cpu_energy_comes_from_rapl_in_the_share_of_the_node_held():
    # Given RAPL readable on a 2-GPU node (package counter at 60 W, wrapping mid-way) and the job on 1 of its GPUs
    node = _node()
    job = _job([(node, [0])])
    wrap_uj = 262_143_328_850
    _samples(node, range(0, 37, 4), lambda t: [{"index": 0, "power_w": 100.0}],
             rapl=lambda t: [{"zone": "intel-rapl:0/package-0", "energy_uj": (wrap_uj - 1_000_000 + 60_000_000 * t)
                              % wrap_uj, "max_uj": wrap_uj}])  # fmt: skip
    e = energy.job_energy(job)
    # Then half the package's 60 W x 36 s counts: 0.3 Wh, beside the GPU's 1 Wh
    assert e.cpu_wh == pytest.approx(0.3) and e.gpu_wh == pytest.approx(1.0) and e.wh == pytest.approx(1.3)


def test_the_running_loop_folds_the_samples_and_an_ended_attempt_is_made_final_once():
    # Given a job that held a GPU at 200 W for 36 s and ended a minute ago
    node = _node(gpus=1)
    job = _job([(node, [0])])
    _samples(node, range(0, 41, 4), lambda t: [{"index": 0, "power_w": 200.0}])
    now = T0 + timedelta(seconds=96)
    # When the running loop's rule runs
    assert energy.record_due(Job.objects.all(), now=now) == 1
    # Then the attempt's state is final and says 2 Wh without the samples (which may since be pruned)
    attempt = Attempt.objects.get(pk=job.current_id)
    assert attempt.energy["final"] is True
    HealthSample.objects.all().delete()
    assert energy.attempt_energy(attempt).wh == pytest.approx(2.0)
    assert energy.record_due(Job.objects.all(), now=now) == 0


def test_a_running_job_shows_its_energy_so_far_and_the_stored_part_is_not_counted_twice():
    node = _node(gpus=1)
    job = _job([(node, [0])], seconds=None)
    _samples(node, range(0, 121, 4), lambda t: [{"index": 0, "power_w": 360.0}])
    # Given the loop folded what was 30 s old at t=100 s (up to t=70), and then nothing more
    assert energy.record_due(Job.objects.all(), now=T0 + timedelta(seconds=100)) == 1
    assert energy.record_due(Job.objects.all(), now=T0 + timedelta(seconds=110)) == 0  # not a minute yet
    # When asked at t=120, it is the stored part plus the samples since: 360 W x 120 s = 12 Wh
    e = energy.attempt_energy(Attempt.objects.get(pk=job.current_id), now=T0 + timedelta(seconds=120))
    assert e.wh == pytest.approx(12.0)


# -- the probe's readings ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def probe():
    """cluster/node/probe.py as a module of its own (plain python sent to nodes, not a package module)."""
    path = Path(__file__).resolve().parents[1] / "cluster" / "node" / "probe.py"
    spec = importlib.util.spec_from_file_location("ugro_node_probe_energy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _zone(root: Path, name: str, label: str, energy_uj: int, max_uj: int) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "name").write_text(label + "\n")
    (root / name / "energy_uj").write_text(f"{energy_uj}\n")
    (root / name / "max_energy_range_uj").write_text(f"{max_uj}\n")


def test_the_probe_reads_rapl_package_counters_where_readable(probe, tmp_path, monkeypatch):
    # Given a powercap tree with two packages and a sub-zone (core), which is inside its package's count
    _zone(tmp_path, "intel-rapl:0", "package-0", 123_456, 262_143_328_850)
    _zone(tmp_path, "intel-rapl:1", "package-1", 7, 262_143_328_850)
    _zone(tmp_path, "intel-rapl:0:0", "core", 99, 262_143_328_850)
    zones, error = probe._probe_rapl(str(tmp_path))
    assert error is None and zones == [
        {"zone": "intel-rapl:0/package-0", "energy_uj": 123_456, "max_uj": 262_143_328_850},
        {"zone": "intel-rapl:1/package-1", "energy_uj": 7, "max_uj": 262_143_328_850},
    ]

    # And where the counters are root's only (most kernels since 5.10), or there is no RAPL: not measured, and why
    def denied(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(probe, "_probe_read_int", denied)
    zones, error = probe._probe_rapl(str(tmp_path))
    assert zones is None and "readable by root only" in error
    assert probe._probe_rapl(str(tmp_path / "none"))[0] is None


# -- where it is shown ------------------------------------------------------------------------------------------


def test_the_page_api_compare_sweep_and_prometheus_show_the_energy_and_escape_the_label(client, settings):
    # Given a job that used 2 Wh, a price of 150 per kWh, and a currency label with markup (admin does not
    # check it as an import does)
    node = _node(gpus=1)
    ClusterSettings.objects.update_or_create(pk=1, defaults={"price_per_kwh": 150, "currency": "<i>€"})
    sweep = Sweep.objects.create(name="sw", script="train.py", spec={}, base={})
    job = _job([(node, [0])])
    Job.objects.filter(pk=job.pk).update(sweep=sweep, sweep_params={"lr": 0.1})
    end = timezone.now()
    start = end - timedelta(seconds=36)
    Attempt.objects.filter(pk=job.current_id).update(started_at=start, running_at=start, finished_at=end)
    HealthSample.objects.bulk_create(
        HealthSample(node=node, time=start + timedelta(seconds=t), gpus=[{"index": 0, "power_w": 200.0}])
        for t in range(0, 37, 4)
    )
    client.force_login(User.objects.create_user("alice", password="pw-alice-123"))
    shown = "2.0 Wh (0.30 &lt;i&gt;€)"
    # Then the job page, the compare table and the sweep's table show it, the label escaped
    for url in (reverse("job-detail", args=[job.pk]), f"{reverse('compare')}?job={job.pk}",
                reverse("sweep-detail", args=[sweep.pk])):  # fmt: skip
        page = client.get(url).content.decode()
        assert shown in page and "<i>€" not in page, url
    # And the API and the job's system series (the page's power curve) say it as data
    record = client.get(f"/api/v1/jobs/{job.name}/").json()["energy"]
    assert record["wh"] == pytest.approx(2.0) and record["cost"] == pytest.approx(0.3)
    assert record["attempts"][0]["attempt"] == 1 and record["currency"] == "<i>€"
    system = client.get(reverse("api-job-system", args=[job.pk])).json()
    assert system["energy"]["text"] == "2.0 Wh (0.30 <i>€)"
    assert any(m["name"] == "gpu_power" and m["lines"] for m in system["metrics"])
    trial = client.get("/api/v1/sweeps/sw/").json()["trials"][0]
    assert trial["energy"]["wh"] == pytest.approx(2.0)
    # And `status NAME` and `sweep NAME --show` print it
    assert "  energy 2.0 Wh (0.30 <i>€)" in report.job_detail(job)
    out = io.StringIO()
    call_command("sweep", "sw", "--show", stdout=out)
    assert "energy 2.0 Wh (0.30 <i>€)  lr=0.1" in out.getvalue()
    # And Prometheus has it in joules, with its cost
    settings.UGRO_PROMETHEUS_TOKEN = "tok"
    text = client.get("/metrics", headers={"Authorization": "Bearer tok"}).content.decode()
    assert 'ugro_job_energy_joules{job="train",state="succeeded"} 7200.0' in text
    assert 'ugro_job_energy_cost{currency="<i>€",job="train",state="succeeded"} 0.3' in text


def test_the_monitor_keeps_each_gpus_energy_counter_and_the_rapl_zones(monkeypatch):
    # Given a node whose probe (stubbed: no SSH here) reads an energy counter and RAPL, then RAPL no more
    node = _node(gpus=1)
    zone = {"zone": "intel-rapl:0/package-0", "energy_uj": 1_234, "max_uj": 262_143_328_850}
    answers = iter([
        {"gpus": [{"index": 0, "power_w": 200.0, "energy_mj": 5_000_000}], "rapl": [zone, "junk"], "rapl_error": None},
        {"gpus": [{"index": 0, "power_w": 200.0, "energy_mj": None}], "rapl": None, "rapl_error": "root only"},
    ])  # fmt: skip
    monkeypatch.setattr(monitor, "probe_node", lambda n, b, t, force=False: (next(answers), 1.0, "", False))
    # When it is polled twice
    monitor.poll_once(nodes=[node], force=True)
    monitor.poll_once(nodes=[node], force=True)
    # Then the samples keep the counter and the zones as read, and None where RAPL was not readable
    first, second = HealthSample.objects.filter(node=node).order_by("time")
    assert first.gpus[0]["energy_mj"] == 5_000_000 and first.rapl == [zone]
    assert second.gpus[0]["energy_mj"] is None and second.rapl is None


def test_a_jobs_energy_is_its_attempts_summed_and_results_show_each():
    # Given attempt 1 at 100 W for 36 s (1 Wh), retried as attempt 2 at 200 W for 36 s (2 Wh) a minute later
    node = _node(gpus=1)
    job = _job([(node, [0])])
    Attempt.objects.filter(pk=job.current_id).update(state="failed", next_reason="retry after NODE_LOST")
    _samples(node, range(0, 37, 4), lambda t: [{"index": 0, "power_w": 100.0}])
    second = Attempt.objects.create(job=job, number=2, started_at=T0 + timedelta(seconds=60),
                                    finished_at=T0 + timedelta(seconds=96))  # fmt: skip
    Job.objects.filter(pk=job.pk).update(current=second)
    Rank.objects.create(job=job, attempt=second, node=node, index=0, gpu_indices=[0])
    _samples(node, range(60, 97, 4), lambda t: [{"index": 0, "power_w": 200.0}])
    job.refresh_from_db()
    # Then the job's energy is 3 Wh, each attempt's its own, in the JSON and in `results`
    record = energy.energy_record(job)
    assert record["wh"] == pytest.approx(3.0)
    assert [(a["attempt"], round(a["wh"], 6)) for a in record["attempts"]] == [(1, 1.0), (2, 2.0)]
    lines = report.results(job)
    assert "  energy 3.0 Wh" in lines
    assert any(line.startswith("  attempt 1: failed") and line.endswith("; energy 1.0 Wh") for line in lines)
    # And `status --json` (every job) and `results NAME --json` carry it
    out = io.StringIO()
    call_command("status", "--json", stdout=out)
    (listed,) = json.loads(out.getvalue())["jobs"]
    assert listed["energy"]["wh"] == pytest.approx(3.0)
    out = io.StringIO()
    call_command("results", job.name, "--json", stdout=out)
    assert [a["wh"] for a in json.loads(out.getvalue())["energy"]["attempts"]] == pytest.approx([1.0, 2.0])


def test_a_list_reads_every_jobs_energy_in_the_same_few_queries(django_assert_max_num_queries):
    # Given 20 ended jobs, none folded yet (their samples are read), and 20 with a final state
    node = _node(gpus=1)
    jobs = [_job([(node, [0])], name=f"j{i}") for i in range(40)]
    _samples(node, range(0, 37, 4), lambda t: [{"index": 0, "power_w": 100.0}])
    assert energy.record_due(Job.objects.filter(pk__in=[j.pk for j in jobs[20:]]), now=T0 + timedelta(seconds=90)) == 20
    ClusterSettings.load()
    # When their records are read together: the price, attempts, ranks, samples
    with django_assert_max_num_queries(4):
        records = energy.energy_records(jobs)
    # Then each says 1 Wh, folded now or stored
    assert {round(r["wh"], 6) for r in records.values()} == {1.0}
