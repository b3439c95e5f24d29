"""Health sweep: UGRO's monitor vs the original scripts' sequential per-check SSH loop, side by side.

Run by hand (not a test):  .venv/bin/python bench/health_sweep.py [--sizes 1 8 16 32] [--idle-seconds 60]

* N = 1, 8, 16, 32 real sshd nodes on 127.0.2.x (never the test suite's 127.0.0.x).
* UGRO: `cluster.monitor.poll_once(force=True)`: one `probe` request per node, all nodes at once,
  over warm links (the first, cold sweep that opens the links is reported separately), with
  samples, scores and alerts written to a throwaway PostgreSQL database and the events sent to Redis.
* Original: for each node in turn, three fresh `ssh` commands: `echo OK`, `nvidia-smi` (absent
  here: it fails fast, but the SSH connection and login are real) and `python -c "import torch"`
  with the node training env's python (the original ran it in the user's env, where torch is).
* Controller CPU while idle-polling 16 nodes: process CPU time (user + system, all threads) over
  `--idle-seconds`, divided by that time, with beat's 5 s tick calling `poll_once()` (the adaptive
  interval decides what is due), and the same with every node probed every tick (the 5 s "job
  running" rate), as the worst case.

Writes bench/results/health_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from _db import throwaway_database  # noqa: E402

NODE_ENV = Path(os.environ.get("UGRO_NODE_ENV", REPO / ".venv-node"))
RESULTS = REPO / "bench" / "results"
SUBNET = "127.0.2"
SSH_OPTS = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
            "-o", "LogLevel=ERROR"]  # fmt: skip


def setup_django(tmp: Path, database_url: str) -> None:
    os.environ.update(
        DATABASE_URL=database_url,
        UGRO_DATA_DIR=str(tmp / "data"),
        REDIS_URL=os.environ.get("UGRO_BENCH_REDIS_URL", "redis://127.0.0.1:6379/14"),
        DJANGO_SETTINGS_MODULE="ugro_site.settings",
    )
    sys.path.insert(0, str(REPO))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def original_sweep(cluster, nodes) -> dict:
    """The original scripts: per node, per check, a fresh ssh command, one after another."""
    python = str(NODE_ENV / "bin" / "python")
    checks = [["echo", "OK"], ["nvidia-smi"], [python, "-c", "import torch"]]
    t0 = time.monotonic()
    results = []
    for node in nodes:
        for argv in checks:
            cmd = ["ssh", *SSH_OPTS, "-i", str(cluster.client_key), "-p", str(node.port),
                   f"{cluster.user}@{node.address}", shlex.join(argv)]  # fmt: skip
            rc = subprocess.run(cmd, capture_output=True, timeout=120).returncode
            results.append(rc)
    return {"seconds": round(time.monotonic() - t0, 3), "commands": len(results), "failed": sum(1 for r in results
            if r != 0)}  # fmt: skip


def ugro_sweeps(rows, repeats: int) -> dict:
    from cluster import monitor
    from cluster.fanout import on_each

    t0 = time.monotonic()
    cold = monitor.poll_once(nodes=rows, force=True)
    cold_s = time.monotonic() - t0
    times = []
    c0 = cpu_seconds()
    for _ in range(repeats):
        t0 = time.monotonic()
        out = monitor.poll_once(nodes=rows, force=True)
        times.append(time.monotonic() - t0)
        assert len(out) == len(rows) and all(o.ok for o in out), [(o.node, o.reason) for o in out if not o.ok]
    cpu_per_node_ms = (cpu_seconds() - c0) / repeats / len(rows) * 1000
    # The same links with a no-op request: what the transport itself costs, without the probe's work.
    hello = []
    for _ in range(repeats):
        t0 = time.monotonic()
        on_each(rows, lambda n: n.link().request("hello"))
        hello.append(time.monotonic() - t0)
    return {
        "transport_only_median_seconds": round(statistics.median(hello), 4),
        "controller_cpu_ms_per_node": round(cpu_per_node_ms, 2),
        "cold_seconds": round(cold_s, 3),
        "cold_ok": sum(o.ok for o in cold),
        "warm_median_seconds": round(statistics.median(times), 4),
        "warm_min_seconds": round(min(times), 4),
        "warm_max_seconds": round(max(times), 4),
        "warm_runs": len(times),
    }


def probe_cost() -> dict:
    """CPU of one probe on a node (run here, in-process, with the node's python 3): on loopback
    every node's probe runs on this machine's cores, so a 32-node sweep pays 32 of these."""
    code = (
        "import importlib.util,time,sys;s=importlib.util.spec_from_file_location('p',sys.argv[1]);"
        "p=importlib.util.module_from_spec(s);s.loader.exec_module(p);p.op_probe({});c=time.process_time();"
        "[p.op_probe({}) for _ in range(20)];print((time.process_time()-c)/20*1000)"
    )
    out = subprocess.run(["/usr/bin/python3", "-c", code, str(REPO / "cluster" / "node" / "probe.py")],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    procs = sum(1 for d in os.listdir("/proc") if d.isdigit())
    return {"cpu_ms_per_probe": round(float(out), 2), "processes_scanned": procs, "cpus": os.cpu_count()}


def idle_cpu(rows, seconds: float, force: bool) -> dict:
    """Beat's 5 s tick for `seconds` over the enabled nodes; CPU time of this process over the wall time."""
    from cluster import monitor
    from cluster.models import Node

    Node.objects.exclude(pk__in=[r.pk for r in rows]).update(enabled=False)
    monitor.poll_once(force=True)  # links warm, every node polled once
    probes = 0
    c0, t0 = cpu_seconds(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        tick = time.monotonic()
        probes += len(monitor.poll_once(force=force))  # what the beat task runs
        time.sleep(max(0.0, 5.0 - (time.monotonic() - tick)))
    wall = time.monotonic() - t0
    used = cpu_seconds() - c0
    return {"wall_seconds": round(wall, 1), "cpu_seconds": round(used, 3),
            "cpu_percent_of_one_core": round(100 * used / wall, 2), "probes": probes}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--skip-original", action="store_true")
    args = parser.parse_args()
    with throwaway_database() as database_url:
        run(args, database_url)


def run(args: argparse.Namespace, database_url: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ugro-health-bench-", dir="/tmp"))
    setup_django(tmp, database_url)
    from cluster.links import pool
    from cluster.models import Node
    from tests.loopback import LoopbackCluster

    biggest = max(args.sizes)
    cluster = LoopbackCluster(tmp / "nodes", count=max(biggest, 16), subnet=SUBNET).start()
    try:
        rows = [
            Node.objects.create(
                name=n.name,
                address=n.address,
                ssh_port=n.port,
                user=cluster.user,
                key_path=str(cluster.client_key),
                workdir=str(n.workdir),
                gpu_count=0,
                order=i,
                role="master" if i == 0 else "worker",
            )  # fmt: skip
            for i, n in enumerate(cluster.nodes)
        ]
        sweeps = []
        for size in args.sizes:
            pool.close_all()  # each size starts cold, then measures warm sweeps
            entry = {"nodes": size, "ugro": ugro_sweeps(rows[:size], args.repeats)}
            if not args.skip_original:
                entry["original"] = original_sweep(cluster, cluster.nodes[:size])
                entry["speedup_warm"] = round(entry["original"]["seconds"] / entry["ugro"]["warm_median_seconds"], 1)
            sweeps.append(entry)
            print(json.dumps(entry), flush=True)
        t1 = next((s["ugro"]["warm_median_seconds"] for s in sweeps if s["nodes"] == 1), None)
        t32 = next((s["ugro"]["warm_median_seconds"] for s in sweeps if s["nodes"] == 32), None)
        node_probe = probe_cost()
        pool.close_all()
        idle = idle_cpu(rows[:16], args.idle_seconds, force=False)
        print("idle (adaptive)", json.dumps(idle), flush=True)
        busy = idle_cpu(rows[:16], args.idle_seconds, force=True)
        print("every 5 s", json.dumps(busy), flush=True)
        result = {
            "benchmark": "health_sweep",
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
            },  # fmt: skip
            "method": __doc__.strip().splitlines()[2:16],
            "sweeps": sweeps,
            "t32_over_t1_warm": round(t32 / t1, 2) if t1 and t32 else None,
            "node_side_probe_cost": node_probe,
            "controller_cpu_16_nodes_adaptive": idle,
            "controller_cpu_16_nodes_every_5s": busy,
            "targets": {
                "16 nodes under 1 s": "warm sweep",
                "t(32)/t(1) <= 2": "warm sweeps",
                "idle CPU 16 nodes < 2 % of one core": "adaptive interval",
            },  # fmt: skip
        }
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "health_sweep.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    finally:
        pool.close_all()
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
