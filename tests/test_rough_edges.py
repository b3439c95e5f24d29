"""Rough edges a new user hit on the pages (issue 13, items 1-7), each pinned by a test."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from cluster.models import Node
from jobs.models import Job
from metrics.models import JobMetrics, MetricPoint
from metrics.parsing import LineParser

from .jobrows import update_jobs


@pytest.fixture
def browser(db):
    client = Client()
    alice = User.objects.create_user("alice", password="pw-alice-123")
    alice.groups.add(Group.objects.get(name="launcher"))  # launches her own jobs
    client.force_login(alice)
    return client


@pytest.fixture
def node(db):
    return Node.objects.create(name="gpu-master", address="127.0.0.2", role=Node.Role.MASTER)


def ended_job(name: str = "done", **fields) -> Job:
    now = timezone.now()
    fields = {"state": Job.State.SUCCEEDED, "started_at": now, "running_at": now, "finished_at": now, **fields}
    return Job.objects.create(name=name, script="s.py", **fields)


def points(job: Job, rows: list[tuple[int, int, str, float]]) -> None:
    now = timezone.now()
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, rank=r, step=s, name=n, value=v, time=now) for r, s, n, v in rows
    )


# 1. progress -------------------------------------------------------------------------------------


def test_a_finished_one_epoch_job_reads_100_percent_not_0(browser):
    # given a 1-epoch run whose 0-based epoch metric stayed at 0 and that succeeded
    job = ended_job(params={"epochs": 1})
    points(job, [(0, s, "epoch", 0.0) for s in (1, 2, 3)] + [(0, s, "loss", 3.0 - s / 10) for s in (1, 2, 3)])
    html = browser.get(f"/jobs/{job.pk}/").content.decode()
    assert "> 100.0%" in html and "> 0.0%" not in html


def test_progress_comes_from_the_scripts_step_and_total_steps(browser):
    now = timezone.now()
    job = Job.objects.create(name="bar", script="s.py", state=Job.State.RUNNING, running_at=now, started_at=now,
                             params={"epochs": 4})  # fmt: skip
    points(job, [(0, 30, "loss", 1.0), (0, 30, "epoch", 0.0)])
    JobMetrics.objects.create(job=job, step=30, total_steps=120)
    html = browser.get(f"/jobs/{job.pk}/").content.decode()
    assert "25.0%" in html and "step 30/120" in html


def test_a_logged_global_step_and_max_steps_are_the_progress_like_a_bar():
    # HF-style state dicts carry the run's planned total next to the step
    parser = LineParser()
    got = parser.feed('{"global_step": 40, "max_steps": 160, "loss": 1.25}')
    assert [(p.name, p.step, p.value) for p in got] == [("loss", 40, 1.25)]  # max_steps is no curve
    assert (parser.counter, parser.total_steps) == (40, 160)


# 2. results at the end without reload; the queued banner ---------------------------------------


def test_results_region_is_always_on_the_page_and_filled_once_the_job_ended(browser):
    now = timezone.now()
    job = Job.objects.create(name="live", script="s.py", state=Job.State.RUNNING, running_at=now, started_at=now)
    html = browser.get(f"/jobs/{job.pk}/").content.decode()
    # (the checkpoints table is there all along: the follower records them while the job runs)
    assert 'data-region="results"' in html and 'id="results"' not in html
    update_jobs(Job.objects.filter(pk=job.pk), state=Job.State.SUCCEEDED, finished_at=now)
    html = browser.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-region="results"' in html and 'id="results"' in html


def test_the_queued_banner_is_marked_for_the_page_to_drop(browser, node):
    response = browser.post("/jobs/launch/", {"name": "q1", "nodes": ["gpu-master"]}, follow=True)
    assert 'class="msg msg-success" data-tag="queued">job q1 queued' in response.content.decode()


# 4. one final loss -----------------------------------------------------------------------------


def test_final_loss_is_rank0s_last_logged_loss_on_the_page_in_compare_and_in_results(browser, capsys):
    job = ended_job("fl")
    # rank 1 logged later and lower: it is not the final loss; neither is the mean across ranks
    points(job, [(0, 10, "loss", 2.5), (0, 20, "loss", 1.234567891), (1, 20, "loss", 1.0), (1, 25, "loss", 0.5)])
    page = browser.get(f"/jobs/{job.pk}/").content.decode()
    assert "Final loss <b>1.23457</b> at step 20" in page
    compare = browser.get(f"/compare/?job={job.pk}").content.decode()
    assert '<td class="num">1.23457</td>' in compare
    call_command("results", "fl")
    assert "final loss: 1.23457 at step 20 (last loss logged by rank 0)" in capsys.readouterr().out


# 5. every launch form error at once --------------------------------------------------------------


def test_launch_form_shows_every_field_error_at_once(browser, node):
    response = browser.post(
        "/jobs/launch/",
        {"name": "bad name", "epochs": "0", "lr": "-1", "nproc_per_node": "99", "nodes": ["gpu-master"],
         "metrics_pattern": "(unclosed"},
    )  # fmt: skip
    html = response.content.decode()
    # the launch's own checks and the form's bounds, each beside its field
    assert "job name &#x27;bad name&#x27; is not allowed" in html
    assert "Ensure this value is greater than or equal to 1." in html  # epochs
    assert "Ensure this value is greater than or equal to 0." in html  # lr
    assert "Ensure this value is less than or equal to 64." in html  # nproc_per_node
    assert "(unclosed" in html and html.count('class="error"') >= 5
    assert not Job.objects.exists()


def test_form_errors_of_django_and_of_the_launch_checks_show_together(browser, node):
    # a number that is no number (the form's own check) beside an lr the launch refuses
    html = browser.post("/jobs/launch/", {"name": "ok-name", "epochs": "many", "lr": "0"}).content.decode()
    assert "Enter a whole number." in html and "learning rate must be a number above 0" in html
    assert not Job.objects.exists()


# 7. 404, 500 and the favicon ---------------------------------------------------------------------


def test_404_is_the_sites_own_page(browser):
    response = browser.get("/no/such/page/")
    html = response.content.decode()
    assert response.status_code == 404
    assert 'id="error-page"' in html and "css/ugro.css" in html and "/no/such/page/" in html


def test_500_is_the_sites_own_page(rf):
    from django.views.defaults import server_error

    response = server_error(rf.get("/"))
    html = response.content.decode()
    assert response.status_code == 500 and 'id="error-page"' in html and "css/ugro.css" in html


def test_favicon_ico_is_served_to_anyone(client):
    response = client.get("/favicon.ico")
    assert response.status_code == 200 and response["Content-Type"] == "image/x-icon"
    assert b"".join(response.streaming_content)[:4] == b"\x00\x00\x01\x00"  # an ICO header
