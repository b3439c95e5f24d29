"""Will more nodes help? The scale probe's choice (jobs/scale_probe.py) against running every node count.

    .venv/bin/python bench/scaling.py [--models tiny,small] [--rates none,1gbit,20mbit] [--probe-s 3]
                                      [--samples 20000] [--per-gpu 8] [--run-limit-s 45] [--budget-s 1200]

For each model size and link rate, the reference script (train/train_production.py, gloo on CPU, one process
per "node") runs on 1, 2 and 3 nodes to the same number of samples. Each node is its own loopback address
(127.0.3.2, .3, .4): a rank runs in a UTS namespace of its own whose hostname is that address, so gloo binds
there, and the link into each address is shaped with tc (htb on lo, a u32 filter on the destination address,
one class per node at the rate: each node has its own link, as on a home switch; this kernel has no netem).
The rest of lo keeps a 25 Gbit/s default class; the benchmark's qdisc (handle 7e5:) is removed at the end,
and it refuses to start when lo already has a root qdisc of someone else's.

The probe's view of each count is the first --probe-s seconds of step lines after that count's first step
(every count starts from the same seed and step, as the probe's runs do), measured and chosen by the product's
own code (scale_probe.measure / choose); the truth is each count's samples/s over its whole run (first step
line to last). A cell's choice is good when its count's true samples/s is within 5 % of the best count's.
The probe's cost is its time (each count's start-up and --probe-s) against a 1-hour run, given for --probe-s
and for 20 s and 60 s per count from the same start-up times.

Writes bench/results/scaling.json (--out) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._common import NODE_PY, RESULTS, make_tmp  # noqa: E402

SCRIPT = REPO / "train" / "train_production.py"
ADDRS = ["127.0.3.2", "127.0.3.3", "127.0.3.4"]
HANDLE = "7e5"
SEQ = 32
GOOD = 0.95
FIRST_STEP_S = 150.0  # a count's ranks log their first step within this, or the run is cut


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


def lo_root() -> str:
    return sh("tc", "qdisc", "show", "dev", "lo").stdout


def shape_setup() -> None:
    root = lo_root()
    if "htb" in root or "root" in root and "noqueue" not in root:
        raise SystemExit(f"lo already has a root qdisc that is not this benchmark's: {root.strip()}")
    sh("tc", "qdisc", "add", "dev", "lo", "root", "handle", f"{HANDLE}:", "htb", "default", "1")
    sh("tc", "class", "add", "dev", "lo", "parent", f"{HANDLE}:", "classid", f"{HANDLE}:1", "htb", "rate", "25gbit")
    for i, addr in enumerate(ADDRS):
        sh("tc", "class", "add", "dev", "lo", "parent", f"{HANDLE}:", "classid", f"{HANDLE}:{i + 10}", "htb", "rate",
           "25gbit")  # fmt: skip
        sh("tc", "filter", "add", "dev", "lo", "parent", f"{HANDLE}:", "protocol", "ip", "prio", "1", "u32", "match",
           "ip", "dst", f"{addr}/32", "flowid", f"{HANDLE}:{i + 10}")  # fmt: skip


def shape(rate: str) -> None:
    """Every node's incoming link at this rate ("none": 25 Gbit/s, as unshaped lo)."""
    value = "25gbit" if rate == "none" else rate
    for i in range(len(ADDRS)):
        sh("tc", "class", "change", "dev", "lo", "parent", f"{HANDLE}:", "classid", f"{HANDLE}:{i + 10}", "htb",
           "rate", value, "ceil", value)  # fmt: skip


def shape_cleanup() -> None:
    if f"qdisc htb {HANDLE}: root" in lo_root():
        sh("tc", "qdisc", "del", "dev", "lo", "root", "handle", f"{HANDLE}:", check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_count(tmp: Path, model: str, count: int, samples: int, per_gpu: int, limit_s: float) -> dict:
    """count ranks of the reference script to `samples` samples (fewer when it outlasts limit_s: its rate then
    stands for the rest); rank 0's step lines with when each was read."""
    steps = max(4, samples // (count * per_gpu))
    port = free_port()
    procs = []
    t_start = time.monotonic()
    for rank in range(count):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RANK=str(rank), WORLD_SIZE=str(count), LOCAL_RANK="0",
                   MASTER_ADDR=ADDRS[0], MASTER_PORT=str(port), UGRO_JOB=f"bench-scaling-{os.getpid()}")  # fmt: skip
        argv = [str(NODE_PY), str(SCRIPT), "--model-name", model, "--max-steps", str(steps), "--seq-len", str(SEQ),
                "--log-every", "1", "--batch-size", str(per_gpu), "--save-every", "0", "--output-dir",
                str(tmp / f"out{rank}")]  # fmt: skip
        # its own hostname, the node's address: gloo binds to what the hostname resolves to
        wrapped = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', ADDRS[rank], *argv]
        procs.append(subprocess.Popen(wrapped, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    seen: list[tuple[float, dict]] = []

    def read() -> None:
        for raw in procs[0].stdout:
            line = raw.decode("utf-8", "replace").strip()
            if line.startswith("{"):
                seen.append((time.monotonic(), json.loads(line)))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + FIRST_STEP_S  # start-up first: under load, torch's import alone takes long
    cut = False
    while any(p.poll() is None for p in procs):
        if seen and deadline > seen[0][0] + limit_s:
            deadline = seen[0][0] + limit_s
        if time.monotonic() > deadline:
            cut = True
            for p in procs:
                p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.wait(timeout=30)
        if p.stdout and p is not procs[0]:
            p.stdout.read()
    reader.join(timeout=10)
    if not cut and procs[0].returncode != 0:
        raise RuntimeError(f"{count} nodes, {model}: rank 0 exited {procs[0].returncode}")
    return {"count": count, "steps": steps, "cut": cut, "started": t_start, "lines": seen}


def probe_view(run: dict, probe_s: float, per_gpu: int):
    """What the probe would have measured: the first probe_s seconds of step lines after the first one."""
    from jobs.scale_probe import CountRun, StepLine

    lines = run["lines"]
    if not lines:
        return CountRun(nodes=ADDRS[: run["count"]], workers=run["count"], local_batches=[per_gpu] * run["count"],
                        workers_per_node=[1] * run["count"], problem="no step lines")  # fmt: skip
    t0 = lines[0][0]
    window = [StepLine(m["step"], {k: float(v) for k, v in m.items() if isinstance(v, int | float)}, 0, t)
              for t, m in lines if t <= t0 + probe_s]  # fmt: skip
    return CountRun(nodes=ADDRS[: run["count"]], workers=run["count"], local_batches=[per_gpu] * run["count"],
                    workers_per_node=[1] * run["count"], lines={ADDRS[0]: window})  # fmt: skip


def true_rate(run: dict, per_gpu: int) -> float | None:
    """Samples/s over the whole run, first step line to last."""
    lines = run["lines"]
    if len(lines) < 2 or lines[-1][0] <= lines[0][0]:
        return None
    steps = lines[-1][1]["step"] - lines[0][1]["step"]
    return steps * run["count"] * per_gpu / (lines[-1][0] - lines[0][0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--rates", default="none,1gbit,20mbit")
    ap.add_argument("--probe-s", type=float, default=3.0)
    ap.add_argument(
        "--samples",
        type=int,
        default=20000,
        help="samples each node count trains, the same for all: its run well past the probe's seconds",
    )
    ap.add_argument("--per-gpu", type=int, default=8)
    ap.add_argument(
        "--run-limit-s",
        type=float,
        default=45.0,
        help="a run longer than this after its first step is cut (its rate stands for the rest)",
    )
    ap.add_argument("--budget-s", type=float, default=1200.0, help="cells not started past this are left out")
    ap.add_argument("--out", default="scaling.json", help="the results file in bench/results/")
    args = ap.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugro_site.settings")
    tmp = make_tmp("ugro-scaling-")
    os.environ.setdefault("UGRO_DATA_DIR", str(tmp / "data"))
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:9/0")
    import django

    django.setup()
    from jobs.scale_probe import choose, measure, with_efficiency

    t_bench = time.monotonic()
    cells = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM still removes the qdisc (finally)
    shape_setup()
    try:
        for rate in args.rates.split(","):
            shape(rate)
            for model in args.models.split(","):
                if time.monotonic() - t_bench > args.budget_s:
                    print(f"budget spent: {model} at {rate} left out", flush=True)  # noqa: T201
                    continue
                runs = [run_count(tmp, model, k, args.samples, args.per_gpu, args.run_limit_s) for k in (1, 2, 3)]
                rows = with_efficiency([measure(probe_view(r, args.probe_s, args.per_gpu)) for r in runs])
                choice = choose(rows, 3, forced=False)
                truth = {r["count"]: true_rate(r, args.per_gpu) for r in runs}
                best = max((k for k in truth if truth[k]), key=lambda k: truth[k])
                startup = [r["lines"][0][0] - r["started"] if r["lines"] else None for r in runs]
                got = truth.get(choice.nodes) or 0.0
                cell = {
                    "model": model, "rate": rate, "probe_rows": rows, "choice": choice.nodes, "line": choice.line,
                    "true_samples_per_s": {k: round(v, 2) if v else None for k, v in truth.items()},
                    "fastest": best, "choice_pct_of_fastest": round(100 * got / truth[best], 1),
                    "good": got >= GOOD * truth[best], "cut": [r["count"] for r in runs if r["cut"]],
                    "startup_s": [round(s, 2) if s is not None else None for s in startup],
                    "probe_cost_pct_of_1h": {
                        str(p): round(100 * sum((s or 0) + p for s in startup) / 3600, 2)
                        for p in sorted({args.probe_s, 20.0, 60.0})
                    },
                    "load1": os.getloadavg()[0],
                }  # fmt: skip
                cells.append(cell)
                print(json.dumps({k: cell[k] for k in ("model", "rate", "choice", "fastest", "true_samples_per_s",
                                                       "choice_pct_of_fastest")}), flush=True)  # fmt: skip  # noqa: T201
    finally:
        shape_cleanup()
    out = {
        "benchmark": "scaling",
        "args": vars(args),
        "cells": cells,
        "good_cells": sum(c["good"] for c in cells),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "wall_s": round(time.monotonic() - t_bench, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'model':6} {'link':7} {'probe samples/s 1/2/3':>24} {'true samples/s 1/2/3':>24} choice fastest  %")  # noqa: T201
    for c in cells:
        probe = "/".join(f"{r.get('samples_per_s', 0):.0f}" for r in c["probe_rows"])
        true = "/".join(f"{v or 0:.0f}" for v in c["true_samples_per_s"].values())
        print(f"{c['model']:6} {c['rate']:7} {probe:>24} {true:>24} {c['choice']:>6} {c['fastest']:>7} "  # noqa: T201
              f"{c['choice_pct_of_fastest']:>5}")  # fmt: skip


if __name__ == "__main__":
    main()
