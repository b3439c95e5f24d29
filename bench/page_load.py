#!/usr/bin/env python
"""Opening a job with 1,000,000 loss points in Chromium: UGRO's job page vs TensorBoard's scalars.

    .venv/bin/python bench/page_load.py [--ranks 2] [--steps 500000] [--repeat 5] [--tb-venv /tmp/tbvenv]
                                        [--skip-tb] [--tb-python-loader] [--label L] [--keep]
    .venv/bin/python bench/page_load.py --panels 10 --ranks 3 --steps 100000 --tb-venv .venv [--repeat 5] [--also-raw]

With --panels N (issue 13): N metrics ("loss", "train/...", "eval/...") x ranks x steps points, the job
page drawing a panel per metric; timed until every panel has its canvas and #panels says ready (set by
static/js/job.js once every panel's series is drawn: one /panels answer, rank 0's lines, the page's default
view), and again with ?ranks=all (every rank's line); the points' rollup (metrics/rollup.py) is rebuilt after
the insert, as ingestion would have kept it; --also-raw then deletes it and times the page again (every answer
grouping its metric's raw points, as before the rollup). TensorBoard gets the same N tags per run; its
sample ends when every run's line of every tag is drawn (2 SVG paths per run and tag), or, when its
lazy card loading never draws them all, is reported with how many were drawn after 60 s. Memory: the
page's JS heap (CDP Performance.getMetrics, JSHeapUsedSize) once drawn, and the PSS of every Chromium
process of this run with only that tab open. Results go under "panels" in page_load.json (the 1M-point
figures stay).

UGRO: a SUCCEEDED job whose MetricPoints are inserted straight into PostgreSQL (one INSERT ...
SELECT over generate_series: ranks x steps points named "loss", value
2 exp(-s/150000) + 0.1 sin(0.37 s + 1.3 r), plus a spike of +1.5 at every step = 777 mod 50000),
then ANALYZE; a real daphne serves it. Chromium (Debian's, driven by Playwright) logs in through the
login form, opens /jobs/<id>/ once to warm the cache, then `--repeat` times in a fresh tab; each
sample is the time from navigation start (performance.timeOrigin) until, polled every animation
frame, the uPlot canvas exists and #chart-info says "... points shown (downsampled from N)" --
set by static/js/job.js right after the series JSON (/api/jobs/<id>/series) is drawn. The series
endpoint alone is also timed (urllib with the session cookie, same bucket count as the page asks).

TensorBoard (the PyPI package, in its own venv): the same values written with tensorboard's own
EventFileWriter (one run per rank, tag "loss", simple_value), `tensorboard --logdir D --host
127.0.0.1 --port P` (the default loader, i.e. the Rust data server when present). Ingestion is timed
from the launch until /data/plugin/scalars/tags lists every run and then until every run's
/data/plugin/scalars/scalars answer reaches the last step. Then, in the same Chromium, `#scalars` is
opened (warm-up + `--repeat`), each sample from navigation start until every run's line is drawn
(two SVG `path.line` per run, smoothed and raw, with a non-trivial `d`, found through shadow roots).
Spikes: how many of the injected spikes show in what each side sends to the browser.

Results: bench/results/page_load.json (overwritten) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _dash_common import (  # noqa: E402
    CHROMIUM,
    CHROMIUM_ARGS,
    RESULTS,
    cleanup,
    free_port,
    machine_info,
    make_tmp,
    setup,
    start,
    start_daphne,
    stop,
    wait_for,
    write_json,
)

SPIKE_EVERY, SPIKE_AT, SPIKE = 50000, 777, 1.5
VIEWPORT = {"width": 1440, "height": 1000}

UGRO_DRAWN = """() => {
  const canvas = document.querySelector('#panels .panel canvas');
  const info = document.getElementById('chart-info');
  if (canvas && info && info.textContent.includes('points shown')) {
    if (!window.__drawnAt) window.__drawnAt = performance.now();
    return true;
  }
  return false;
}"""

TB_DRAWN = """(runs) => {
  let long = 0;
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.shadowRoot) walk(el.shadowRoot);
      if (el.tagName === 'path' && (el.getAttribute('class') || '').split(' ').includes('line')
          && (el.getAttribute('d') || '').length > 500) long++;
    }
  };
  walk(document);
  if (long >= 2 * runs) {
    if (!window.__drawnAt) window.__drawnAt = performance.now();
    return true;
  }
  return false;
}"""

TB_WRITER = r"""
import math, sys, time
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter
logdir, rank, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tags = sys.argv[4].split(",") if len(sys.argv) > 4 else ["loss"]
w = EventFileWriter(logdir, max_queue_size=10000, flush_secs=5)
t0 = time.time()
for s in range(steps):
    values = []
    for k, tag in enumerate(tags):
        v = 2.0 * math.exp(-s / 150000.0) + 0.1 * math.sin(s * 0.37 + rank * 1.3 + k)
        v += 1.5 if s % 50000 == 777 else 0.0
        values.append(Summary.Value(tag=tag, simple_value=v))
    w.add_event(Event(wall_time=t0 + s * 0.001, step=s, summary=Summary(value=values)))
w.close()
"""

PANEL_NAMES = ["loss", "lr", "grad_norm", "tokens_per_sec", "train/loss_scale", "train/weight_norm",
               "eval/loss", "eval/accuracy", "eval/perplexity", "system/throughput"]  # fmt: skip

UGRO_PANELS_DRAWN = """(n) => {
  const box = document.getElementById('panels');
  if (box && box.dataset.ready && box.querySelectorAll('.panel canvas').length >= n) {
    if (!window.__drawnAt) window.__drawnAt = performance.now();
    return true;
  }
  return false;
}"""

TB_CARDS = """() => {
  let n = 0;
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.shadowRoot) walk(el.shadowRoot);
      if (el.tagName.toLowerCase() === 'tf-scalar-card') n++;
    }
  };
  walk(document);
  return n;
}"""

TB_LINES_DRAWN = """() => {
  let long = 0;
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.shadowRoot) walk(el.shadowRoot);
      if (el.tagName === 'path' && (el.getAttribute('class') || '').split(' ').includes('line')
          && (el.getAttribute('d') || '').length > 500) long++;
    }
  };
  walk(document);
  return long;
}"""


def spikes_expected(ranks: int, steps: int) -> int:
    return ranks * len(range(SPIKE_AT, steps, SPIKE_EVERY))


def spikes_seen(per_rank: list[list[tuple[float, float]]], steps: int, window: int) -> int:
    """Injected spikes (per rank) that show in what was sent: a point within `window` steps of the
    spike, at least 0.75 above the curve's ceiling there (the spike is +1.5; the noise +-0.1)."""
    seen = 0
    for points in per_rank:
        for s in range(SPIKE_AT, steps, SPIKE_EVERY):
            ceiling = 2.0 * math.exp(-s / 150000.0) + 0.1
            seen += any(abs(x - s) <= window and y > ceiling + 0.75 for x, y in points)
    return seen


def insert_points(job_id: int, ranks: int, steps: int, names: list[str] | None = None) -> float:
    from django.db import connection

    from metrics.models import MetricPoint

    table = MetricPoint._meta.db_table
    t0 = time.monotonic()
    with connection.cursor() as cur:
        for k, name in enumerate(names or ["loss"]):
            cur.execute(
                f"INSERT INTO {table} (job_id, rank, step, name, value, time) "
                "SELECT %s, r, s, %s, 2.0 * exp(-s / 150000.0) + 0.1 * sin(s * 0.37 + r * 1.3 + %s) "
                "  + CASE WHEN s %% %s = %s THEN %s ELSE 0 END, now() - (%s - s) * interval '1 millisecond' "
                "FROM generate_series(0, %s) r, generate_series(0, %s) s",
                [job_id, name, k, SPIKE_EVERY, SPIKE_AT, SPIKE, steps, ranks - 1, steps - 1],
            )
        # as autovacuum leaves a table some time after a bulk insert
        cur.execute(f"VACUUM ANALYZE {table}")
    return time.monotonic() - t0


def new_page(context, errors: list[str]):
    page = context.new_page()
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    return page


def logged_in_context(browser, base: str, errors: list[str]):
    """A fresh browser context logged in as the bench user (a fresh one: nothing cached)."""
    context = browser.new_context(viewport=VIEWPORT)
    login = new_page(context, errors)
    login.goto(base + "/accounts/login/")
    login.fill("#id_username", "bench")
    login.fill("#id_password", "bench-pw-123")
    login.click("button[type=submit]")
    login.wait_for_url(base + "/")
    login.close()
    return context


def time_page(context, url: str, predicate: str, arg, errors: list[str]) -> dict:
    page = new_page(context, errors)
    series_timing = {}

    def on_response(response):
        if "/series" in response.url or "scalars_multirun" in response.url or "/scalars?" in response.url:
            series_timing.setdefault("url", response.url)
            series_timing.setdefault("response", response)

    page.on("response", on_response)
    t0 = time.monotonic()
    page.goto(url, wait_until="commit")
    page.wait_for_function(predicate, arg=arg, polling="raf", timeout=60_000)
    wall = time.monotonic() - t0
    drawn_ms = page.evaluate("window.__drawnAt")
    out = {"drawn_ms_from_navigation_start": round(drawn_ms, 1), "python_wall_ms": round(wall * 1000, 1)}
    if "response" in series_timing:
        resp = series_timing["response"]
        try:
            resp.finished()
            timing = resp.request.timing
            out["data_request_ms"] = {k: round(timing[k], 1) for k in ("requestStart", "responseStart", "responseEnd")}
            out["data_request_started_ms"] = round(timing["startTime"] - page.evaluate("performance.timeOrigin"), 1)
            out["data_bytes"] = len(resp.body())
        except Exception as exc:  # timing is best effort
            out["data_request_error"] = str(exc)
    page.close()
    return out


def chromium_pss_mb() -> float:
    """PSS of every Chromium process this run started (descendants of this process), in MB."""
    import os

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total_kb, todo = 0, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            if "chromium" not in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace"):
                continue
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kb += int(line.split()[1])
        except OSError:
            continue
    return round(total_kb / 1024, 1)


def page_memory(context, url: str, predicate: str, arg) -> dict:
    """JS heap of the drawn page and PSS of the browser's processes with only this tab open."""
    page = context.new_page()
    page.goto(url)
    if predicate:
        page.wait_for_function(predicate, arg=arg, polling="raf", timeout=90_000)
    page.wait_for_timeout(1000)
    cdp = context.new_cdp_session(page)
    cdp.send("Performance.enable")
    metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    out = {
        "js_heap_used_mb": round(metrics.get("JSHeapUsedSize", 0) / 2**20, 1),
        "js_heap_total_mb": round(metrics.get("JSHeapTotalSize", 0) / 2**20, 1),
        "dom_nodes": int(metrics.get("Nodes", 0)),
        "chromium_pss_mb": chromium_pss_mb(),
    }
    cdp.detach()
    return page, out


def main_panels(args) -> None:
    """--panels N: a panel per metric (issue 13), UGRO's job page beside TensorBoard's scalars."""
    names = PANEL_NAMES[: args.panels]
    if len(names) < args.panels:
        names += [f"extra/metric_{i}" for i in range(args.panels - len(names))]
    total = len(names) * args.ranks * args.steps
    tmp = make_tmp("ugro-bench-panels-")
    procs: list = []
    result: dict = {}
    t_bench = time.monotonic()
    try:
        env = setup(tmp)
        result["machine"] = info = machine_info()
        from django.contrib.auth.models import User
        from django.utils import timezone

        from jobs.models import Job

        now = timezone.now()
        job = Job.objects.create(name="ten-panels", script="train/train_production.py", state=Job.State.SUCCEEDED,
                                 started_at=now, running_at=now, finished_at=now)  # fmt: skip
        insert_s = insert_points(job.pk, args.ranks, args.steps, names)
        print(f"inserted {total:,} points ({len(names)} metrics) in {insert_s:.1f} s")
        # the points went around ingestion (one INSERT ... SELECT): build the rollup ingestion would have kept
        from metrics import rollup

        t_rollup = time.monotonic()
        rollup.rebuild(job.pk)
        rollup_s = time.monotonic() - t_rollup
        print(f"rollup rebuilt in {rollup_s:.1f} s")
        User.objects.create_user("bench", password="bench-pw-123")
        daphne, base = start_daphne(env, tmp)
        procs.append(daphne)
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            info["chromium"] = browser.version
            errors: list[str] = []
            context = logged_in_context(browser, base, errors)
            url = f"{base}/jobs/{job.pk}/"
            warm = time_page(context, url, UGRO_PANELS_DRAWN, len(names), errors)
            samples = [time_page(context, url, UGRO_PANELS_DRAWN, len(names), errors) for _ in range(args.repeat)]
            page, memory = page_memory(context, url, UGRO_PANELS_DRAWN, len(names))
            drawn = page.eval_on_selector_all("#panels .panel canvas", "cs => cs.length")
            # where the time of one load went: the HTML, each script, each series answer, all drawn
            timeline = page.evaluate(
                """() => ({
                  html_response_end_ms: performance.getEntriesByType('navigation')[0].responseEnd,
                  dom_content_loaded_ms: performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd,
                  scripts_end_ms: Math.max(...performance.getEntriesByType('resource')
                    .filter(e => e.name.endsWith('.js')).map(e => e.responseEnd)),
                  series_start_ms: performance.getEntriesByType('resource')
                    .filter(e => /[/](series|panels)[?]/.test(e.name)).map(e => Math.round(e.startTime)),
                  series_end_ms: performance.getEntriesByType('resource')
                    .filter(e => /[/](series|panels)[?]/.test(e.name)).map(e => Math.round(e.responseEnd)),
                  all_drawn_ms: window.__ugroPanelsDrawnAt,
                })"""
            )
            info_text = page.text_content("#chart-info")
            page.screenshot(path=str(tmp / "ugro-panels.png"), full_page=True)
            page.close()
            context.close()
            result["ugro"] = {
                "points": total,
                "metrics": names,
                "insert_s": round(insert_s, 2),
                "rollup_rebuild_s": round(rollup_s, 2),
                "warmup": warm,
                "samples": samples,
                "median_drawn_ms": statistics.median(s["drawn_ms_from_navigation_start"] for s in samples),
                "panels_drawn": drawn,
                "timeline_of_one_load": timeline,
                "chart_info": info_text,
                "memory": memory,
                "errors": errors[:20],
            }
            print("UGRO:", json.dumps({k: v for k, v in result["ugro"].items() if k not in ("samples", "warmup")}))
            # the page shows rank 0 by default (and loads only it); TensorBoard draws every run: the view
            # with every rank's line too, in the same run
            context = logged_in_context(browser, base, errors)
            time_page(context, url + "?ranks=all", UGRO_PANELS_DRAWN, len(names), errors)
            every = [time_page(context, url + "?ranks=all", UGRO_PANELS_DRAWN, len(names), errors)
                     for _ in range(args.repeat)]  # fmt: skip
            context.close()
            result["ugro_all_ranks"] = {
                "samples": every,
                "median_drawn_ms": statistics.median(s["drawn_ms_from_navigation_start"] for s in every),
            }
            print("UGRO, every rank drawn (?ranks=all):", result["ugro_all_ranks"]["median_drawn_ms"], "ms")
            if args.also_raw:
                # the same page with the rollup gone: every answer groups its metric's raw points (the path
                # before the rollup), timed in the same run
                from concurrent.futures import ThreadPoolExecutor

                from metrics.models import MetricRollup

                with ThreadPoolExecutor(1) as pool:  # Playwright's loop runs here: the ORM goes to a thread
                    pool.submit(lambda: MetricRollup.objects.filter(job=job).delete()).result()
                context = logged_in_context(browser, base, errors)
                time_page(context, url, UGRO_PANELS_DRAWN, len(names), errors)
                raw = [time_page(context, url, UGRO_PANELS_DRAWN, len(names), errors) for _ in range(args.repeat)]
                context.close()
                result["ugro_without_rollup"] = {
                    "samples": raw,
                    "median_drawn_ms": statistics.median(s["drawn_ms_from_navigation_start"] for s in raw),
                }
                print("UGRO without the rollup:", result["ugro_without_rollup"]["median_drawn_ms"], "ms")
            if not args.skip_tb:
                result["tensorboard"] = tensorboard_panels(args, tmp, browser, procs, names)
                print("TB:", json.dumps({k: v for k, v in result["tensorboard"].items() if k != "samples"}))
            browser.close()
        for name in ("ugro-panels.png", "tensorboard-panels.png"):
            if (tmp / name).exists():
                (tmp / name).replace(Path("/tmp") / f"bench-{name}")
    finally:
        cleanup(None, procs, tmp, args.keep)

    path = RESULTS / "page_load.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    result["method"] = __doc__.split("\n\n", 3)[2].strip()
    result["params"] = {"panels": len(names), "ranks": args.ranks, "steps": args.steps, "repeat": args.repeat,
                        "viewport": VIEWPORT}  # fmt: skip
    result["bench_wall_s"] = round(time.monotonic() - t_bench, 1)
    old.setdefault("panels_runs", {})[args.label] = result
    write_json(path, old)
    print("wrote", path, "under panels_runs." + args.label)


def tensorboard_panels(args, tmp: Path, browser, procs: list, tags: list[str]) -> dict:
    py = Path(args.tb_venv) / "bin" / "python"
    logdir = tmp / "tb"
    t0 = time.monotonic()
    writers = [
        subprocess.Popen([str(py), "-c", TB_WRITER, str(logdir / f"rank_{r}"), str(r), str(args.steps), ",".join(tags)])
        for r in range(args.ranks)
    ]
    for w in writers:
        if w.wait(timeout=1800) != 0:
            raise RuntimeError("the TensorBoard event writer failed")
    write_s = time.monotonic() - t0
    version = subprocess.run([str(py), "-c", "import tensorboard; print(tensorboard.__version__)"],
                             capture_output=True, text=True, timeout=60).stdout.strip()  # fmt: skip
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    t_launch = time.monotonic()
    tb_log = tmp / "tensorboard-panels.log"
    tb = start([str(Path(args.tb_venv) / "bin" / "tensorboard"), "--logdir", str(logdir), "--host", "127.0.0.1",
                "--port", str(port)], {"PATH": "/usr/bin:/bin", "HOME": str(tmp)}, tb_log)  # fmt: skip
    procs.append(tb)
    runs = [f"rank_{r}" for r in range(args.ranks)]

    def get(path: str):
        try:
            with urllib.request.urlopen(base + path, timeout=30) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def fully_loaded() -> bool:
        for run in runs:
            for tag in (tags[0], tags[-1]):
                data = get(f"/data/plugin/scalars/scalars?run={run}&tag={urllib.parse.quote(tag)}") or []
                if not data or data[-1][1] != args.steps - 1:
                    return False
        return True

    wait_for(lambda: get("/data/environment") is not None, 120, "tensorboard to answer", 0.1)
    wait_for(fully_loaded, 600, "tensorboard to load every step", 0.5)
    t_full = time.monotonic()
    want = 2 * len(runs) * len(tags)

    def sample(context) -> dict:
        """Until every line is drawn; or, as TensorBoard keeps some groups folded, until the count of drawn
        lines has not grown for 3 s: the time is then when it reached that count."""
        page = context.new_page()
        t = time.monotonic()
        page.goto(base + "/#scalars", wait_until="commit")
        deadline = time.monotonic() + 60
        drawn, reached = 0, None
        while time.monotonic() < deadline:
            now = page.evaluate(TB_LINES_DRAWN)
            if now > drawn:
                drawn, reached = now, time.monotonic()
            if drawn >= want or (drawn >= 2 * len(runs) and time.monotonic() - reached > 3):
                break
            page.wait_for_timeout(20)
        cards = page.evaluate(TB_CARDS)
        out = {"lines_drawn": drawn, "lines_wanted": want, "all_drawn": drawn >= want, "charts_drawn": drawn // 2,
               "tags_with_a_card_open": cards,
               "drawn_ms": round((reached - t) * 1000, 1) if reached else None}  # fmt: skip
        page.close()
        return out

    context = browser.new_context(viewport=VIEWPORT)
    warm = sample(context)
    samples = [sample(context) for _ in range(args.repeat)]
    page, memory = page_memory(context, base + "/#scalars", None, None)
    page.wait_for_timeout(3000)
    memory_after_3s = {"chromium_pss_mb": chromium_pss_mb()}
    page.screenshot(path=str(tmp / "tensorboard-panels.png"), full_page=True)
    page.close()
    context.close()
    stop(tb)
    done = [s["drawn_ms"] for s in samples if s["drawn_ms"] is not None]
    return {
        "version": version,
        "loader": "rust data server" if "fast data loading" in tb_log.read_text() else "python",
        "event_files_write_s": round(write_s, 1),
        "launch_to_all_steps_loaded_s": round(t_full - t_launch, 2),
        "warmup": warm,
        "samples": samples,
        "median_drawn_ms": statistics.median(done) if done else None,
        "all_lines_drawn_in_every_sample": all(s["all_drawn"] for s in samples),
        "memory": {**memory, **{"after_3s_" + k: v for k, v in memory_after_3s.items()}},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=500_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tb-venv", default="/tmp/tbvenv")
    ap.add_argument("--skip-tb", action="store_true")
    ap.add_argument("--also-raw", action="store_true", help="--panels: time the page again without the rollup")
    ap.add_argument(
        "--tb-python-loader",
        action="store_true",
        help="also time TensorBoard with --load_fast=false (its Python loader), same event files",
    )
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--label", default="current", help="key of this run's UGRO figures under ugro_runs (kept)")
    ap.add_argument("--note", default="")
    ap.add_argument("--panels", type=int, default=1, help="metrics on the page (issue 13: 10); >1 runs main_panels")
    args = ap.parse_args()
    if args.panels > 1:
        main_panels(args)
        return
    total = args.ranks * args.steps

    tmp = make_tmp("ugro-bench3-page-")
    procs: list = []
    result: dict = {}
    t_bench = time.monotonic()
    try:
        env = setup(tmp)
        result["machine"] = info = machine_info()
        from django.contrib.auth.models import User
        from django.test import Client
        from django.utils import timezone

        from jobs.models import Job

        now = timezone.now()
        job = Job.objects.create(name="million-points", script="train/train_production.py",
                                 state=Job.State.SUCCEEDED, started_at=now, running_at=now,
                                 finished_at=now)  # fmt: skip
        insert_s = insert_points(job.pk, args.ranks, args.steps)
        print(f"inserted {total:,} points in {insert_s:.1f} s")
        from metrics import rollup  # the points went around ingestion: the rollup it would have kept

        t_rollup = time.monotonic()
        rollup.rebuild(job.pk)
        rollup_s = time.monotonic() - t_rollup
        User.objects.create_user("bench", password="bench-pw-123")
        client = Client()
        client.login(username="bench", password="bench-pw-123")
        cookie = client.cookies["sessionid"].value
        daphne, base = start_daphne(env, tmp)
        procs.append(daphne)

        # The endpoint alone (the page asks for clientWidth buckets, clamped to 200..2000).
        def get_series(buckets: int) -> tuple[float, dict, int]:
            req = urllib.request.Request(f"{base}/api/jobs/{job.pk}/series?name=loss&buckets={buckets}",
                                         headers={"Cookie": f"sessionid={cookie}"})  # fmt: skip
            t0 = time.monotonic()
            with urllib.request.urlopen(req, timeout=60) as r:
                body = r.read()
            return time.monotonic() - t0, json.loads(body), len(body)

        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            info["chromium"] = browser.version
            errors: list[str] = []
            context = logged_in_context(browser, base, errors)
            url = f"{base}/jobs/{job.pk}/"
            warm = time_page(context, url, UGRO_DRAWN, None, errors)
            samples = [time_page(context, url, UGRO_DRAWN, None, errors) for _ in range(args.repeat)]
            shot = new_page(context, errors)
            shot.goto(url)
            shot.wait_for_function(UGRO_DRAWN, polling="raf", timeout=60_000)
            buckets = shot.evaluate(
                "Math.max(200, Math.min(2000, Math.floor(document.getElementById('panels').clientWidth / 2) || 600))"
            )
            chart_info = shot.text_content("#chart-info")
            shot.screenshot(path=str(tmp / "ugro-1m.png"), full_page=False)
            shot.close()
            api = [get_series(buckets) for _ in range(args.repeat)]
            payload = api[-1][1]
            window = -(-args.steps // buckets)
            sent = [list(zip(xy["x"], xy["y"], strict=True)) for xy in payload["ranks"].values()]
            ugro_spikes = spikes_seen(sent, args.steps, window)
            result["ugro"] = {
                "points": total,
                "insert_s": round(insert_s, 2),
                "rollup_rebuild_s": round(rollup_s, 2),
                "warmup": warm,
                "samples": samples,
                "median_drawn_ms": statistics.median(s["drawn_ms_from_navigation_start"] for s in samples),
                "chart_info": chart_info,
                "buckets_requested": buckets,
                "series_endpoint_ms": [round(t * 1000, 1) for t, _, _ in api],
                "series_endpoint_median_ms": round(statistics.median(t for t, _, _ in api) * 1000, 1),
                "series_bytes": api[-1][2],
                "points_sent": sum(len(xy["x"]) for xy in payload["ranks"].values()) + len(payload["mean"]["x"]),
                "spikes_sent": ugro_spikes,
                "spikes_injected": spikes_expected(args.ranks, args.steps),
                "errors": errors[:20],
            }
            print("UGRO:", json.dumps({k: v for k, v in result["ugro"].items() if k not in ("samples", "warmup")}))
            if not args.skip_tb:
                result["tensorboard"] = tensorboard(args, tmp, browser, procs, window)
                print("TB:", json.dumps({k: v for k, v in result["tensorboard"].items() if k != "samples"}))
                if args.tb_python_loader:
                    slow = result["tensorboard_load_fast_false"] = tensorboard(
                        args, tmp, browser, procs, window, "false"
                    )
                    print("TB python loader:", json.dumps({k: v for k, v in slow.items() if k != "samples"}))
            browser.close()
        Path(RESULTS).mkdir(parents=True, exist_ok=True)
        for name in ("ugro-1m.png", "tensorboard-1m.png"):
            if (tmp / name).exists():
                (tmp / name).replace(Path("/tmp") / f"bench3-{name}")
    finally:
        cleanup(None, procs, tmp, args.keep)

    path = RESULTS / "page_load.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    result["ugro_runs"] = old.get("ugro_runs", {})
    result["ugro_runs"][args.label] = {"note": args.note, "machine": result["machine"], **result["ugro"]}
    if "tensorboard" not in result and "tensorboard" in old:
        result["tensorboard"] = old["tensorboard"]  # a --skip-tb run keeps the last TensorBoard figures
        result["tensorboard_from_earlier_run"] = True
    result["method"] = __doc__.split("\n\n", 2)[2].strip()
    result["params"] = {"ranks": args.ranks, "steps": args.steps, "repeat": args.repeat, "viewport": VIEWPORT}
    result["bench_wall_s"] = round(time.monotonic() - t_bench, 1)
    write_json(path, result)
    print("wrote", path)


def tensorboard(args, tmp: Path, browser, procs: list, window: int, load_fast: str = "auto") -> dict:
    py = Path(args.tb_venv) / "bin" / "python"
    logdir = tmp / "tb"
    t0 = time.monotonic()
    if not logdir.exists():  # written once, read by every loader
        writers = [
            subprocess.Popen([str(py), "-c", TB_WRITER, str(logdir / f"rank_{r}"), str(r), str(args.steps)])
            for r in range(args.ranks)
        ]
        for w in writers:
            if w.wait(timeout=400) != 0:
                raise RuntimeError("the TensorBoard event writer failed")
    write_s = time.monotonic() - t0
    size = sum(p.stat().st_size for p in logdir.rglob("*") if p.is_file())
    version = subprocess.run([str(py), "-c", "import tensorboard; print(tensorboard.__version__)"],
                             capture_output=True, text=True, timeout=60).stdout.strip()  # fmt: skip
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    t_launch = time.monotonic()
    tb_log = tmp / f"tensorboard-{load_fast}.log"
    tb = start([str(Path(args.tb_venv) / "bin" / "tensorboard"), "--logdir", str(logdir), "--host", "127.0.0.1",
                "--port", str(port), f"--load_fast={load_fast}"], {"PATH": "/usr/bin:/bin", "HOME": str(tmp)},
               tb_log)  # fmt: skip
    procs.append(tb)
    runs = [f"rank_{r}" for r in range(args.ranks)]

    def get(path: str):
        try:
            with urllib.request.urlopen(base + path, timeout=30) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def tags_listed():
        tags = get("/data/plugin/scalars/tags") or {}
        return all("loss" in tags.get(run, {}) for run in runs)

    wait_for(lambda: get("/data/environment") is not None, 120, "tensorboard to answer", 0.1)
    t_http = time.monotonic()
    wait_for(tags_listed, 300, "tensorboard to list every run", 0.1)
    t_tags = time.monotonic()
    last = {}

    def fully_loaded():
        for run in runs:
            data = get(f"/data/plugin/scalars/scalars?run={run}&tag=loss") or []
            last[run] = (data[-1][1] if data else None, len(data), data)
            if last[run][0] != args.steps - 1:
                return False
        return True

    wait_for(fully_loaded, 240, "tensorboard to load every step", 0.25)
    t_full = time.monotonic()
    tb_spikes = spikes_seen([[(x, y) for _, x, y in data] for _, _, data in last.values()], args.steps, window)
    points_sent = sum(n for _, n, _ in last.values())

    context = browser.new_context(viewport=VIEWPORT)
    errors: list[str] = []
    url = base + "/#scalars"
    warm = time_page(context, url, TB_DRAWN, len(runs), errors)
    samples = [time_page(context, url, TB_DRAWN, len(runs), errors) for _ in range(args.repeat)]
    page = new_page(context, errors)
    page.goto(url)
    page.wait_for_function(TB_DRAWN, arg=len(runs), polling="raf", timeout=60_000)
    if load_fast == "auto":
        page.screenshot(path=str(tmp / "tensorboard-1m.png"), full_page=False)
    page.close()
    context.close()
    stop(tb)
    loader = "rust data server" if "fast data loading" in tb_log.read_text() else "python"
    return {
        "version": version,
        "load_fast": load_fast,
        "loader": loader,
        "event_files_write_s": round(write_s, 1) if load_fast == "auto" else None,
        "event_files_bytes": size,
        "launch_to_http_s": round(t_http - t_launch, 2),
        "launch_to_tags_listed_s": round(t_tags - t_launch, 2),
        "launch_to_all_steps_loaded_s": round(t_full - t_launch, 2),
        "warmup": warm,
        "samples": samples,
        "median_drawn_ms": statistics.median(s["drawn_ms_from_navigation_start"] for s in samples),
        "points_sent_per_chart": points_sent,
        "spikes_sent": tb_spikes,
        "spikes_injected": spikes_expected(args.ranks, args.steps),
        "errors": errors[:20],
    }


if __name__ == "__main__":
    main()
