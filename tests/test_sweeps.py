"""Sweeps: grid and random trials as queued child jobs, max concurrent, cancel, the sweep page."""

from __future__ import annotations

import io
import math
import re

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from cluster.models import Node
from jobs.models import Job, Sweep
from jobs.scheduler import place_queued, queue
from jobs.sweeps import trial_rows
from metrics.models import MetricPoint

from .jobrows import update_jobs

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("worker_heartbeat")]


@pytest.fixture
def four_gpus(db):
    Node.objects.create(name="gpu0", address="10.3.0.1", role="master", gpu_count=4, gpu_vram_gb=12)


def sweep(*args: str) -> str:
    out = io.StringIO()
    call_command("sweep", *args, stdout=out)
    return out.getvalue()


def test_a_grid_makes_one_queued_trial_per_combination_with_its_params(four_gpus):
    out = sweep("g1", "--script", "train.py", "--grid", "lr=1e-4,3e-4,1e-3", "--grid", "batch-size=8,16",
                "--gpus", "1", "--", "--max-steps", "50")  # fmt: skip
    s = Sweep.objects.get(name="g1")
    trials = list(s.trials.order_by("name"))
    assert "sweep g1 (id" in out and "6 trials queued" in out
    assert [t.name for t in trials] == [f"g1-{i:03d}" for i in range(1, 7)]
    assert all(t.state == Job.State.QUEUED and t.gpus == 1 and t.script == "train.py" for t in trials)
    assert [t.sweep_params for t in trials[:2]] == [{"lr": 0.0001, "batch-size": 8}, {"lr": 0.0001, "batch-size": 16}]
    # lr fills the launch field; other params reach the script as --NAME VALUE after the shared args
    first = trials[0]
    assert first.params["lr"] == 0.0001
    assert first.script_args[-4:] == ["--max-steps", "50", "--batch-size", "8"]
    assert "--learning-rate" in first.script_args


def test_random_trials_are_drawn_in_range_and_reproducible_from_the_seed(four_gpus):
    sweep("r1", "--random", "lr=loguniform(1e-5,1e-2)", "--random", "layers=int(2,6)",
          "--random", "opt=choice(adam,sgd)", "--trials", "20", "--seed", "7", "--gpus", "1")  # fmt: skip
    sweep("r2", "--random", "lr=loguniform(1e-5,1e-2)", "--random", "layers=int(2,6)",
          "--random", "opt=choice(adam,sgd)", "--trials", "20", "--seed", "7", "--gpus", "1")  # fmt: skip
    one = [t.sweep_params for t in Sweep.objects.get(name="r1").trials.order_by("name")]
    two = [t.sweep_params for t in Sweep.objects.get(name="r2").trials.order_by("name")]
    assert len(one) == 20 and one == two
    assert all(1e-5 <= p["lr"] <= 1e-2 and 2 <= p["layers"] <= 6 and p["opt"] in ("adam", "sgd") for p in one)
    # log-uniform: both decades ends are reached, not only the top one
    assert min(math.log10(p["lr"]) for p in one) < -3.5 < max(math.log10(p["lr"]) for p in one)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grid", "lr"], "--grid 'lr': write NAME=VALUES"),
        (["--random", "lr=gauss(0,1)"], "use uniform(a,b), loguniform(a,b), int(a,b) or choice"),
        (["--random", "lr=loguniform(0,1)"], "loguniform bounds must be positive"),
        (["--random", "lr=uniform(2,1)"], "the lower bound must be below the upper"),
        (["--grid", "lr=1,2", "--random", "lr=uniform(1,2)"], "parameter lr is both --grid and --random"),
        (["--grid", "lr=1,2", "--trials", "3"], "--trials is for --random parameters"),
        (["--grid", "lr=abc"], "sweep parameter lr='abc' is not a valid lr"),
        (["--grid", "a=1", "--max-concurrent", "0"], "--max-concurrent must be at least 1"),
        ([], "a sweep needs at least one --grid or --random parameter"),
        (["--grid", "x;rm=1"], "a parameter name is letters, digits"),
        (["--grid", "a=1", "--gpus", "9"], "asked for 9 GPUs but the cluster has 4"),
    ],
)
def test_bad_sweeps_are_refused_in_one_line_and_create_nothing(four_gpus, args, message):
    with pytest.raises(CommandError) as err:
        sweep("bad", *args)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not Sweep.objects.exists() and not Job.objects.exists()


def test_max_concurrent_keeps_the_other_trials_waiting_with_a_reason(four_gpus):
    sweep("mc", "--grid", "lr=1,2,3,4", "--gpus", "1", "--max-concurrent", "2")
    assert len(place_queued()) == 2
    waiting = queue()
    assert [e.decision.reason for e in waiting] == ["quota", "quota"]
    assert "its sweep runs at most 2 trials at once" in waiting[0].decision.detail
    # when a trial ends, the next one starts
    first = Job.objects.filter(sweep__name="mc", state=Job.State.STARTING).first()
    Job.objects.filter(pk=first.pk).update(state=Job.State.SUCCEEDED)
    first.allocations.update(active=False)
    assert len(place_queued()) == 1


@pytest.mark.django_db(transaction=True)
def test_cancelling_a_sweep_cancels_every_trial_not_yet_ended(four_gpus, test_worker):
    sweep("c1", "--grid", "lr=1,2,3", "--gpus", "1")
    trials = list(Job.objects.filter(sweep__name="c1").order_by("name"))
    Job.objects.filter(pk=trials[0].pk).update(state=Job.State.SUCCEEDED)
    update_jobs(Job.objects.filter(pk=trials[1].pk), state=Job.State.RUNNING, started_at=timezone.now())
    out = io.StringIO()
    call_command("sweep", "c1", "--cancel", stdout=out)
    states = dict(Job.objects.filter(sweep__name="c1").values_list("name", "state"))
    assert states == {"c1-001": "succeeded", "c1-002": "cancelled", "c1-003": "cancelled"}
    assert "sweep c1 cancelled: 2 cancelled, 1 succeeded" in out.getvalue()
    assert Sweep.objects.get(name="c1").cancelled_at is not None
    with pytest.raises(CommandError, match="no sweep named 'nope'"):
        call_command("sweep", "nope", "--cancel")


def add_points(job: Job, values: list[float]) -> None:
    now = timezone.now()
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, rank=r, step=step, name="loss", value=v + r * 0.01, time=now)
        for step, v in enumerate(values, start=1)
        for r in (0, 1)
    )


def test_trials_show_final_and_best_metric_and_the_best_trial_is_marked(four_gpus):
    sweep("b1", "--grid", "lr=1,2,3", "--gpus", "1")
    a, b, c = Job.objects.filter(sweep__name="b1").order_by("name")
    add_points(a, [2.0, 1.0, 1.5])  # best point 1.0, but ends at 1.5
    add_points(b, [2.0, 1.2, 1.1])  # ends lowest
    rows = {r.job.name: r for r in trial_rows(Sweep.objects.get(name="b1"))}
    # final: rank 0's last value (rank 1 logged 0.01 more); best: the lowest of any rank
    assert math.isclose(rows["b1-001"].final, 1.5) and math.isclose(rows["b1-001"].best, 1.0)
    assert rows["b1-002"].is_best and not rows["b1-001"].is_best and rows["b1-003"].final is None
    out = io.StringIO()
    call_command("sweep", "b1", "--show", stdout=out)
    assert re.search(r"b1-002 +queued +final +1\.1 best +1\.1 +energy not measured +lr=2  <- best", out.getvalue())


def test_sweep_page_lists_trials_marks_the_best_and_escapes_params(four_gpus):
    from django.contrib.auth.models import Group

    client = Client()
    alice = User.objects.create_user("alice", password="pw-alice-123")
    client.force_login(alice)
    sweep("p1", "--grid", "note=<b>x</b>,plain", "--gpus", "1")
    s = Sweep.objects.get(name="p1")
    first = s.trials.order_by("name").first()
    add_points(first, [3.0, 2.0])
    html = client.get(f"/sweeps/{s.pk}/").content.decode()
    assert '<tr data-job="p1-001" class="best">' in html and 'id="best-trial"' in html
    assert "&lt;b&gt;x&lt;/b&gt;" in html and "<b>x</b>" not in html
    assert 'data-metric="loss"' in html and html.count("<li data-job=") == 2 and "&#9733; p1-001" in html
    assert client.get("/sweeps/").status_code == 200
    # cancel from the page: a viewer may not (the trials are someone else's), an operator may
    assert client.post(f"/sweeps/{s.pk}/cancel/").status_code == 403
    assert set(s.trials.values_list("state", flat=True)) == {"queued"}
    alice.groups.add(Group.objects.get(name="operator"))
    response = client.post(f"/sweeps/{s.pk}/cancel/")
    assert response.status_code == 302
    assert set(s.trials.values_list("state", flat=True)) == {"cancelled"}


def test_the_median_rule_stops_a_trial_worse_than_the_others_at_the_same_step(four_gpus):
    from jobs.sweeps import median_stop

    sweep("m1", "--grid", "lr=1,2,3,4", "--gpus", "1", "--median-stop", "--median-min-steps", "5")
    sweep("m0", "--grid", "lr=1,2,3,4", "--gpus", "1")  # the rule is off by default
    for name in ("m1", "m0"):
        trials = list(Job.objects.filter(sweep__name=name).order_by("name"))
        update_jobs(
            Job.objects.filter(pk__in=[t.pk for t in trials]), state=Job.State.RUNNING, started_at=timezone.now()
        )
        for t in trials[:3]:
            add_points(t, [3.0 - 0.2 * s for s in range(10)])  # down to 1.2
        add_points(trials[3], [3.0] * 10)  # stuck at 3.0
    # when the reconciler applies the rule
    assert median_stop() == ["m1-004"]
    stuck = Job.objects.get(name="m1-004")
    assert stuck.state == Job.State.CANCELLING and stuck.failure_kind == "CANCELLED"
    assert stuck.failure_reason.startswith("stopped early by the median rule: best loss 3 by step 10")
    assert Job.objects.get(name="m0-004").state == Job.State.RUNNING
    assert set(Job.objects.filter(sweep__name="m1").exclude(name="m1-004").values_list("state", flat=True)) == {
        "running"
    }
    # and before min steps nothing is stopped
    MetricPoint.objects.filter(job__sweep__name="m0").delete()
    Sweep.objects.filter(name="m0").update(median_stop=True, median_min_steps=50)
    for t in Job.objects.filter(sweep__name="m0"):
        add_points(t, [3.0 if t.name.endswith("4") else 1.0] * 10)
    assert median_stop() == []
