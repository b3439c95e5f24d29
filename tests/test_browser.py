"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against a real daphne,
a real Celery worker and real training on the loopback sshd nodes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.contrib.auth.models import Group, User
from django.db import connections

from jobs.models import Job

from .conftest import REPO, job_pids, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.no_test_worker]  # `server` runs its worker
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
# long enough to still run when the page has shown its first points (one epoch is only 182 steps)
TRAIN_ARGS = "--max-steps 1000 --num-epochs 10 --seq-len 16 --batch-size 4 --log-every 1 --step-sleep 0.1"
# Printed by a rank: must show as text and run nothing.
HOSTILE_LINES = ["<script>window.__pwned = 1</script>", '<img src=x onerror="window.__pwned = 2">'] + [
    json.dumps({"step": step, "loss": 1.0 / step, "<img src=x onerror=alert(3)>": 1.0}) for step in range(1, 6)
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture
def controller(controller_env, monkeypatch) -> dict:
    """The environment of this test's controller processes (same DB, data dir and Redis)."""
    # Playwright's sync API keeps an event loop in this thread; the ORM calls here stay synchronous.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    return {**controller_env, "SECRET_KEY": "browser-test-secret-key-browser-test-secret-key"}


@contextmanager
def daphne_serving(env: dict, log: Path):
    """daphne serving the app (HTTP, static files, websockets) on a free port; yields its base URL."""
    port = free_port()
    daphne = start([str(REPO / ".venv/bin/daphne"), "-b", "127.0.0.1", "-p", str(port), "ugro_site.asgi:application"],
                   env, log)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_ok(base + "/accounts/login/"), timeout=30, what="daphne to serve")
        yield base
    finally:
        stop(daphne)


@pytest.fixture
def web(lab, controller, tmp_path):
    with daphne_serving(controller, tmp_path / "daphne.log") as base:
        yield base


@pytest.fixture
def server(web, controller, tmp_path):
    """The app plus a Celery worker with beat: it schedules, launches, follows jobs and polls health."""
    worker = start([sys.executable, "-m", "celery", "-A", "ugro_site", "worker", "-P", "threads", "-c", "4",
                    "-n", "browser@%h", "--loglevel=warning"],
                   controller, tmp_path / "worker.log")  # fmt: skip
    try:
        from ugro_site.celery import worker_alive

        # commands refuse with no worker alive: a loaded machine takes seconds to start one
        wait_for(worker_alive, timeout=60, what="the worker's heartbeat")
        yield web
    finally:
        stop(worker)


@pytest.fixture
def chromium():
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()
        # Under Playwright the ORM runs in another context, hence on a connection of its own: close it too.
        connections.close_all()


def new_page(chromium, errors: list[str]):
    page = chromium.new_context(viewport={"width": 1440, "height": 1000}).new_page()
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.on("dialog", lambda d: d.accept())  # the cancel button asks first
    return page


def log_in(page, base: str) -> None:
    User.objects.create_user("alice", password="pw-alice-123").groups.add(Group.objects.get(name="launcher"))
    page.goto(base + "/")
    assert "/accounts/login/" in page.url
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(base + "/")


def add_gpu_readings() -> None:
    """A GPU reading per node, as a probe on a GPU machine would record it (no GPU here)."""
    from django.utils import timezone

    from cluster.models import HealthSample, Node

    for i, node in enumerate(Node.objects.all()):
        gpu = {"index": 0, "util_percent": 35 + 25 * i, "mem_used_mb": 2048 * (i + 1), "mem_total_mb": 8192,
               "temp_c": 48 + 9 * i}  # fmt: skip
        HealthSample.objects.create(node=node, time=timezone.now(), score=95 - 5 * i, gpus=[gpu])


def points_shown(page) -> int:
    text = page.text_content("#chart-info") or ""
    return int(text.split()[0]) if text[:1].isdigit() else 0


def test_launch_watch_live_and_cancel_from_the_browser(server, chromium):
    """Covers: the dashboard's live path whole: a job launched from the form, its curve and every rank's lines arriving
    over the websocket from a real worker following torchrun on three sshd nodes, and a cancel from the page that frees
    the nodes.
    """
    errors: list[str] = []
    page = new_page(chromium, errors)
    log_in(page, server)
    add_gpu_readings()
    page.goto(server + "/")
    page.screenshot(path=ARTIFACTS / "cluster-overview.png", full_page=True)

    # given a job launched from the form on all three nodes
    page.goto(server + "/jobs/launch/")
    page.fill("#id_name", "web-run")
    page.fill("#id_extra_args", TRAIN_ARGS)
    page.screenshot(path=ARTIFACTS / "launch-form.png", full_page=True)
    page.click("#launch-form button[type=submit]")
    page.wait_for_url(f"{server}/jobs/*/")
    job = Job.objects.get(name="web-run")
    page.evaluate("window.__sameDocument = true")

    # then the loss curve gains points and every rank's lines appear, without reloading
    wait_for(lambda: points_shown(page) >= 10, timeout=150, what="the first loss points in the chart")
    first = points_shown(page)
    wait_for(lambda: points_shown(page) > first + 10, timeout=60, what="more loss points")
    assert page.locator('#panels .panel[data-name="loss"] canvas').count() >= 1
    for rank in range(3):
        page.wait_for_selector(f'#log .line[data-rank="{rank}"]', state="attached", timeout=30_000)
    page.wait_for_selector("#job-state.badge-running", timeout=30_000)
    assert page.evaluate("window.__sameDocument") is True
    page.screenshot(path=ARTIFACTS / "job-running.png", full_page=True)

    # the log filters work on what is already shown
    page.select_option("#log-rank", "1")
    assert page.locator('#log .line[data-rank="0"]:visible').count() == 0
    assert page.locator('#log .line[data-rank="1"]:visible').count() > 0
    page.select_option("#log-rank", "")
    page.fill("#log-search", "tokens_per_sec")

    def only_matches_shown() -> bool:
        shown = page.locator("#log .line:visible .line-text").all_text_contents()
        return bool(shown) and all("tokens_per_sec" in t for t in shown)

    wait_for(only_matches_shown, timeout=10, what="the search to leave only matching lines")
    page.fill("#log-search", "")

    # pausing autoscroll keeps the reader's place while lines keep arriving
    page.uncheck("#log-follow")
    page.eval_on_selector("#log", "log => { log.scrollTop = 0; }")
    before = page.locator("#log .line").count()
    wait_for(lambda: page.locator("#log .line").count() > before + 5, timeout=30, what="more log lines")
    assert page.eval_on_selector("#log", "log => log.scrollTop") == 0
    page.check("#log-follow")
    assert page.eval_on_selector("#log", "log => log.scrollTop + log.clientHeight >= log.scrollHeight - 2")

    # when it is cancelled from the page
    page.click("#cancel-btn")
    wait_for(lambda: Job.objects.get(pk=job.pk).state == Job.State.CANCELLED, timeout=60, what="the cancel")
    page.wait_for_selector("#job-state.badge-cancelled", timeout=30_000)
    # the worker stops its processes in the background, then frees the nodes
    wait_for(lambda: not job.ranks.filter(active=True).exists(), timeout=60, what="the nodes to be freed")
    assert job_pids(job.tag) == []
    page.screenshot(path=ARTIFACTS / "job-cancelled.png", full_page=True)

    page.goto(server + "/jobs/")
    assert page.locator(".lane-done .job-card", has_text="web-run").count() == 1
    page.screenshot(path=ARTIFACTS / "jobs-board.png", full_page=True)
    page.goto(f"{server}/compare/?job={job.pk}")
    page.wait_for_selector("#compare-chart[data-ready] canvas", timeout=10_000)
    page.screenshot(path=ARTIFACTS / "compare.png", full_page=True)
    assert not errors, errors


def test_hostile_log_lines_show_as_text_and_run_nothing(web, chromium):
    """Covers: markup printed by a rank, shown as text by the page's JavaScript both live (websocket) and reloaded
    (logs endpoint); the fast tests check what the server escapes, not the browser's DOM. The lines come as the
    follower leaves them (the rank's central log, its committed offset, metric rows, a "batch" event): the real
    form, follower and websocket path is test_launch_watch_live_and_cancel_from_the_browser's.
    """
    from django.utils import timezone

    from cluster.models import Node
    from jobs.logs import display_text
    from jobs.models import Rank
    from metrics.models import MetricPoint

    from .jobrows import update_jobs
    from .test_dashboard_browser import send_job_event

    errors: list[str] = []
    page = new_page(chromium, errors)
    log_in(page, web)
    # given a running one-rank job whose page is open and live
    now = timezone.now()
    job = Job.objects.create(name="hostile", script="train/hostile.py", state=Job.State.RUNNING, started_at=now,
                             running_at=now)  # fmt: skip
    rank = Rank.objects.create(job=job, node=Node.objects.order_by("name").first(), index=0, state=Rank.State.RUNNING)
    page.goto(f"{web}/jobs/{job.pk}/")
    page.wait_for_selector("#live-dot.on", timeout=10_000)

    # when its rank prints markup, committed as the follower commits it and sent as its event
    data = "".join(line + "\n" for line in HOSTILE_LINES).encode()
    rank.local_log.parent.mkdir(parents=True, exist_ok=True)
    rank.local_log.write_bytes(data)
    Rank.objects.filter(pk=rank.pk).update(log_offset=len(data), log_lines=len(HOSTILE_LINES))
    points = [(step, name, value) for step in range(1, 6)
              for name, value in (("loss", 1.0 / step), ("<img src=x onerror=alert(3)>", 1.0))]  # fmt: skip
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, rank=0, step=step, name=name, value=value, time=now) for step, name, value in points
    )
    part = {"rank": 0, "start": 0, "end": len(data), "lines": [display_text(ln) for ln in HOSTILE_LINES],
            "points": [[0, step, name, value] for step, name, value in points]}  # fmt: skip
    send_job_event(job, "batch", {"parts": [part]})

    # then live: the lines arrive over the websocket as text, and nothing in them runs or becomes an element
    line = page.locator("#log .line-text", has_text="<script>window.__pwned = 1</script>")
    line.wait_for(state="visible", timeout=20_000)
    page.locator("#log .line-text", has_text='<img src=x onerror="window.__pwned = 2">').wait_for(timeout=10_000)
    page.screenshot(path=ARTIFACTS / "hostile-live.png", full_page=True)
    assert page.locator("#log img, #log script").count() == 0
    assert page.evaluate("window.__pwned") is None
    # when it ends
    Rank.objects.filter(pk=rank.pk).update(state=Rank.State.EXITED, exit_code=0, active=False)
    update_jobs(Job.objects.filter(pk=job.pk), state=Job.State.SUCCEEDED, finished_at=timezone.now())
    send_job_event(job, "state", {"state": "succeeded"})

    # then reloaded: the same lines come from the logs endpoint, the metric name from the template
    page.reload()
    line.wait_for(state="visible", timeout=20_000)
    assert page.locator("#log img, #log script, select img").count() == 0
    assert page.locator("#panels .panel-toggle", has_text="<img src=x onerror=alert(3)>").count() == 1
    assert page.evaluate("window.__pwned") is None
    # checkpoints are what the follower recorded (none here)
    page.locator("#checkpoints", has_text="No checkpoints recorded.").wait_for(timeout=30_000)
    page.screenshot(path=ARTIFACTS / "hostile-ended.png", full_page=True)
    assert not [e for e in errors if "pwned" in e], errors


def test_resume_a_failed_job_from_its_page_continues_its_curve(web, chromium):
    """Covers: the Resume button of a failed job's page in a browser: step 20 chosen, attempt 2 queued from it, and once
    its points come one curve across both attempts with attempt 2 marked on the chart. Rows stand for the run: the real
    kill, checkpoint and resume on nodes are tests/test_recovery_e2e.py's, the view's refusals tests/test_pages.py's.
    """
    from django.utils import timezone

    from cluster.models import Node
    from jobs.models import Checkpoint, Rank
    from metrics.models import MetricPoint

    errors: list[str] = []
    page = new_page(chromium, errors)
    log_in(page, web)
    # given alice's two-node run (a launcher resumes her own jobs) whose rank 1 was killed after step 25, with the
    # checkpoints of steps 10 and 20 saved by rank 0 and every rank's loss logged every 5 steps
    nodes = list(Node.objects.order_by("name")[:2])
    now = timezone.now()
    job = Job.objects.create(
        name="web-resume", script="train/train_production.py", owner=User.objects.get(username="alice"),
        tag="web-resume-t1", state=Job.State.FAILED, failure_kind="KILLED", failure_node=nodes[1].name,
        started_at=now, running_at=now, finished_at=now,
    )  # fmt: skip
    for i, node in enumerate(nodes):
        Rank.objects.create(job=job, node=node, index=i, state=Rank.State.EXITED, exit_code=-9 * i, active=False)
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, rank=r, step=s, name="loss", value=3.0 / s, attempt=1, time=now)
        for r in range(2) for s in range(5, 26, 5)
    )  # fmt: skip
    for step in (10, 20):
        Checkpoint.objects.create(job=job, node=nodes[0], path=f"{nodes[0].workdir}/outputs/web-resume/"
                                  f"checkpoint_step{step}.pt", size=10, mtime=0, step=step, ready=True)  # fmt: skip

    # when its page's Resume button is pressed with step 20 chosen
    page.goto(f"{web}/jobs/{job.pk}/")
    page.locator("#checkpoints td", has_text="20").first.wait_for(timeout=10_000)
    page.select_option("#resume-from", "20")
    page.screenshot(path=ARTIFACTS / "job-resume.png", full_page=True)
    page.click("#resume-btn")
    page.wait_for_url(f"{web}/jobs/{job.pk}/")

    # then the same job is queued as attempt 2 from step 20 (no worker here: it stays queued), shown on its page
    page.locator("#job-attempt", has_text="2 from step 20").wait_for(timeout=10_000)
    job.refresh_from_db()
    assert (job.state, job.attempt, job.resume_step) == (Job.State.QUEUED, 2, 20)
    # when attempt 2's points come (from step 25, as a run resumed at 20 logs them) and the page is reloaded
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, rank=0, step=s, name="loss", value=2.0 / s, attempt=2, time=timezone.now())
        for s in range(25, 51, 5)
    )  # fmt: skip
    page.reload()
    page.wait_for_selector("#panels[data-ready]", state="attached", timeout=30_000)
    # then the chart marks where attempt 2 joined, both attempts are listed, and rank 0's curve is one line: attempt
    # 1's step 25 (past the checkpoint) left it, attempt 2's took its place
    page.locator("#chart-attempts", has_text="attempt 2 from step 20").wait_for(timeout=20_000)
    assert page.locator("#attempts tr").count() == 3  # header, attempt 1, attempt 2
    shown = "UGRO.jobBoard.panels.get('loss')?.lines.get('0')?.x"
    wait_for(lambda: page.evaluate(shown) == list(range(5, 51, 5)), timeout=10, what="one curve over both attempts")
    steps = list(MetricPoint.objects.filter(job=job, name="loss", rank=0, superseded=False)
                 .order_by("step").values_list("step", flat=True))  # fmt: skip
    assert steps == list(range(5, 51, 5))
    page.screenshot(path=ARTIFACTS / "job-resumed.png", full_page=True)
    assert not errors, errors


def test_logged_out_browser_gets_no_page_no_json_and_no_websocket(web, chromium):
    """Covers: a real browser's websocket handshake refused without a session by daphne's ASGI stack; Django's test
    client, which the fast tests use, has no websocket.
    """
    job = Job.objects.create(name="secret-run", script="s.py")
    errors: list[str] = []
    page = new_page(chromium, errors)
    pages = ["/", "/jobs/", f"/jobs/{job.pk}/", "/compare/", "/jobs/launch/"]
    for path in pages + [f"/api/jobs/{job.pk}/series?name=loss", f"/api/jobs/{job.pk}/logs"]:
        response = page.goto(web + path)
        assert "/accounts/login/" in page.url, path
        assert response.headers["content-type"].startswith("text/html"), path
        assert "secret-run" not in page.content(), path
    outcome = page.evaluate(
        """path => new Promise(done => {
            const ws = new WebSocket("ws://" + location.host + path);
            ws.onopen = () => done("open");
            ws.onclose = () => done("closed");
            setTimeout(() => done("timeout"), 5000);
        })""",
        f"/ws/jobs/{job.pk}/",
    )
    assert outcome == "closed"
    page.screenshot(path=ARTIFACTS / "logged-out.png")


def publish_cluster_event(data: dict) -> None:
    """What the health monitor sends after a poll (from a thread: Playwright's loop owns this one)."""
    import threading

    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    def send() -> None:
        event = {"type": "cluster.event", "kind": "node", "data": data}
        async_to_sync(get_channel_layer().group_send)("cluster", event)

    thread = threading.Thread(target=send)
    thread.start()
    thread.join(10)


def test_cluster_overview_follows_node_status_without_reloading(web, chromium):
    """No worker here: the event is the only thing that changes the page.

    Covers: the overview's JavaScript turning a node card red in place from a cluster event over a real websocket
    (daphne, the Redis channel layer).
    """
    from cluster.models import Node

    errors: list[str] = []
    page = new_page(chromium, errors)
    log_in(page, web)
    page.wait_for_selector("#live-dot.on", timeout=10_000)
    page.evaluate("window.__sameDocument = true")
    # when a poll finds node2 down and says so on the cluster group
    Node.objects.filter(name="node2").update(status=Node.Status.DOWN, status_reason="3 probes failed: <b>timeout</b>")
    publish_cluster_event({"node": "node2", "status": "down"})
    # then its card turns red in place, the reason shown as text
    card = page.locator('.node-card[data-node="node2"]')
    card.locator(".badge-down").wait_for(timeout=10_000)
    assert "3 probes failed: <b>timeout</b>" in card.text_content()
    assert page.evaluate("window.__sameDocument") is True
    page.screenshot(path=ARTIFACTS / "cluster-node-down.png", full_page=True)
    assert not errors, errors


def test_launch_form_shows_each_ranks_command_before_launching(web, chromium):
    """Covers: the form's "Show commands" button in Chromium: its request and what it draws, the form kept as typed; the
    dry run's text alone has fast tests.
    """
    errors: list[str] = []
    page = new_page(chromium, errors)
    log_in(page, web)
    # given the launch form filled in
    page.goto(web + "/jobs/launch/")
    page.fill("#id_name", "look-first")
    page.fill("#id_extra_args", "--max-steps 5 --note 'a b'")
    # when "Show commands" is pressed
    page.click("#dry-run-btn")
    # then each rank's exact command line is shown, the form keeps its values, and nothing was queued
    page.wait_for_selector("#dry-run pre", timeout=10_000)
    shown = page.text_content("#dry-run pre") or ""
    assert shown.count("torchrun --nnodes=3") == 3
    assert "train/train_production.py --model-name tiny --dataset-name gpl-3 --max-steps 5 --note 'a b'" in shown
    assert page.input_value("#id_name") == "look-first"
    assert not Job.objects.exists()
    page.screenshot(path=ARTIFACTS / "launch-dry-run.png", full_page=True)
    assert not errors, errors


def test_queue_page_shows_why_each_job_waits_and_who_holds_each_node(web, chromium):
    """Covers: the queue page reached from the navigation and drawn in Chromium with no console or HTTP error; its
    reasons and estimates alone are tests/test_scheduler.py's.
    """
    from jobs.launch import LaunchRequest, create_job
    from jobs.scheduler import place_queued

    # given one node held by a job (no worker: nothing launches it) and a 3-node job waiting behind it
    create_job(LaunchRequest(name="holder", count=1, time_limit_s=3600))
    place_queued()
    create_job(LaunchRequest(name="everything", count=3, priority=20))
    errors: list[str] = []
    page = new_page(chromium, errors)
    log_in(page, web)
    # when the queue page is opened from the navigation
    page.click("nav >> text=Queue")
    page.wait_for_selector("#queue-table")
    # then the waiting job's reason, estimate and the node holder are shown
    row = page.locator('#queue-table tr[data-job="everything"]')
    assert row.get_attribute("data-reason") == "resources"
    assert "next to start" in row.text_content() and "in 59" in row.text_content()
    held = page.locator('#gpu-table tr[data-node="node1"]').text_content()
    assert "whole node (no GPU)" in held and "holder" in held
    assert "free" in page.locator('#gpu-table tr[data-node="node2"]').text_content()
    page.screenshot(path=ARTIFACTS / "queue.png", full_page=True)
    assert not errors, errors


def test_services_page_shows_each_replica_and_its_stats_with_a_hostile_note_as_text(web, chromium):
    """Covers: the services page refreshing in the browser (a replica turning ready with no reload, the start form
    keeping what is typed) and a hostile note left as text in the DOM.
    """
    from cluster.models import Node
    from jobs.models import Checkpoint
    from serving.models import Replica, Service
    from serving.stats import Recorder

    # given a service of two replicas, one of which answered requests and whose last note is hostile
    hostile = "<img src=x onerror=alert(1)><script>alert(2)</script>"
    node = Node.objects.get(name="node2")
    job = Job.objects.create(name="trained", script="train.py", state=Job.State.SUCCEEDED)
    ckpt = Checkpoint.objects.create(job=job, node=node, path="/w/checkpoint-10", size=1, mtime=0, step=10,
                                     kind=Checkpoint.Kind.DIR, ready=True)  # fmt: skip
    service = Service.objects.create(name="chat", job=job, checkpoint=ckpt, replicas=2)
    busy = Replica.objects.create(service=service, index=0, state=Replica.State.READY, node=node, port=8001,
                                  restarts=2, note=hostile)  # fmt: skip
    Replica.objects.create(service=service, index=1, state=Replica.State.PENDING, note="waiting for 1 free GPUs")
    web_process = Recorder()
    for _ in range(30):
        web_process.record(busy.pk, 0.020, tokens=8)
    web_process.flush()
    errors: list[str] = []
    page = new_page(chromium, errors)
    dialogs: list[str] = []
    page.on("dialog", lambda d: dialogs.append(d.message))
    log_in(page, web)

    # when the services page is opened from the navigation
    page.click("nav >> text=Services")
    page.wait_for_selector('section[data-service="chat"]')

    # then each replica shows its state, the step it serves, node, restarts and last minute's requests; the note is text
    row = page.locator('section[data-service="chat"] tr[data-replica="0"]')
    assert row.get_attribute("data-state") == "ready"
    cells = [c.strip() for c in row.locator("td").all_text_contents()]
    assert cells[:7] == ["0", "ready", "10", "node2:8001", "whole node", "2", "0.50"]  # "10": the step it serves
    assert cells[7].endswith("ms") and cells[9:11] == ["4.0", "0"] and cells[11] == hostile
    assert page.locator('section[data-service="chat"] img').count() == 0 and dialogs == []
    waiting = page.locator('section[data-service="chat"] tr[data-replica="1"]').text_content()
    assert "pending" in waiting and "waiting for 1 free GPUs" in waiting
    page.screenshot(path=ARTIFACTS / "services.png", full_page=True)

    # and when the waiting replica is ready and answers, the open page shows it without a reload
    page.fill("#id_name", "typed")  # the start form keeps what is being typed
    Replica.objects.filter(service=service, index=1).update(state=Replica.State.READY, node=node, port=8002, note="")
    for _ in range(10):
        web_process.record(Replica.objects.get(service=service, index=1).pk, 0.010, tokens=8)
    web_process.flush()
    page.wait_for_selector('section[data-service="chat"] tr[data-replica="1"][data-state="ready"]', timeout=20_000)
    second = page.locator('section[data-service="chat"] tr[data-replica="1"] td')
    ready = [c.strip() for c in second.all_text_contents()]
    assert ready[1:4] == ["ready", "10", "node2:8002"] and float(ready[6]) > 0
    assert page.input_value("#id_name") == "typed"
    assert not errors, errors


def test_sweep_page_overlays_trial_curves_marks_the_best_and_sorts(web, chromium, worker_heartbeat):
    """Covers: the sweep page's chart overlaying the trials with the best starred, and its table sorted by a click on
    its header: JavaScript only a browser runs.
    """
    from django.core.management import call_command
    from django.utils import timezone

    from jobs.models import Sweep
    from metrics.models import MetricPoint

    # given a 3-trial sweep whose trials logged a loss (trial 2 ends lowest)
    call_command("sweep", "sw", "--grid", "lr=0.1,0.2,0.3", "--nodes", "1", stdout=open(os.devnull, "w"))
    sweep = Sweep.objects.get(name="sw")
    now = timezone.now()
    ends = {"sw-001": 1.5, "sw-002": 0.5, "sw-003": 1.0}
    for job in sweep.trials.all():
        MetricPoint.objects.bulk_create(
            MetricPoint(job=job, rank=0, step=s, name="loss", value=ends[job.name] + 2.0 / s, time=now)
            for s in range(1, 21)
        )
    errors: list[str] = []
    page = new_page(chromium, errors)
    log_in(page, web)
    page.goto(f"{web}/sweeps/{sweep.pk}/")
    # then the three curves are drawn on one chart with the best trial starred
    page.locator("#chart-info", has_text="3 of 3 jobs logged loss").wait_for(timeout=10_000)
    page.wait_for_selector("#compare-chart[data-ready] .u-legend", timeout=10_000)
    assert "\u2605 sw-002" in page.text_content("#compare-chart")
    assert page.get_attribute('#trials tr[data-job="sw-002"]', "class") == "best"
    # and clicking "Final loss" sorts the trials by it, again reverses
    header = page.locator("#trials th", has_text="Final loss")
    header.click()
    order = page.eval_on_selector_all("#trials tbody tr", "rows => rows.map(r => r.dataset.job)")
    assert order == ["sw-002", "sw-003", "sw-001"]
    header.click()
    order = page.eval_on_selector_all("#trials tbody tr", "rows => rows.map(r => r.dataset.job)")
    assert order == ["sw-001", "sw-003", "sw-002"]
    page.screenshot(path=ARTIFACTS / "sweep.png", full_page=True)
    assert not errors, errors
