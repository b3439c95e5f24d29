"""Dashboard pages and JSON endpoints through Django's test client: login, escaping, CSP, CSRF, actions."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Group, User
from django.test import Client
from django.utils import timezone

from cluster.models import Node
from jobs.models import Checkpoint, Job, Rank
from metrics.models import MetricPoint

HOSTILE = "<script>alert(1)</script><img src=x onerror=alert(2)>"


@pytest.fixture
def alice(db):
    user = User.objects.create_user("alice", password="pw-alice-123")
    user.groups.add(Group.objects.get(name="launcher"))  # launches and cancels her own jobs
    return user


@pytest.fixture
def browser(alice):
    client = Client()
    client.force_login(alice)
    return client


@pytest.fixture
def node(db):
    return Node.objects.create(name="gpu-master", address="127.0.0.2", role=Node.Role.MASTER, gpu_model="RTX 5070 Ti")


@pytest.fixture
def job(db, node, settings, tmp_path):
    """A running job on one node, with a few loss points and a log."""
    settings.JOBS_DIR = tmp_path / "jobs"
    job = Job.objects.create(
        name="demo",
        script="train/train_production.py",
        script_args=["--max-steps", "10"],
        params={"model": "tiny", "dataset": "gpl-3", "epochs": 1, "lr": 0.003, "extra": ["--max-steps", "10"]},
        state=Job.State.RUNNING,
        started_at=timezone.now(),
        running_at=timezone.now(),
    )
    rank = Rank.objects.create(job=job, node=node, index=0, state=Rank.State.RUNNING)
    text = b"step 1 starting\nstep 2 going\n"
    rank.local_log.parent.mkdir(parents=True, exist_ok=True)
    rank.local_log.write_bytes(text)
    Rank.objects.filter(pk=rank.pk).update(log_offset=len(text), log_lines=2)
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, rank=0, step=s, name="loss", value=3.0 - s / 10, time=timezone.now()) for s in range(1, 6)
    )
    return job


def page_urls(job: Job) -> list[str]:
    return ["/", "/jobs/", "/jobs/launch/", "/jobs/queue/", f"/jobs/{job.pk}/", f"/compare/?job={job.pk}",
            "/nodes/gpu-master/"]  # fmt: skip


def api_urls(job: Job) -> list[str]:
    return [
        f"/api/jobs/{job.pk}/series?name=loss",
        f"/api/jobs/{job.pk}/panels?name=loss",
        f"/api/jobs/{job.pk}/logs?tail=10",
        f"/api/jobs/{job.pk}/checkpoints",
        f"/api/jobs/{job.pk}/system",
        "/api/nodes/gpu-master/history",
    ]


def test_logged_out_gets_login_redirect_and_no_data_from_every_page_and_endpoint(client, job):
    for url in page_urls(job) + api_urls(job):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/accounts/login/"), url
        assert b"loss" not in response.content and b"step 1" not in response.content, url


def test_logged_out_post_cancels_nothing(client, job):
    response = client.post(f"/jobs/{job.pk}/cancel/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING


def test_logged_in_pages_render_with_csp_and_nonced_scripts_only(browser, job):
    for url in page_urls(job) + ["/accounts/login/"]:
        response = browser.get(url)
        assert response.status_code == 200, url
        csp = response["Content-Security-Policy"]
        nonce = re.search(r"'nonce-([^']+)'", csp).group(1)
        assert "script-src 'self' 'nonce-" in csp and "object-src 'none'" in csp, url
        html = response.content.decode()
        scripts = re.findall(r"<script\b[^>]*>", html)
        assert scripts, url
        assert all(f'nonce="{nonce}"' in tag for tag in scripts), (url, scripts)
        assert not re.search(r"\son[a-z]+=", html, re.I), f"inline event handler on {url}"
        assert not re.search(r"\sstyle=", html, re.I), f"inline style on {url}"


def test_json_endpoints_give_series_and_log_lines(browser, job):
    series = browser.get(f"/api/jobs/{job.pk}/series?name=loss&buckets=100").json()
    assert series["ranks"]["0"]["x"] == [1, 2, 3, 4, 5] and series["total_points"] == 5
    logs = browser.get(f"/api/jobs/{job.pk}/logs?tail=1").json()
    assert [line[1:] for line in logs["lines"]] == [[0, "step 2 going"]]
    rank0 = job.ranks.get(index=0)
    assert logs["offsets"] == {"0": rank0.log_offset}  # live events ending at or before it are dropped
    assert browser.get(f"/api/jobs/{job.pk}/logs?rank=x").status_code == 400
    # a live job's checkpoints are not looked for (only once it has ended)
    assert browser.get(f"/api/jobs/{job.pk}/checkpoints").json()["checkpoints"] == []


def test_hostile_job_name_metric_name_and_reason_are_escaped(browser, node, settings, tmp_path):
    # given values no form would accept, written straight to the DB (defence in depth)
    settings.JOBS_DIR = tmp_path / "jobs"
    job = Job.objects.create(name=HOSTILE, script="s.py", state=Job.State.FAILED, failure_reason=HOSTILE)
    MetricPoint.objects.create(job=job, rank=0, step=1, name=HOSTILE, value=1.0, time=timezone.now())
    for url in ["/jobs/", f"/jobs/{job.pk}/", f"/compare/?job={job.pk}"]:
        html = browser.get(url).content.decode()
        assert "<script>alert(1)" not in html and "<img src=x" not in html, url
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html, url


def test_cancel_requires_csrf_token(alice, job):
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(alice)
    assert strict.post(f"/jobs/{job.pk}/cancel/").status_code == 403
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING


def test_cancel_a_queued_job_from_the_board(browser, alice):
    job = Job.objects.create(name="waiting", script="s.py", owner=alice)
    response = browser.post(f"/jobs/{job.pk}/cancel/", {"next": "/jobs/"})
    assert response.status_code == 302 and response["Location"] == "/jobs/"
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED
    assert "job waiting cancelled" in browser.get("/jobs/").content.decode()


def test_cancel_never_redirects_off_site(browser, alice):
    job = Job.objects.create(name="waiting", script="s.py", owner=alice)
    response = browser.post(f"/jobs/{job.pk}/cancel/", {"next": "//evil.example/"})
    assert response["Location"] == f"/jobs/{job.pk}/"


def test_resume_from_the_page_queues_the_next_attempt_from_the_chosen_step_and_refuses_in_one_line(
    browser, alice, node, settings, tmp_path, django_capture_on_commit_callbacks
):
    settings.JOBS_DIR = tmp_path / "jobs"
    # given alice's failed job with a complete checkpoint at step 20 and one still being written at step 30
    job = Job.objects.create(name="broke", script="s.py", owner=alice, tag="broke-t1", state=Job.State.FAILED,
                             failure_kind="KILLED", finished_at=timezone.now())  # fmt: skip
    Rank.objects.create(job=job, node=node, index=0, state=Rank.State.EXITED, exit_code=-9, active=False)
    for step, ready in ((20, True), (30, False)):
        Checkpoint.objects.create(job=job, node=node, path=f"/w/outputs/broke/checkpoint_step{step}.pt", size=10,
                                  mtime=0, step=step, ready=ready)  # fmt: skip
    # when another launcher asks: refused, the job as it was
    bob = User.objects.create_user("bob", password="pw-bob-123")
    bob.groups.add(Group.objects.get(name="launcher"))
    other = Client()
    other.force_login(bob)
    response = other.post(f"/jobs/{job.pk}/resume/", {"from": "20"})
    assert response.status_code == 403 and "bob may resume only their own jobs" in response.content.decode()
    job.refresh_from_db()
    assert (job.state, job.attempt) == (Job.State.FAILED, 1)
    # when alice asks for a step with no complete checkpoint, or for no step at all
    for asked in ("30", "x; rm -rf /"):
        response = browser.post(f"/jobs/{job.pk}/resume/", {"from": asked}, follow=True)
        # then each is refused in one line on the job's page, and the job is as it was
        assert response.redirect_chain == [(f"/jobs/{job.pk}/", 302)]
        refusals = re.findall(r"resume of broke refused: [^<\n]+", response.content.decode())
        assert len(refusals) == 1, (asked, response.content.decode()[:3000])
        job.refresh_from_db()
        assert (job.state, job.attempt) == (Job.State.FAILED, 1)
    # when alice resumes it from step 20
    with django_capture_on_commit_callbacks() as callbacks:
        response = browser.post(f"/jobs/{job.pk}/resume/", {"from": "20"})
    # then it is queued as attempt 2 from that checkpoint, the worker asked after commit, and the page says so
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.pk}/"
    job.refresh_from_db()
    assert (job.state, job.attempt, job.resume_step) == (Job.State.QUEUED, 2, 20)
    assert job.resume_path.endswith("checkpoint_step20.pt")
    assert [cb for cb in callbacks if cb.__qualname__.startswith("request_schedule.")]
    html = browser.get(f"/jobs/{job.pk}/").content.decode()
    assert "job broke queued as attempt 2" in html and "attempt 2 from step 20" in html


def test_launch_form_shows_the_launch_error_for_a_bad_name(browser, node):
    response = browser.post("/jobs/launch/", {"name": "bad name;rm", "count": "1"})
    assert response.status_code == 200
    html = response.content.decode()
    assert "job name &#x27;bad name;rm&#x27; is not allowed" in html
    assert not Job.objects.exists()


def test_launch_form_queues_a_job_and_its_start_after_commit(browser, node, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        response = browser.post(
            "/jobs/launch/",
            {"name": "web-1", "nodes": ["gpu-master"], "epochs": "2", "lr": "0.01", "extra_args": "--max-steps 40"},
        )
    job = Job.objects.get(name="web-1")
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.pk}/"
    assert job.state == Job.State.QUEUED and job.requested_nodes == ["gpu-master"]
    assert job.params["epochs"] == 2 and job.params["extra"] == ["--max-steps", "40"]
    assert len(callbacks) == 1


def test_relaunch_makes_a_new_job_with_the_same_params_and_a_numbered_name(browser, job):
    first = browser.post(f"/jobs/{job.pk}/relaunch/")
    second = browser.post(f"/jobs/{job.pk}/relaunch/")
    r1, r2 = Job.objects.get(name="demo-r1"), Job.objects.get(name="demo-r2")
    assert first["Location"] == f"/jobs/{r1.pk}/" and second["Location"] == f"/jobs/{r2.pk}/"
    assert r1.params == job.params and r1.script == job.script and r1.state == Job.State.QUEUED
    browser.post(f"/jobs/{r1.pk}/relaunch/")
    assert Job.objects.filter(name="demo-r3").exists()


def test_board_lanes_and_filters(browser, job):
    Job.objects.create(name="later", script="s.py")
    html = browser.get("/jobs/").content.decode()
    assert "demo" in html and "later" in html
    html = browser.get("/jobs/?state=queued").content.decode()
    assert "later" in html and f'href="/jobs/{job.pk}/"' not in html
    html = browser.get("/jobs/?q=dem").content.decode()
    assert f'href="/jobs/{job.pk}/"' in html and "later" not in html


def test_detail_shows_progress_from_max_steps(browser, job):
    html = browser.get(f"/jobs/{job.pk}/").content.decode()
    assert "step 5/10" in html and "50.0%" in html


def test_overview_shows_nodes_and_the_job_each_runs(browser, job):
    html = browser.get("/").content.decode()
    assert "gpu-master" in html and "RTX 5070 Ti" in html and f'href="/jobs/{job.pk}/"' in html


def test_overview_shows_the_latest_gpu_readings_and_open_alerts_escaped(browser, node):
    from cluster.models import Alert, HealthSample

    now = timezone.now()
    gpu = {"index": 0, "util_percent": 87, "mem_used_mb": 6144, "mem_total_mb": 12288, "temp_c": 71}
    HealthSample.objects.create(node=node, time=now, score=92, gpus=[gpu])
    Alert.objects.create(node=node, key="ram", severity="warning", message=HOSTILE, opened_at=now, updated_at=now)
    html = browser.get("/").content.decode()
    assert "87%" in html and "6144/12288 MB" in html and "71 °C" in html and "92/100" in html
    assert "Open alerts" in html and "&lt;img src=x" in html and "<img src=x" not in html


def test_admin_is_staff_only(browser):
    response = browser.get("/admin/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_board_queries_do_not_grow_with_the_number_of_jobs(browser, node, django_assert_max_num_queries):
    for i in range(30):
        job = Job.objects.create(name=f"run-{i}", script="s.py", state=Job.State.SUCCEEDED, finished_at=timezone.now())
        Rank.objects.create(job=job, node=node, index=0, active=False)
    with django_assert_max_num_queries(12):
        assert browser.get("/jobs/").status_code == 200


def test_relaunch_refused_shows_why(browser, db):
    job = Job.objects.create(name="x" * 64, script="s.py", state=Job.State.FAILED)
    response = browser.post(f"/jobs/{job.pk}/relaunch/", follow=True)
    assert "relaunch of " in response.content.decode() and "is not allowed" in response.content.decode()
    assert Job.objects.count() == 1


def test_ended_job_shows_final_metrics_per_rank(browser, db):
    job = Job.objects.create(name="done", script="s.py", state=Job.State.SUCCEEDED, finished_at=timezone.now())
    now = timezone.now()
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, rank=r, step=s, name="loss", value=2.0 - s / 10 + r, time=now)
        for r in (0, 1)
        for s in (1, 2, 3)
    )
    html = browser.get(f"/jobs/{job.pk}/").content.decode()
    assert "Rank 0</th>" in html and "Rank 1</th>" in html
    assert '<td class="num">1.7</td><td class="num">2.7</td>' in html


def test_detail_progress_from_epochs_when_no_max_steps(browser, db):
    now = timezone.now()
    job = Job.objects.create(
        name="hf", script="s.py", state=Job.State.RUNNING, running_at=now, started_at=now, params={"epochs": 2}
    )
    MetricPoint.objects.bulk_create(
        [
            MetricPoint(job=job, rank=0, step=10, name="loss", value=2.0, time=now),
            MetricPoint(job=job, rank=0, step=10, name="epoch", value=0.5, time=now),
        ]
    )
    assert "25.0%" in browser.get(f"/jobs/{job.pk}/").content.decode()


def test_queue_page_shows_each_waiting_jobs_reason_and_which_job_holds_which_gpu(browser, db):
    from jobs.launch import LaunchRequest, create_job
    from jobs.scheduler import place_queued

    # given a 2-GPU node, one GPU held by a running job, and two jobs waiting
    Node.objects.create(name="gpu0", address="10.1.1.1", role=Node.Role.MASTER, gpu_count=2, gpu_vram_gb=12)
    create_job(LaunchRequest(name="holder", gpus=1, time_limit_s=3600))
    place_queued()
    create_job(LaunchRequest(name="wide", gpus=2, priority=50))
    create_job(LaunchRequest(name="narrow", gpus=1, time_limit_s=7200))
    html = browser.get("/jobs/queue/").content.decode()
    # then the waiting job shows its position, reason and estimated start
    row = re.search(r'<tr data-job="wide" data-reason="resources">(.*?)</tr>', html, re.S).group(1)
    assert "<td>1</td>" in row and "next to start: GPUs reserved for it in 59m" in row and "2 GPUs" in row
    assert re.search(r'<tr data-job="narrow" data-reason="reservation">', html)
    # and the GPU table says which job holds which GPU
    gpu0 = re.search(r'<tr data-node="gpu0" data-gpu="0">(.*?)</tr>', html, re.S).group(1)
    gpu1 = re.search(r'<tr data-node="gpu0" data-gpu="1">(.*?)</tr>', html, re.S).group(1)
    assert "holder" in gpu0 and "12.0 GB" in gpu0 and "free" in gpu1
    # and the node card on the overview too
    overview = browser.get("/").content.decode()
    assert re.search(r'<li data-gpu="0">GPU 0: <a href="/jobs/\d+/">holder</a></li>', overview)
    assert '<li data-gpu="1">GPU 1: <span class="muted">free</span></li>' in overview


def test_queue_page_queries_do_not_grow_with_the_queue(browser, db, django_assert_max_num_queries):
    Node.objects.create(name="gpu0", address="10.1.1.1", role=Node.Role.MASTER, gpu_count=1)
    Job.objects.bulk_create(Job(name=f"w{i}", script="s.py", gpus=1) for i in range(100))
    with django_assert_max_num_queries(16):
        assert browser.get("/jobs/queue/").status_code == 200


def test_launch_form_asks_for_gpus_time_limit_and_vram(browser, db):
    Node.objects.create(name="gpu0", address="10.1.1.1", role=Node.Role.MASTER, gpu_count=2, gpu_vram_gb=12)
    response = browser.post(
        "/jobs/launch/", {"name": "formgpu", "gpus": "1", "time_limit": "90m", "min_vram": "10G", "priority": "0"}
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    job = Job.objects.get(name="formgpu")
    assert (job.gpus, job.time_limit_s, job.min_vram_mb, job.requested_count) == (1, 5400, 10240, None)
    # a bad value is shown at its field, and nothing is queued
    html = browser.post("/jobs/launch/", {"name": "bad", "time_limit": "soon", "priority": "0"}).content.decode()
    assert "time limit &#x27;soon&#x27; is not a duration" in html
    html = browser.post("/jobs/launch/", {"name": "big", "gpus": "1", "min_vram": "16G", "priority": "0"}).content
    assert b"no GPU has 16.0 GB; the largest is gpu0 GPU 0" in html
    assert not Job.objects.filter(name__in=["bad", "big"]).exists()
