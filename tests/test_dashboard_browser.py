"""Issue 13's pages in real Chromium: metric panels (grouped, searchable, collapsible), smoothing, log y,
x axes, synced hover, CSV/PNG download, URL state, live append, results at the end without reload, a
single point visible, system metrics on the job and node pages, and compare. Data is written to the DB
directly and live events sent on the channel layer, as the follower and the health monitor do."""

from __future__ import annotations

import math
import shutil
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import transaction
from django.utils import timezone

from cluster.models import HealthSample, Node
from jobs.energy import job_energy
from jobs.models import Checkpoint, Job, Rank
from metrics import rollup
from metrics.ingest import Sample, save_points
from metrics.models import MetricPoint

from .conftest import wait_for
from .jobrows import update_jobs
from .test_browser import ARTIFACTS, chromium, controller, log_in, new_page, web  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.no_test_worker]  # each test moves its jobs by hand
BLUE = (0x25, 0x63, 0xEB)  # the first line colour (rank 0)
# Where screenshots for docs/img are copied by hand from (see docs/benchmarks-dashboard.md).
SHOTS = ARTIFACTS / "dashboard"

INK = """([name, rgb]) => {
  const panel = document.querySelector('#panels .panel[data-name="' + CSS.escape(name) + '"] canvas');
  if (!panel) return -1;
  const data = panel.getContext('2d').getImageData(0, 0, panel.width, panel.height).data;
  let n = 0;
  for (let i = 0; i < data.length; i += 4)
    if (Math.abs(data[i] - rgb[0]) < 40 && Math.abs(data[i + 1] - rgb[1]) < 40 && Math.abs(data[i + 2] - rgb[2]) < 40
        && data[i + 3] > 200) n++;
  return n;
}"""
CANVAS_HASH = """(name) => {
  const c = document.querySelector('#panels .panel[data-name="' + CSS.escape(name) + '"] canvas');
  return c ? c.toDataURL() : '';
}"""


def send_job_event(job: Job, kind: str, data: dict) -> None:
    """What the follower sends (from a thread: Playwright's loop owns this one)."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from jobs.events import job_group

    def send() -> None:
        async_to_sync(get_channel_layer().group_send)(
            job_group(job.pk), {"type": "job.event", "kind": kind, "data": data}
        )

    thread = threading.Thread(target=send)
    thread.start()
    thread.join(10)


def ran_job(name: str, nodes: list[Node], minutes: float = 10, **fields) -> Job:
    """A job that ran `minutes` on `nodes` (one rank each), finished now unless told otherwise."""
    now = timezone.now()
    start = now - timedelta(minutes=minutes)
    fields = {"state": Job.State.SUCCEEDED, "started_at": start, "running_at": start, "finished_at": now, **fields}
    job = Job.objects.create(name=name, script="train/train_production.py", **fields)
    for i, node in enumerate(nodes):
        Rank.objects.create(job=job, node=node, index=i, state=Rank.State.EXITED, active=False, exit_code=0)
    return job


def add_curves(job: Job, ranks: int, steps: int, names: dict) -> None:
    """names: metric -> f(rank, step) or a list of steps it was logged at (value from f)."""
    start = job.running_at
    span = ((job.finished_at or timezone.now()) - start).total_seconds()
    rows = []
    for name, (f, at) in names.items():
        for r in range(ranks):
            for s in at or range(1, steps + 1):
                rows.append(MetricPoint(job=job, rank=r, step=s, name=name, value=f(r, s),
                                        time=start + timedelta(seconds=span * s / steps)))  # fmt: skip
    MetricPoint.objects.bulk_create(rows, batch_size=5000)


def add_health(nodes: list[Node], hours: float, every_s: float) -> None:
    now = timezone.now()
    rows = []
    n = int(hours * 3600 / every_s)
    for k, node in enumerate(nodes):
        for i in range(n):
            t = now - timedelta(seconds=every_s * (n - i))
            phase = i / n * 6 * math.pi + k
            gpus = [
                {"index": g, "util_percent": 50 + 40 * math.sin(phase + g), "mem_used_mb": 4000 + 1000 * g + 500 * k,
                 "mem_total_mb": 8192, "temp_c": 55 + 10 * math.sin(phase), "power_w": 120 + 30 * math.sin(phase)}
                for g in range(2)
            ]  # fmt: skip
            rows.append(HealthSample(node=node, time=t, cpu_percent=30 + 20 * math.sin(phase),
                                     ram_percent=40 + 5 * k, gpus=gpus, score=95))  # fmt: skip
    HealthSample.objects.bulk_create(rows, batch_size=5000)


def loss(rank: int, step: int) -> float:
    return 3.0 * math.exp(-step / 80) + 0.3 + 0.15 * math.sin(step * 1.7 + rank) + 0.02 * rank


CURVES = {
    "loss": (loss, None),
    "lr": (lambda r, s: 0.003 * (1 - s / 250), None),
    "train/grad_norm": (lambda r, s: 1.5 + math.cos(s / 9), None),
    "eval/accuracy": (lambda r, s: 0.5 + s / 500, [50, 100, 150, 200]),
    "eval/loss": (lambda r, s: 1.25, [200]),  # one point only: must still be visible
}


def ready(page, selector: str, errors: list[str]) -> None:
    """Wait for a panel box to say it is drawn; on a timeout, say what the page logged."""
    try:
        page.wait_for_selector(selector, state="attached", timeout=30_000)
    except Exception as exc:
        raise AssertionError(f"{selector} never ready; page errors: {errors}") from exc


def open_job_page(chromium, web: str, job: Job):  # noqa: F811
    """A logged-in tab on the job's page once every panel is drawn, and the list its page errors go to."""
    errors: list[str] = []
    page = new_page(chromium, errors)
    log_in(page, web)
    page.goto(f"{web}/jobs/{job.pk}/")
    ready(page, "#panels[data-ready]", errors)
    return page, errors


def panel_order(page) -> list[str]:
    return page.eval_on_selector_all("#panels .panel", "ps => ps.map(p => p.dataset.name)")


def test_job_page_panels_smoothing_log_hover_csv_png_and_url_state(web, chromium, tmp_path):  # noqa: F811
    """Covers: the job page's panels in Chromium (groups, smoothing, log scale, synced hover, CSV and PNG downloads,
    state in the URL): JavaScript only a browser runs, on data written to the DB.
    """
    nodes = list(Node.objects.order_by("name"))[:3]
    job = ran_job("curves", nodes)
    Rank.objects.filter(job=job).update(gpu_indices=[0, 1])  # each held both GPUs of its node
    add_curves(job, 3, 200, CURVES)
    add_health(nodes, hours=0.25, every_s=10)
    page, errors = open_job_page(chromium, web, job)

    # every panel's series came in one answer, fetched once: the page's preload is what the first load used
    resources = "performance.getEntriesByType('resource').map(e => e.name)"
    fetched = [url for url in page.evaluate(resources) if "/series" in url or "/panels" in url]
    assert len(fetched) == 1 and "/panels?" in fetched[0], fetched

    # a panel per metric, grouped by prefix: the loss group first, loss first in it
    assert panel_order(page) == ["loss", "lr", "eval/loss", "eval/accuracy", "train/grad_norm"]
    groups = page.eval_on_selector_all("#panels .panel-group", "gs => gs.map(g => g.dataset.group)")
    assert groups == ["", "eval", "train"]
    # rank 0 only by default; a single point is drawn (a marker, not an invisible zero-length line)
    assert page.get_attribute('.panel[data-name="loss"] .panel-chart', "data-keys") == "0"
    assert page.evaluate(INK, ["eval/loss", list(BLUE)]) > 10
    page.screenshot(path=tmp_path / "job.png")

    # smoothing: the drawn line changes, the raw line stays behind it
    before = page.evaluate(CANVAS_HASH, "loss")
    page.eval_on_selector("#smoothing", "s => { s.value = '0'; s.dispatchEvent(new Event('input')); }")
    wait_for(lambda: page.evaluate(CANVAS_HASH, "loss") != before, timeout=5, what="the unsmoothed redraw")
    assert page.evaluate("UGRO.jobBoard.panels.get('loss').plot.series.length") == 2  # x + the raw line
    page.eval_on_selector("#smoothing", "s => { s.value = '0.95'; s.dispatchEvent(new Event('input')); }")
    smoothed = page.evaluate(
        "(() => { const u = UGRO.jobBoard.panels.get('loss').plot; return [u.series[1].label, u.series[2].label,"
        " u.data[1][150], u.data[2][150]]; })()"
    )
    assert smoothed[:2] == ["rank 0 raw", "rank 0"] and abs(smoothed[2] - smoothed[3]) > 1e-3

    # TensorBoard's formula: EMA debiased by 1 - w^n; a non-finite value passes through and feeds nothing
    got = page.evaluate("UGRO.smooth([1, 2, NaN, 3], 0.5)")
    assert got[:2] == [1, pytest.approx(5 / 3)] and math.isnan(got[2]) and got[3] == pytest.approx(17 / 7)

    # log y
    page.check("#log-y")
    assert page.evaluate("UGRO.jobBoard.panels.get('loss').plot.scales.y.distr") == 3

    # hover: every line's value at that x in the legend, and the crosshair follows in the other panels
    page.check("#all-ranks")
    wait_for(lambda: page.get_attribute('.panel[data-name="loss"] .panel-chart', "data-keys") == "0,1,2", timeout=5)
    over = page.locator('.panel[data-name="loss"] .u-over')
    box = over.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
    values = page.locator('.panel[data-name="loss"] .u-legend .u-series .u-value').all_text_contents()
    assert len(values) == 7 and all(v not in ("", "--") for v in values), values  # x + 3 ranks x (raw, smoothed)
    lr_cursor = page.eval_on_selector('.panel[data-name="lr"] .u-cursor-x', "c => c.style.transform || c.style.left")
    assert lr_cursor and "-10px" not in lr_cursor
    page.screenshot(path=tmp_path / "job-hover.png")

    # drag to zoom in on x, double-click to go back
    x_range = "(() => { const s = UGRO.jobBoard.panels.get('loss').plot.scales.x; return [s.min, s.max]; })()"
    full = page.evaluate(x_range)
    page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.5)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] * 0.5, steps=5)
    page.mouse.up()
    zoomed = page.evaluate(x_range)
    assert full[0] < zoomed[0] < zoomed[1] < full[1], (full, zoomed)
    page.mouse.dblclick(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
    assert page.evaluate(x_range) == full

    # CSV: every point of every rank; PNG: an image
    with page.expect_download() as dl:
        page.click('.panel[data-name="loss"] .panel-csv')
    csv = Path(dl.value.path()).read_text().splitlines()
    assert dl.value.suggested_filename == "curves_loss.csv"
    assert csv[0] == "rank,step,time,value" and len(csv) == 1 + 3 * 200
    first = csv[1].split(",")
    assert first[:2] == ["0", "1"] and float(first[3]) == pytest.approx(loss(0, 1))
    with page.expect_download() as dl:
        page.click('.panel[data-name="eval/accuracy"] .panel-png')
    assert dl.value.suggested_filename == "curves_eval_accuracy.png"
    assert Path(dl.value.path()).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a folded group is not drawn while folded, and is drawn at its full width when unfolded
    page.click('.panel-group[data-group="train"] .group-toggle')
    assert page.is_hidden('.panel[data-name="train/grad_norm"]')
    wait_for(lambda: "fold=train" in page.evaluate("location.href"), timeout=5, what="the fold in the URL")
    page.click('.panel-group[data-group="train"] .group-toggle')
    width = page.eval_on_selector('.panel[data-name="train/grad_norm"] canvas', "c => c.getBoundingClientRect().width")
    assert width > 400

    # a panel collapsed, a search, the relative time axis: all in the URL, all back after a reload
    page.click('.panel[data-name="lr"] .panel-toggle')
    page.select_option("#x-axis", "relative")
    page.fill("#panel-search", "loss")
    assert not errors, errors
    wait_for(lambda: "q=loss" in page.evaluate("location.href"), timeout=5, what="the search in the URL")
    for part in ("smooth=0.95", "log=1", "ranks=all", "hide=lr", "x=relative"):
        assert part in page.evaluate("location.href"), page.evaluate("location.href")
    page.reload()
    ready(page, "#panels[data-ready]", errors)
    assert page.input_value("#smoothing") == "0.95" and page.is_checked("#log-y") and page.is_checked("#all-ranks")
    assert page.input_value("#x-axis") == "relative" and page.input_value("#panel-search") == "loss"
    visible = page.eval_on_selector_all("#panels .panel:not([hidden])", "ps => ps.map(p => p.dataset.name)")
    assert visible == ["loss", "eval/loss"]
    assert page.evaluate("UGRO.jobBoard.panels.get('lr').collapsed") is True
    assert page.evaluate("UGRO.jobBoard.panels.get('loss').plot.axes[0].values !== undefined")

    # system metrics beside the loss: the job's span, its nodes' GPUs, CPU and RAM
    ready(page, "#system-panels[data-ready]", errors)
    names = page.eval_on_selector_all("#system-panels .panel", "ps => ps.map(p => p.dataset.name)")
    assert names == ["gpu_util", "gpu_mem", "gpu_temp", "gpu_power", "cpu", "ram"]
    lines = page.evaluate("Array.from(UGRO.systemPanels.get('gpu_util').lines.keys()).sort()")
    assert lines == [f"{n.name} GPU {g}" for n in nodes for g in (0, 1)]
    # its energy beside the elapsed time, as the system series said it (docs/power.md)
    used = job_energy(job)
    assert used.wh and page.text_content("#job-energy") == used.text()
    assert page.get_attribute("#job-energy", "title") == used.detail()
    page.goto(f"{web}/jobs/{job.pk}/")
    ready(page, "#system-panels[data-ready]", errors)
    # the page down to its system metrics (the logs of this job are empty)
    bottom = page.evaluate("document.getElementById('system').getBoundingClientRect().bottom + scrollY + 16")
    clip = {"x": 0, "y": 0, "width": 1440, "height": bottom}
    page.screenshot(path=tmp_path / "job-full.png", full_page=True, clip=clip)
    keep_shots(tmp_path, "job-full.png", "job-hover.png")
    assert not errors, errors


def test_a_long_run_draws_rank_0_from_one_request_and_loads_the_other_ranks_when_asked(web, chromium):  # noqa: F811
    """Covers: what the browser asks for on a 36,000-point run: rank 0 in one request, the other ranks only when asked
    (the page's own requests, read from its resource timing).
    """
    nodes = list(Node.objects.order_by("name"))[:3]
    job = ran_job("long-run", nodes)
    # 3 ranks x 12,000 steps, stored as the follower stores them and folded: the charts read the rollup
    start = job.running_at
    rows = [Sample(job.pk, r, s, "loss", loss(r, s), start + timedelta(milliseconds=s), 1)
            for s in range(12_000) for r in range(3)]  # fmt: skip
    with transaction.atomic():
        save_points(rows)
    rollup.catch_up(job.pk)
    page, errors = open_job_page(chromium, web, job)
    asked = "performance.getEntriesByType('resource').map(e => e.name).filter(u => u.includes('/panels?'))"
    first = page.evaluate(asked)
    assert len(first) == 1 and "ranks=first" in first[0], first
    assert page.evaluate("Array.from(UGRO.jobBoard.panels.get('loss').lines.keys())") == ["0"]
    assert page.get_attribute('.panel[data-name="loss"] .panel-chart', "data-keys") == "0"

    # the CSV holds every rank's line: the panel loads them first
    with page.expect_download() as dl:
        page.click('.panel[data-name="loss"] .panel-csv')
    ranks = {line.split(",")[0] for line in Path(dl.value.path()).read_text().splitlines()[1:]}
    assert ranks == {"0", "1", "2"}

    # every rank shown: asked for once more, whole
    page.reload()
    ready(page, "#panels[data-ready]", errors)
    page.check("#all-ranks")
    wait_for(lambda: page.get_attribute('.panel[data-name="loss"] .panel-chart', "data-keys") == "0,1,2", timeout=5)
    again = page.evaluate(asked)
    assert len(again) == 2 and "ranks=first" not in again[1], again
    assert not errors, errors


def test_live_page_drops_the_queued_banner_appends_points_and_shows_results_at_the_end(web, chromium):  # noqa: F811
    """Covers: the job page's live events in the browser: the queued banner dropped, points appended and results shown
    at the end with no reload (events sent on the channel layer as the follower sends them).
    """
    errors: list[str] = []
    page = new_page(chromium, errors)
    log_in(page, web)
    # given a job launched from the form (no worker here: it stays queued until this test moves it)
    page.goto(web + "/jobs/launch/")
    page.fill("#id_name", "live-page")
    page.fill("#id_count", "1")
    page.click("#launch-form button[type=submit]")
    page.wait_for_url(f"{web}/jobs/*/")
    job = Job.objects.get(name="live-page")
    page.locator('.msg[data-tag="queued"]').wait_for(timeout=10_000)
    page.wait_for_selector("#live-dot.on", timeout=10_000)
    page.evaluate("window.__sameDocument = true")

    # when it starts, the queued banner goes
    node = Node.objects.order_by("name").first()
    now = timezone.now()
    Rank.objects.create(job=job, node=node, index=0, state=Rank.State.RUNNING)
    update_jobs(Job.objects.filter(pk=job.pk), state=Job.State.RUNNING, started_at=now, running_at=now)
    send_job_event(job, "state", {"state": "running"})
    page.locator('.msg[data-tag="queued"]').wait_for(state="detached", timeout=10_000)
    page.wait_for_selector("#job-state.badge-running", timeout=10_000)

    # live points: a new panel with a single visible point, then more points appended to it
    send_job_event(job, "points", {"points": [[0, 1, "loss", 2.0]]})
    page.wait_for_selector('.panel[data-name="loss"] canvas', timeout=10_000)
    wait_for(lambda: page.evaluate(INK, ["loss", list(BLUE)]) > 10, timeout=5, what="the single point drawn")
    plot_id = page.evaluate(
        "(() => { const u = UGRO.jobBoard.panels.get('loss').plot; u.__id = 'first'; return 1; })()"
    )
    for step in range(2, 12):
        MetricPoint.objects.create(job=job, rank=0, step=step, name="loss", value=2.0 / step, time=timezone.now())
    send_job_event(job, "points", {"points": [[0, s, "loss", 2.0 / s] for s in range(2, 12)]})
    wait_for(lambda: page.evaluate("UGRO.jobBoard.panels.get('loss').plot.data[0].length") == 11, timeout=5,
             what="the appended points")  # fmt: skip
    # appended to the same plot (no rebuild, no refetch), and the page was never reloaded
    assert plot_id == 1 and page.evaluate("UGRO.jobBoard.panels.get('loss').plot.__id") == "first"
    assert page.evaluate("window.__sameDocument") is True

    # points whose events the follower could not send come with the resync it sends next: the page reloads
    # its curves from the database (a new panel here), still without reloading the page
    for step in (1, 2, 3):
        MetricPoint.objects.create(job=job, rank=0, step=step, name="lr", value=0.1 * step, time=timezone.now())
    send_job_event(job, "resync", {})
    wait_for(lambda: page.evaluate("UGRO.jobBoard.panels.get('lr')?.lines.get('0')?.x.length") == 3, timeout=10,
             what="the missed points reloaded")  # fmt: skip
    assert page.evaluate("window.__sameDocument") is True

    # when it ends: results and checkpoints appear, progress reads 100 %, without a reload
    MetricPoint.objects.create(job=job, rank=0, step=1, name="loss", value=2.0, time=timezone.now())
    Checkpoint.objects.create(job=job, node=node, path="/data/out/checkpoint_step11.pt", size=12_000_000, mtime=0)
    Rank.objects.filter(job=job).update(state=Rank.State.EXITED, exit_code=0, active=False)
    update_jobs(Job.objects.filter(pk=job.pk), state=Job.State.SUCCEEDED, finished_at=timezone.now())
    send_job_event(job, "state", {"state": "succeeded"})
    page.locator("#final-loss", has_text="Final loss 0.181818 at step 11").wait_for(timeout=10_000)
    page.locator("#checkpoints", has_text="checkpoint_step11.pt").wait_for(timeout=10_000)
    assert "100.0%" in page.text_content('[data-region="summary"]')
    assert page.evaluate("window.__sameDocument") is True
    assert not errors, errors


def test_node_page_shows_24h_of_gpu_cpu_and_ram_and_compare_diffs_configs(web, chromium, tmp_path):  # noqa: F811
    """Covers: the node page's 24 h GPU, CPU and RAM charts and compare's config diff as Chromium draws them."""
    nodes = list(Node.objects.order_by("name"))[:3]
    add_health(nodes[:1], hours=24, every_s=120)
    errors: list[str] = []
    page = new_page(chromium, errors)
    log_in(page, web)
    page.goto(f"{web}/")
    page.click(f'.node-card[data-node="{nodes[0].name}"] .node-name a')
    ready(page, "#system-panels[data-ready]", errors)
    names = page.eval_on_selector_all("#system-panels .panel", "ps => ps.map(p => p.dataset.name)")
    assert names == ["gpu_util", "gpu_mem", "gpu_temp", "gpu_power", "cpu", "ram"]
    span = page.evaluate("(() => { const t = UGRO.systemPanels.get('cpu').lines.get('node1').t;"
                         " return [t.length, t[t.length - 1] - t[0]]; })()")  # fmt: skip
    assert 100 <= span[0] <= 400 and span[1] > 23 * 3600  # downsampled, and the whole day
    page.screenshot(path=tmp_path / "node.png", full_page=True)

    # compare: two runs that differ in lr and nodes
    a = ran_job("cmp-a", nodes[:1], params={"lr": 0.001, "epochs": 1, "model": "tiny"}, script_args=["--lr", "0.001"])
    b = ran_job("cmp-b", nodes[:2], params={"lr": 0.003, "epochs": 1, "model": "tiny"}, script_args=["--lr", "0.003"])
    add_curves(a, 1, 100, {"loss": (loss, None), "eval/accuracy": (lambda r, s: 0.4 + s / 400, [50, 100])})
    better = {"loss": (lambda r, s: loss(r, s) * 0.8, None), "eval/accuracy": (lambda r, s: 0.5 + s / 400, [50, 100])}
    add_curves(b, 2, 100, better)
    page.goto(f"{web}/compare/?job={a.pk}&job={b.pk}&metric=eval/accuracy")
    ready(page, "#compare-chart[data-ready] canvas", errors)
    assert page.input_value("#compare-metric") == "eval/accuracy"
    labels = page.evaluate("UGRO.comparePanel.plot.series.slice(1).map(s => s.label)")
    assert labels == ["cmp-a raw", "cmp-a", "cmp-b raw", "cmp-b"]
    # the config diff marks what differs and not what is the same
    rows = page.eval_on_selector_all(
        "#config-diff tr.differs", "rs => rs.map(r => Array.from(r.cells, c => c.textContent.trim()).join('\\t'))"
    )
    diff = {r.split("\t")[0]: r for r in rows}
    assert set(diff) >= {"lr", "nodes", "args"} and "model" not in diff and "epochs" not in diff
    assert "node1, node2" in diff["nodes"]
    # final / best of the chosen metric, per job
    final = page.eval_on_selector_all("#metric-summary tbody tr", "rs => rs.map(r => r.textContent)")
    assert "0.65" in final[0] and "0.75" in final[1]
    page.select_option("#compare-metric", "loss")
    wait_for(lambda: "metric=loss" in page.evaluate("location.href"), timeout=10, what="the metric in the URL")
    ready(page, "#compare-chart[data-ready] canvas", errors)
    page.locator('[data-region="metric-summary"] h2', has_text="loss").wait_for(timeout=10_000)
    page.screenshot(path=tmp_path / "compare.png", full_page=True)
    keep_shots(tmp_path, "node.png", "compare.png")
    assert not errors, errors


def keep_shots(tmp_path: Path, *names: str) -> None:
    """Leave the screenshots where docs/img's are copied from by hand (test-artifacts/ is not in git)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(tmp_path / name, SHOTS / name)


def test_values_with_no_step_are_drawn_by_time_until_the_frameworks_file_gives_their_steps(web, chromium):  # noqa: F811
    """Covers: a panel in the browser drawing step-less values by time, then by step once the framework's file gives
    them: the chart code's switch, which only a browser runs.
    """
    # given a running Lightning job whose bar showed train_loss three times (no step: the bar counts batches)
    node = Node.objects.order_by("name").first()
    job = ran_job("bar-only", [node], minutes=2, state=Job.State.RUNNING, finished_at=None)
    Rank.objects.filter(job=job).update(state=Rank.State.RUNNING, active=True, exit_code=None)
    start = job.running_at
    for i, value in enumerate([2.3, 1.1, 0.7]):
        MetricPoint.objects.create(job=job, rank=0, step=None, name="train_loss", value=value,
                                   time=start + timedelta(seconds=10 * (i + 1)))  # fmt: skip
    # when its page opens (showing steps, the default)
    page, errors = open_job_page(chromium, web, job)
    # then the panel draws them by time: three points, on a time axis
    panel = "UGRO.jobBoard.panels.get('train_loss')"
    wait_for(lambda: page.evaluate(INK, ["train_loss", list(BLUE)]) > 10, timeout=10, what="the points drawn")
    assert page.evaluate(f"[{panel}.byTime, {panel}.xMode(), {panel}.plot.data[0].length]") == [True, "wall", 3]
    # and a live value with no step is appended by its time
    send_job_event(job, "points", {"points": [[0, None, "train_loss", 0.5]]})
    wait_for(lambda: page.evaluate(f"{panel}.plot.data[0].length") == 4, timeout=10, what="the live point")
    # when the framework's file is found: its values at their steps replace the bar's
    MetricPoint.objects.filter(job=job, step__isnull=True).delete()
    for step, value in [(4, 2.31), (9, 1.05)]:
        MetricPoint.objects.create(job=job, rank=0, step=step, name="train_loss", value=value, time=timezone.now())
    send_job_event(job, "points", {"points": [[0, 9, "train_loss", 1.05]]})
    # then the panel shows steps again, reloaded from the database
    wait_for(lambda: page.evaluate(f"[{panel}.byTime, {panel}.xMode(), {panel}.lines.get('0').x]")
             == [False, "step", [4, 9]], timeout=10, what="the file's steps")  # fmt: skip
    assert not errors, errors
