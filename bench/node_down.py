"""Node down: seconds from a node going silent to UGRO marking it DOWN, this checkout beside another.

Run by hand (not a test):
    .venv/bin/python bench/node_down.py [--peer /work/main] [--how stop drop] [--modes job idle] [--trials 3]

* One real sshd node on 127.0.4.2, a throwaway PostgreSQL database, Redis pointed at a closed port.
* Beat as in production: every 5 s `cluster.monitor.poll_once()` is started in a pool of 8 threads
  (the worker's `-P threads -c 8`), so a slow poll does not hold back the next tick.
* "Silent", two ways (`--how`): `stop`, the node's sshd listener and its session processes get SIGSTOP,
  as a machine that froze: the warm link gets no answer, and new connections are accepted by the
  kernel but never see an SSH banner; `drop`, every packet to and from the node's address is dropped
  (an iptables chain of the benchmark's own), as a pulled cable or a lost Wi-Fi link: no answer, and
  new connections get no SYN-ACK either. The clock starts at the cut and stops when the node's row
  says DOWN (the database is read every 0.1 s).
* Modes: `job` (a running job holds the node: 5 s poll interval) and `idle` (40 s). Each trial
  first gets one good probe over a warm link, then goes silent at a random moment within one
  poll interval (uniform), so the figures include where in its interval a failure lands.
* `--peer PATH` runs the same measurement with another checkout's UGRO code (e.g. main before a
  change) in the same run, one after the other, on the same machine.

Writes bench/results/node_down.json (overwritten) and a table on stdout.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from _common import Drop  # noqa: E402
from _db import throwaway_database  # noqa: E402

RESULTS = REPO / "bench" / "results"
SUBNET = "127.0.4"  # never 127.0.0.x (the tests') nor another benchmark's subnet
DEAD_REDIS = "redis://127.0.0.1:9/0"
TICK_S = 5.0
INTERVAL_S = {"job": 5.0, "idle": 40.0}
GIVE_UP_S = 240.0


def session_pids(address: str, port: int) -> list[int]:
    """sshd connection processes serving address:port (what `ss` says holds those sockets)."""
    out = subprocess.run(["ss", "-tnpH", "state", "established", "src", f"{address}:{port}"], capture_output=True,
                         timeout=5).stdout  # fmt: skip
    pids = set()
    for line in out.splitlines():
        for part in line.split(b"pid=")[1:]:
            pids.add(int(part.split(b",")[0]))
    return sorted(pids)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def measure(code: Path, modes: list[str], trials: int, verbose: bool = False, how: tuple[str, ...] = ("stop",)) -> dict:
    """In this process: set up Django from `code` on a throwaway database, run the trials, return the figures."""
    with throwaway_database() as database_url:
        return measure_on(database_url, code, modes, trials, verbose, how)


def measure_on(database_url: str, code: Path, modes: list[str], trials: int, verbose: bool,
               how: tuple[str, ...] = ("stop",)) -> dict:  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="ugro-node-down-", dir="/tmp"))
    os.environ.update(
        DATABASE_URL=database_url,
        UGRO_DATA_DIR=str(tmp / "data"),
        REDIS_URL=DEAD_REDIS,
        DJANGO_SETTINGS_MODULE="ugro_site.settings",
    )
    sys.path.insert(0, str(REPO))
    from tests.loopback import LoopbackCluster  # this checkout's rig, whichever checkout's code is measured

    sys.path.insert(0, str(code))
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    from cluster import monitor
    from cluster.links import pool
    from cluster.models import Node
    from jobs.models import Job, Rank

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still runs the `finally` below
    cluster = LoopbackCluster(tmp / "nodes", 1, subnet=SUBNET, first_octet=2).start()
    lb = cluster.nodes[0]
    node = Node.objects.create(name="silent", address=lb.address, ssh_port=lb.port, user=cluster.user,
                               key_path=str(cluster.client_key), workdir=str(lb.workdir), gpu_count=0)  # fmt: skip
    stop = threading.Event()
    paused = threading.Event()  # between trials: no new polls, so none of a trial leaks into the next
    pollers = ThreadPoolExecutor(8)
    in_flight = [0]
    lock = threading.Lock()

    def one_poll() -> None:
        try:
            for out in monitor.poll_once():
                if verbose:
                    row = Node.objects.filter(pk=node.pk).values_list("breaker", "status").first()
                    print(f"{time.monotonic() - clock[0]:7.2f} ok={out.ok} {row} {out.reason[:100]}", file=sys.stderr,
                          flush=True)  # fmt: skip
        except Exception as exc:  # a bench keeps ticking, as beat does
            print("poll failed:", exc, file=sys.stderr)
        finally:
            connection.close()
            with lock:
                in_flight[0] -= 1

    def beat() -> None:
        next_tick = time.monotonic()
        while not stop.is_set():  # bounded by the stop event set in `finally`
            if not paused.is_set():
                with lock:
                    in_flight[0] += 1
                pollers.submit(one_poll)
            next_tick += TICK_S
            stop.wait(max(0.0, next_tick - time.monotonic()))

    clock = [time.monotonic()]  # when the node went silent (verbose lines are relative to it)
    frozen: list[int] = []
    drop = Drop(lb.address)
    results: dict[str, list[float]] = {}
    try:
        ticker = threading.Thread(target=beat, daemon=True)
        ticker.start()
        for way, mode in [(w, m) for w in how for m in modes]:
            Rank.objects.all().delete()
            Job.objects.all().delete()
            if mode == "job":
                job = Job.objects.create(name="holder", script="x.py", state="running", tag="bench-holder")
                Rank.objects.create(job=job, node=node, index=0, state="running", active=True)
            key = f"{way}/{mode}"
            results[key] = []
            for _ in range(trials):
                paused.set()
                quiet = time.monotonic() + 120
                while in_flight[0] and time.monotonic() < quiet:
                    time.sleep(0.2)
                # a good probe over a warm link, then silence at a random point of the interval
                Node.objects.filter(pk=node.pk).update(breaker={}, status="unknown", poll_lease_until=None)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    outs = monitor.poll_once(force=True)
                    if outs and outs[0].ok:
                        break
                    time.sleep(1)
                else:
                    raise RuntimeError("the node did not come back before a trial")
                paused.clear()
                time.sleep(random.uniform(0, INTERVAL_S[mode]))
                if way == "drop":
                    drop.apply()
                else:
                    frozen = [lb.proc.pid, *session_pids(lb.address, lb.port)]
                    signal_all(frozen, signal.SIGSTOP)
                t0 = clock[0] = time.monotonic()
                while time.monotonic() - t0 < GIVE_UP_S:
                    if Node.objects.filter(pk=node.pk, status="down").exists():
                        break
                    time.sleep(0.1)
                took = time.monotonic() - t0
                if took >= GIVE_UP_S:  # where are the polls stuck?
                    faulthandler.dump_traceback(all_threads=True)
                signal_all(frozen, signal.SIGCONT)
                frozen = []
                drop.undo()
                results[key].append(round(took, 2))
                print(f"{code.name} {key}: DOWN after {took:.1f} s", file=sys.stderr, flush=True)
                pool.close_all()
    finally:
        stop.set()
        signal_all(frozen, signal.SIGCONT)
        drop.undo()
        pollers.shutdown(wait=True)
        cluster.stop()
        pool.close_all()
        shutil.rmtree(tmp, ignore_errors=True)
    import cluster.links

    loaded = str(Path(cluster.links.__file__).resolve().parent.parent)
    if loaded != str(code):
        raise SystemExit(f"measured the code in {loaded}, not {code}")
    return {
        key: {"trials_s": vals, "median_s": statistics.median(vals), "max_s": max(vals), "min_s": min(vals)}
        for key, vals in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", type=Path, help="another UGRO checkout to measure the same way")
    parser.add_argument("--modes", nargs="+", choices=sorted(INTERVAL_S), default=["job", "idle"])
    parser.add_argument("--how", nargs="+", choices=["stop", "drop"], default=["stop", "drop"],
                        help="silence by SIGSTOP of sshd (stop) or by dropping every packet (drop: iptables)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--verbose", action="store_true", help="print every poll's outcome (to stderr)")
    parser.add_argument("--code", type=Path, help=argparse.SUPPRESS)  # the child: measure this checkout
    args = parser.parse_args()
    if args.code:
        figures = measure(args.code.resolve(), args.modes, args.trials, args.verbose, tuple(args.how))
        print("RESULT " + json.dumps(figures), flush=True)
        return
    runs = {}
    for label, code in [("this", REPO), *([("peer", args.peer.resolve())] if args.peer else [])]:
        # each checkout in its own process: its own Django, its own cluster/ code
        cmd = [sys.executable, str(Path(__file__).resolve()), "--code", str(code), "--trials", str(args.trials),
               "--modes", *args.modes, "--how", *args.how, *(["--verbose"] if args.verbose else [])]  # fmt: skip
        # cwd=code: Celery puts the working directory first on sys.path, so it decides whose code is imported
        proc = subprocess.run(cmd, cwd=code, capture_output=True, text=True,
                              timeout=GIVE_UP_S * 2 * args.trials * 2 + 300)  # fmt: skip
        sys.stderr.write(proc.stderr[-4000:])
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{label} ({code}) gave no result:\n{proc.stdout[-2000:]}")
        git = subprocess.run(["git", "-C", str(code), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
        runs[label] = {"checkout": str(code), "commit": git.stdout.strip()[:120], **json.loads(line[7:])}
    result = {
        "benchmark": "node_down",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load1": os.getloadavg()[0]},
        "tick_s": TICK_S,
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "node_down.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'checkout':10} {'how/mode':10} {'median s':>9} {'max s':>7}  trials")
    for label, run in runs.items():
        for key in [f"{w}/{m}" for w in args.how for m in args.modes]:
            r = run[key]
            print(f"{label:10} {key:10} {r['median_s']:9.1f} {r['max_s']:7.1f}  {r['trials_s']}")


if __name__ == "__main__":
    main()
