#!/usr/bin/env python
"""Opening a job with 1,000,000 loss points in Chromium: UGRO's job page vs TensorBoard's scalars.

    .venv/bin/python bench/page_load.py [--ranks 2] [--steps 500000] [--repeat 5] [--tb-venv /tmp/tbvenv]
                                        [--skip-tb] [--tb-python-loader] [--label L] [--keep]

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
  const canvas = document.querySelector('#chart canvas');
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
w = EventFileWriter(logdir, max_queue_size=10000, flush_secs=5)
t0 = time.time()
for s in range(steps):
    v = 2.0 * math.exp(-s / 150000.0) + 0.1 * math.sin(s * 0.37 + rank * 1.3) + (1.5 if s % 50000 == 777 else 0.0)
    summary = Summary(value=[Summary.Value(tag="loss", simple_value=v)])
    w.add_event(Event(wall_time=t0 + s * 0.001, step=s, summary=summary))
w.close()
"""


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


def insert_points(job_id: int, ranks: int, steps: int) -> float:
    from django.db import connection

    from metrics.models import MetricPoint

    table = MetricPoint._meta.db_table
    t0 = time.monotonic()
    with connection.cursor() as cur:
        cur.execute(
            f"INSERT INTO {table} (job_id, rank, step, name, value, time) "
            "SELECT %s, r, s, 'loss', 2.0 * exp(-s / 150000.0) + 0.1 * sin(s * 0.37 + r * 1.3) "
            "  + CASE WHEN s %% %s = %s THEN %s ELSE 0 END, now() "
            "FROM generate_series(0, %s) r, generate_series(0, %s) s",
            [job_id, SPIKE_EVERY, SPIKE_AT, SPIKE, ranks - 1, steps - 1],
        )
        cur.execute(f"ANALYZE {table}")
    return time.monotonic() - t0


def new_page(context, errors: list[str]):
    page = context.new_page()
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    return page


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=500_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tb-venv", default="/tmp/tbvenv")
    ap.add_argument("--skip-tb", action="store_true")
    ap.add_argument(
        "--tb-python-loader",
        action="store_true",
        help="also time TensorBoard with --load_fast=false (its Python loader), same event files",
    )
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--label", default="current", help="key of this run's UGRO figures under ugro_runs (kept)")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
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
            context = browser.new_context(viewport=VIEWPORT)
            errors: list[str] = []
            login = new_page(context, errors)
            login.goto(base + "/accounts/login/")
            login.fill("#id_username", "bench")
            login.fill("#id_password", "bench-pw-123")
            login.click("button[type=submit]")
            login.wait_for_url(base + "/")
            url = f"{base}/jobs/{job.pk}/"
            warm = time_page(context, url, UGRO_DRAWN, None, errors)
            samples = [time_page(context, url, UGRO_DRAWN, None, errors) for _ in range(args.repeat)]
            shot = new_page(context, errors)
            shot.goto(url)
            shot.wait_for_function(UGRO_DRAWN, polling="raf", timeout=60_000)
            buckets = shot.evaluate(
                "Math.max(200, Math.min(2000, Math.floor(document.getElementById('chart').clientWidth)))"
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
