#!/usr/bin/env python
"""Reliability: Redis restarted under a running job (R3), and 10 jobs x 3 ranks at 1,000 lines/s each (R10).

    .venv/bin/python bench/reliability.py [--only r3,r10] [--r10-jobs 3,10] [--r10-rate 1000]
                                          [--r10-seconds 60] [--r3-rate 50] [--r3-seconds 60]
                                          [--outage-at 15] [--outage 10] [--ranks-nice 0] [--suffix S]
                                          [--note TEXT] [--keep]

One throwaway UGRO: PostgreSQL database `ugro_bench_rel` (recreated, dropped at the end), a
redis-server of its own on a free 127.0.0.1 port (`--save "" --appendonly no`; never the machine's
6379), a temp UGRO_DATA_DIR, and 3 x max(jobs) real sshd nodes on 127.0.4.2.. (never the test
suite's 127.0.0.x nor the other benchmarks' 127.0.1.x / 127.0.3.x). Each scenario gets fresh
controller processes started as `bin/start` starts them: a Celery worker (`-P threads -c 8`), Celery
beat (its own process and log) and daphne; the jobs are launched by that worker (the benchmark
creates each job and queues `schedule_jobs`; every job gets a rendezvous port of its own because
torch's TCPStore listens on every address of this one machine). Each rank is
`reliability_rank.py` under the node env's real torchrun (`--nproc-per-node 1`, no process group):
it waits for a GO file, then prints `{"step": n, "loss": x, "t": "<time.time()>"}` at a fixed
rate (absolute schedule, written and flushed every ~10 ms), and records how many lines it printed.
Two websocket viewers per job (processes of their own, logged in by session cookie, on daphne's
/ws/jobs/<id>/) reconnect the way the job page does (on close only; 0.5 s, doubling up to 15 s)
and record every metric line they receive, its delay (receive time - t: one machine clock) and
when they were disconnected.

After the jobs end, per rank: lines printed (the rank's own count) = metric lines in the node's log
= in the central copy (byte-for-byte equal) = Rank.log_lines (all lines) = `loss` MetricPoints
(distinct (rank, step), none repeated) = `loss` entries in metrics.jsonl (same) = what each viewer
received (a viewer may miss the lines committed while it was disconnected; the rest are counted
as unexplained). Controller CPU (worker + beat + daphne) and RSS come from /proc, sampled every
second; node-side, PostgreSQL-backend, Redis and viewer CPU beside it.

R3: one job of 3 ranks; `--outage-at` s after GO the Redis is stopped (SIGTERM) for `--outage` s
and started again on the same port. Reported: the counts above, the job's end and its nodes, how
long after Redis was back each viewer was connected and received lines again, and the traceback
lines in the worker's, beat's and daphne's logs from the stop until 30 s after the restart.
R10: N jobs x 3 ranks at `--r10-rate` lines/s per rank for `--r10-seconds` s, for each N.

The nodes share this machine's two CPUs with the controller and with each other, which real nodes do
not. It shows most at R10's end, when all 30 torchruns exit at once: torch's teardown costs each about
0.3-0.5 s of CPU, and for ~7 s they held both CPUs, while the node agents (which answer the follower's
reads) waited their turn behind them and the controller waited for the agents (`cpu_timeline`: CPU
seconds per role per second). `--ranks-nice 10` runs the jobs' processes on the nodes (wrapper,
torchrun, rank; niced before GO, the niceness of their sessions' autogroups too, since Linux schedules
each session as one group) at a lower priority than the agents and the controller, standing in for one
torchrun per machine. The ranks then print a little later than their schedule (`rank_max_lag_s`: up
to 0.26 s against 0.1 s without it), and a line's delay counts from when it was printed.

Results: bench/results/reliability.json (one entry per scenario; entries of scenarios not run are
kept). Run as `reliability.py viewer URL COOKIE ORIGIN OUT READY MAX_SECONDS` it is the viewer.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Drop  # noqa: E402
from _dash_common import (  # noqa: E402
    CONTROLLER_PY,
    DAPHNE,
    NODE_ENV,
    REPO,
    RESULTS,
    SECRET,
    cluster_yaml,
    free_port,
    http_ok,
    make_tmp,
    psql,
    session_cookie,
    start,
    stop,
    tagged_pids,
    wait_for,
    write_json,
)
from _dash_common import machine_info as dash_machine_info  # noqa: E402

DB_NAME = "ugro_bench_rel"
ROLES = ("worker", "daphne")  # the controller's processes
DB_URL = f"postgres://postgres@127.0.0.1:5432/{DB_NAME}"
SUBNET = "127.0.4"
RANK_FILE = "reliability_rank.py"
TERMINAL = {"succeeded", "failed", "cancelled"}
TRACEBACK = "Traceback (most recent call last)"
PAGE_RECONNECT_FIRST_S, PAGE_RECONNECT_MAX_S = 0.5, 15.0  # static/js/common.js UGRO.socket
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

# The rank (node env python, stdlib only): ready file, wait for GO (bounded), print paced metric lines.
RANK_SCRIPT = r"""
import json, os, sys, time

def opt(name, default):
    argv = sys.argv[1:]
    return argv[argv.index(name) + 1] if name in argv else default

rate = float(opt("--rel-rate", "1000"))
seconds = float(opt("--rel-seconds", "60"))
go = os.path.join(os.getcwd(), opt("--rel-go", "GO"))
go_timeout = float(opt("--rel-go-timeout", "900"))
tag = os.environ.get("UGRO_JOB", "untagged")
with open(os.path.join(os.getcwd(), "rel-ready-" + tag), "w") as fh:
    fh.write(str(os.getpid()))
deadline = time.time() + go_timeout
while not os.path.exists(go):
    if time.time() > deadline:
        sys.exit("no GO file within %gs" % go_timeout)
    time.sleep(0.02)
total = int(rate * seconds)
out = sys.stdout
t0 = time.time()
n = 0
lag_max = 0.0
while n < total:
    now = time.time()
    due = min(total, int((now - t0) * rate) + 1)
    if due > n:
        lag_max = max(lag_max, now - (t0 + n / rate))  # how late the oldest line of this write is
        stamp = "%.6f" % now
        out.write("".join('{"step": %d, "loss": %.6f, "t": "%s"}\n' % (i, 2.0 / (1.0 + i * 1e-3), stamp)
                          for i in range(n, due)))
        out.flush()
        n = due
    if n < total:
        time.sleep(max(0.0, max(now + 0.01, t0 + n / rate) - time.time()))
t1 = time.time()
with open(os.path.join(os.getcwd(), "rel-done-" + tag + ".json"), "w") as fh:
    json.dump({"printed": n, "t_first": t0, "t_last": t1, "max_lag_s": round(lag_max, 4)}, fh)
"""


# ---- the throwaway UGRO ------------------------------------------------------------------------
class RedisServer:
    """A redis-server of this benchmark's own on a free loopback port; stop() and start() again."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.dir = tmp / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.dir)]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=open(self.dir / "redis.log", "ab"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        wait_for(self.answers, 20, f"redis-server on port {self.port}", 0.05)

    def stop(self) -> None:
        stop(self.proc)
        wait_for(lambda: not self.answers(), 10, "redis-server to stop", 0.05)


def setup(tmp: Path, redis_url: str, db: str = "private") -> dict[str, str]:
    """Fresh database, django.setup() and migrate in this process; returns the environment for children.

    db "private": UGRO's own PostgreSQL in the data dir, as bin/start runs it with no DATABASE_URL (the
    default install); "system": a database of its own on the machine's server (127.0.0.1:5432)."""
    data = tmp / "ugro-data"
    data.mkdir(parents=True, exist_ok=True)
    own = {
        "DATABASE_URL": DB_URL,
        "REDIS_URL": redis_url,
        "UGRO_DATA_DIR": str(data),
        "SECRET_KEY": SECRET,
        "DJANGO_SETTINGS_MODULE": "ugro_site.settings",
        # 30 torchruns importing torch at once on 2 cores take longer than the default 30 s to meet.
        "UGRO_JOIN_TIMEOUT_S": "240",
    }
    if db == "private":
        from ugro_site import localdb

        del own["DATABASE_URL"]
        os.environ.pop("DATABASE_URL", None)
        tmp.chmod(0o711)  # as root the server runs as another account, which must pass through
        print(localdb.start(data), flush=True)
    else:
        psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        psql(f"CREATE DATABASE {DB_NAME}")
    os.environ.update(own)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return {**os.environ, **own, "PYTHONUNBUFFERED": "1"}


def start_cluster(tmp: Path, count: int):
    """`count` sshd nodes on 127.0.4.2.., imported into UGRO, each with the rank script in its workdir."""
    from cluster.config_yaml import import_cluster
    from tests.loopback import LoopbackCluster

    cluster = LoopbackCluster(tmp / "nodes", count, subnet=SUBNET, first_octet=2).start()
    for node in cluster.nodes:
        (node.workdir / RANK_FILE).write_text(RANK_SCRIPT)
    import_cluster(cluster_yaml(cluster, count).replace("script: bench_rank.py", f"script: {RANK_FILE}"))
    return cluster


class Controller:
    """Worker (with the schedule in it) and daphne as bin/start runs them, each in its own session."""

    def __init__(self, env: dict, tmp: Path, label: str) -> None:
        self.env, self.tmp, self.label = env, tmp, label
        self.logs = {name: tmp / f"{label}-{name}.log" for name in ROLES}
        self.restarts: list[dict] = []
        # the worker exactly as bin/start runs it (bin/worker: threads, no gossip/mingle/heartbeat)
        self.worker_argv = [str(REPO / "bin" / "worker"), "-n", f"rel-{label}@%h"]
        self.worker = start(self.worker_argv, env, self.logs["worker"])
        port = free_port()
        self.daphne = start([str(DAPHNE), "-b", "127.0.0.1", "-p", str(port), "ugro_site.asgi:application"], env,
                            self.logs["daphne"])  # fmt: skip
        self.base = f"http://127.0.0.1:{port}"
        self.roles = {proc.pid: name for name, proc in self.procs.items()}
        from ugro_site.celery import worker_alive

        wait_for(lambda: http_ok(self.base + "/accounts/login/"), 60, "daphne to serve", 0.2)
        wait_for(worker_alive, 60, "the worker's heartbeat", 0.2)

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {"worker": self.worker, "daphne": self.daphne}

    def revive_worker(self) -> bool:
        """If the worker process has exited, start another, as a service manager (systemd Restart=) would;
        True if it did. Each restart is recorded and logs to a file of its own."""
        if self.worker.poll() is None:
            return False
        exited, code = time.time(), self.worker.returncode
        name = f"worker-restart{len(self.restarts) + 1}"
        self.logs[name] = self.tmp / f"{self.label}-{name}.log"
        self.worker = start(self.worker_argv, self.env, self.logs[name])
        self.roles[self.worker.pid] = "worker"
        self.restarts.append({"exit_seen_at": exited, "returncode": code, "log": name})
        return True

    def log_sizes(self) -> dict[str, int]:
        return {name: path.stat().st_size if path.exists() else 0 for name, path in self.logs.items()}

    def stop(self) -> None:
        for proc in self.procs.values():
            stop(proc)


# ---- /proc sampling ----------------------------------------------------------------------------
def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _stat(pid: int) -> tuple[int, int, float, int] | None:
    """(ppid, pgrp, cpu seconds, rss bytes) of a live process."""
    raw = _read(f"/proc/{pid}/stat")
    if not raw:
        return None
    f = raw.rsplit(b")", 1)[1].split()
    return int(f[1]), int(f[2]), (int(f[11]) + int(f[12])) / CLK_TCK, int(f[21]) * PAGE


def _machine_times() -> tuple[int, int]:
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    return sum(f), f[3] + f[4]


class Sampler(threading.Thread):
    """Every second: CPU of every process by role (controller, node side, PostgreSQL, Redis, viewers),
    the controller's RSS, and the DB's count of copied lines. Exited processes keep their last reading."""

    def __init__(self, controller: Controller, redis: RedisServer, cluster, tags: set[str], viewers: list,
                 job_ids: list[int]) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.groups = controller.roles  # the controller adds a restarted worker here
        self.redis = redis
        self.listeners = {node.proc.pid for node in cluster.nodes if node.proc}
        self.tags = {f"UGRO_JOB={t}".encode() for t in tags}
        self.viewers = {v.pid for v in viewers}
        self.job_ids = job_ids
        self.role: dict[int, str | None] = {}
        self.sshd: set[int] = set()
        self.base: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self.rss: list[tuple[float, dict[str, int]]] = []
        self.db_lines: list[tuple[float, int]] = []
        self.cpu_timeline: list[tuple[float, dict[str, float]]] = []
        self.halt = threading.Event()
        self.window: tuple[float, float] | None = None
        self.machine0 = _machine_times()
        self.machine1 = self.machine0
        self.bench0 = os.times()

    def classify(self, pid: int, ppid: int, pgrp: int) -> str | None:
        if pgrp in self.groups:
            return self.groups[pgrp]
        if pgrp in self.viewers:
            return "viewers"
        if self.redis.proc is not None and pid == self.redis.proc.pid:
            return "redis"
        cmd = _read(f"/proc/{pid}/cmdline")
        if cmd.startswith(b"sshd") and (ppid in self.listeners or ppid in self.sshd):
            self.sshd.add(pid)
            return "node_sshd"
        # a backend of the bench's database on the system server, or of UGRO's own server (user and database ugro)
        if cmd.startswith(b"postgres: ") and (f" {DB_NAME} ".encode() in cmd or cmd.startswith(b"postgres: ugro ugro")):
            return "postgres_backends"
        env = _read(f"/proc/{pid}/environ").split(b"\0")
        if b"__ugro_agent__" in cmd and any(e.startswith(b"SSH_CONNECTION=") and f" {SUBNET}.".encode() in e
                                            for e in env):  # fmt: skip
            return "node_agents"
        if any(e in self.tags for e in env):
            return "node_ranks"
        return None

    def scan(self) -> dict[str, int]:
        rss: dict[str, int] = Counter()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            st = _stat(pid)
            if st is None:
                continue
            ppid, pgrp, cpu, size = st
            if pid not in self.role:
                self.role[pid] = self.classify(pid, ppid, pgrp)
            role = self.role[pid]
            if role is None:
                continue
            self.last[pid] = (role, cpu)
            if role in ROLES:
                rss[role] += size
        return rss

    def begin(self) -> None:
        """Start of the measured window: what each process has used so far does not count."""
        self.scan()
        self.base = {pid: cpu for pid, (_, cpu) in self.last.items()}
        self.machine0 = _machine_times()
        self.bench0 = os.times()
        self.window = (time.time(), 0.0)
        self.start()

    def run(self) -> None:
        from django.db import connection
        from django.db.models import Sum

        from jobs.models import Rank

        try:
            while not self.halt.wait(1.0):
                now = time.time()
                self.rss.append((now, dict(self.scan())))
                self.cpu_timeline.append((now, self.cpu_by_role()))
                lines = Rank.objects.filter(job_id__in=self.job_ids).aggregate(n=Sum("log_lines"))["n"] or 0
                self.db_lines.append((now, lines))
        finally:
            connection.close()

    def cpu_by_role(self) -> dict[str, float]:
        """CPU seconds used by each role since begin() (a process that exited: up to its last reading)."""
        cpu: dict[str, float] = Counter()
        for pid, (role, value) in self.last.items():
            cpu[role] += value - self.base.get(pid, 0.0)
        return cpu

    def timeline(self) -> list:
        """Per second of the window: [seconds since begin, {role: CPU seconds used in that second}], to see
        when each side was busy (the end of R10: every rank exits at once on the same two cores)."""
        out, before = [], {}
        for now, cpu in self.cpu_timeline:
            used = {r: round(v - before.get(r, 0.0), 2) for r, v in sorted(cpu.items())}
            out.append([round(now - self.window[0], 1), {r: v for r, v in used.items() if v >= 0.01}])
            before = cpu
        return out

    def end(self) -> dict:
        self.halt.set()
        self.join(timeout=30)
        rss = dict(self.scan())
        self.machine1 = _machine_times()
        t0 = self.window[0]
        seconds = time.time() - t0
        cpu = self.cpu_by_role()
        bench1 = os.times()
        cpu["bench_process"] = bench1.user - self.bench0.user + bench1.system - self.bench0.system
        controller = sum(cpu.get(r, 0.0) for r in ROLES)
        (a0, i0), (a1, i1) = self.machine0, self.machine1
        peaks = {r: max((s.get(r, 0) for _, s in self.rss), default=0) for r in ROLES}
        total_peak = max((sum(s.values()) for _, s in self.rss), default=0)
        mib = 2**20
        return {
            "seconds": round(seconds, 1),
            "cpu_seconds": {k: round(v, 2) for k, v in sorted(cpu.items())},
            "controller_cpu_seconds": round(controller, 2),
            "controller_cpu_percent_of_one_core": round(100 * controller / seconds, 1),
            "controller_cpu_percent_by_process": {
                r: round(100 * cpu.get(r, 0.0) / seconds, 1) for r in ROLES
            },
            "machine_busy_percent_of_all_cpus": round(100 * (1 - (i1 - i0) / max(1, a1 - a0)), 1),
            "controller_rss_mib_peak": {r: round(v / mib, 1) for r, v in peaks.items()},
            "controller_rss_mib_peak_total": round(total_peak / mib, 1),
            "controller_rss_mib_end": {r: round(rss.get(r, 0) / mib, 1) for r in ROLES},
            "controller_rss_mib_end_total": round(sum(rss.values()) / mib, 1),
        }


def controller_cpu(controller: Controller) -> float:
    total = 0.0
    groups = {p.pid for p in controller.procs.values()}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None and st[1] in groups:
            total += st[2]
    return total


def idle_cost(controller: Controller, seconds: float = 5.0) -> dict:
    """Controller CPU while the jobs run and their ranks wait silent for GO."""
    c0, m0, t0 = controller_cpu(controller), _machine_times(), time.monotonic()
    time.sleep(seconds)
    c1, m1, t1 = controller_cpu(controller), _machine_times(), time.monotonic()
    return {
        "seconds": round(t1 - t0, 1),
        "controller_cpu_percent_of_one_core": round(100 * (c1 - c0) / (t1 - t0), 1),
        "machine_busy_percent_of_all_cpus": round(100 * (1 - (m1[1] - m0[1]) / max(1, m1[0] - m0[0])), 1),
    }


# ---- jobs --------------------------------------------------------------------------------------
def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


_next_rdzv = [29760]


def launch_through_worker(names: list[str], extra: list[str]) -> list:
    """Create each job and let the worker start it (queue schedule_jobs), one after the other, each
    with a rendezvous port of its own; raises if one does not reach RUNNING."""
    from cluster.models import ClusterSettings
    from jobs.launch import LaunchRequest, create_job
    from jobs.models import Job
    from ugro_site.celery import send_task

    jobs = []
    for name in names:
        port = next(p for p in range(_next_rdzv[0], _next_rdzv[0] + 500) if port_free(p))
        _next_rdzv[0] = port + 1
        ClusterSettings.objects.filter(pk=1).update(rendezvous_port=port)
        job = create_job(LaunchRequest(name=name, count=3, script=RANK_FILE, nproc_per_node=1, extra_args=extra))
        if not send_task("jobs.tasks.schedule_jobs"):
            raise RuntimeError("could not queue schedule_jobs")
        wait_for(lambda j=job: Job.objects.filter(pk=j.pk).exclude(state__in=["queued", "starting"]).exists(), 120,
                 f"the worker to start {name}", 0.1)  # fmt: skip
        job.refresh_from_db()
        if job.state != Job.State.RUNNING:
            raise RuntimeError(f"{name} did not start: {job.state} {job.failure_reason}")
        jobs.append(job)
    return jobs


def ranks_of(jobs: list) -> list:
    from jobs.models import Rank

    return list(Rank.objects.filter(job__in=jobs).select_related("node", "job").order_by("job_id", "index"))


def node_file(rank, name: str) -> Path:
    return Path(rank.node.workdir) / name


def start_viewer(base: str, job_id: int, cookie: str, tmp: Path, label: str, max_seconds: float):
    out, ready = tmp / f"viewer-{label}.json", tmp / f"viewer-{label}.ready"
    url = base.replace("http://", "ws://") + f"/ws/jobs/{job_id}/"
    proc = subprocess.Popen([str(CONTROLLER_PY), __file__, "viewer", url, cookie, base, str(out), str(ready),
                             str(max_seconds)], stdout=open(tmp / f"viewer-{label}.log", "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return proc, out, ready


def end_viewer(proc: subprocess.Popen) -> None:
    """SIGTERM (the viewer writes what it has), then SIGKILL after 10 s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_group(proc)
        except ProcessLookupError:
            pass


def worker_dump(controller: Controller) -> dict:
    """The worker's threads (Celery dumps every thread's stack to its log on SIGUSR1), summarised:
    how many, and the ones inside cluster/links.py with their innermost frames."""
    path = controller.logs[next(n for n in reversed(list(controller.logs)) if n.startswith("worker"))]
    before = path.stat().st_size if path.exists() else 0
    threads = None
    try:
        status = Path(f"/proc/{controller.worker.pid}/status").read_text()
        threads = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Threads:")))
        os.kill(controller.worker.pid, signal.SIGUSR1)
    except (OSError, StopIteration):
        return {"worker_threads": threads, "worker_alive": controller.worker.poll() is None}
    time.sleep(3)
    text = path.read_bytes()[before:].decode("utf-8", "replace")
    stuck: Counter = Counter()
    for block in text.split("\n=================================================\n"):
        frames = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("File ")]
        if any("cluster/links.py" in f for f in frames):
            inner = " <- ".join(f.split("/")[-1].replace('", line ', ":").split(",")[0] for f in reversed(frames[-4:]))
            stuck[inner] += 1
    return {
        "worker_alive": controller.worker.poll() is None,
        "worker_threads": threads,
        "threads_in_links_py_by_innermost_frames": dict(stuck.most_common(8)),
        "stack_dump_in": path.name,
    }


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def kill_job_processes(tags: list[str]) -> int:
    """SIGKILL what the given jobs left running (bounded); returns how many were found the first time."""
    first = None
    for _ in range(50):
        pids = sorted({pid for tag in tags for pid in tagged_pids(tag)})
        first = len(pids) if first is None else first
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)
    return first or 0


# ---- checks after the run ----------------------------------------------------------------------
def metric_steps(data: bytes) -> tuple[int, list[int], int]:
    """(lines, steps of the benchmark's metric lines in order, other lines) of a log."""
    steps, other = [], 0
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for ln in lines:
        if ln.startswith(b'{"step": '):
            steps.append(int(ln[9 : ln.index(b",", 9)]))
        else:
            other += 1
    return len(lines), steps, other


def exact(steps_count: int, distinct: int, lo: int | None, hi: int | None, printed: int) -> bool:
    """A multiset of steps equals {0 .. printed-1} once: as many as printed, none twice, none outside."""
    if printed == 0:
        return steps_count == 0
    return steps_count == printed and distinct == printed and lo == 0 and hi == printed - 1


def check_jobs(jobs: list) -> tuple[dict, dict]:
    """Per-rank counts at every stage, and their totals; also returns per-rank commit times for viewers."""
    from django.db.models import Count, Max, Min

    from jobs.logs import times_path
    from jobs.models import Job
    from metrics.models import MetricPoint

    per_rank = []
    jsonl_sizes_ok = []
    commits: dict[tuple[int, int], tuple[list[int], list[float], dict[int, int]]] = {}
    db = {
        (r["job_id"], r["rank"]): r
        for r in MetricPoint.objects.filter(job__in=jobs, name="loss")
        .values("job_id", "rank")
        .annotate(n=Count("id"), d=Count("step", distinct=True), lo=Min("step"), hi=Max("step"))
    }
    other_points = MetricPoint.objects.filter(job__in=jobs).exclude(name="loss").count()
    for job in jobs:
        job = Job.objects.get(pk=job.pk)
        jsonl: dict[int, list[int]] = {}
        path = job.job_dir / "metrics.jsonl"
        raw = path.read_bytes() if path.exists() else b""
        jsonl_other = 0
        for ln in raw.splitlines():
            obj = json.loads(ln)
            if obj["name"] == "loss":
                jsonl.setdefault(obj["rank"], []).append(obj["step"])
            else:
                jsonl_other += 1
        for rank in ranks_of([job]):
            done_path = node_file(rank, f"rel-done-{job.tag}.json")
            done = json.loads(done_path.read_text()) if done_path.exists() else {"printed": 0}
            printed = done["printed"]
            node = Path(rank.remote_log).read_bytes() if Path(rank.remote_log).exists() else b""
            central = rank.local_log.read_bytes() if rank.local_log.exists() else b""
            node_lines, node_steps, node_other = metric_steps(node)
            central_lines, central_steps, _ = metric_steps(central)
            d = db.get((job.pk, rank.index), {"n": 0, "d": 0, "lo": None, "hi": None})
            js = jsonl.get(rank.index, [])
            js_distinct = len(set(js))
            # line end offsets of each step in the central log, and when each commit was made
            ends, stamps, step_end = [], [], {}
            tp = times_path(rank)
            if tp.exists():
                for ln in tp.read_text().splitlines():
                    off, ts = ln.split()
                    ends.append(int(off))
                    stamps.append(float(ts))
            pos = 0
            for ln in central.split(b"\n")[:-1]:
                pos += len(ln) + 1
                if ln.startswith(b'{"step": '):
                    step_end[int(ln[9 : ln.index(b",", 9)])] = pos
            commits[(job.pk, rank.index)] = (ends, stamps, step_end)
            per_rank.append({
                "job": job.name,
                "rank": rank.index,
                "node": rank.node.name,
                "rank_printed": printed,
                "rank_print_seconds": round(done.get("t_last", 0) - done.get("t_first", 0), 3),
                "rank_max_lag_s": done.get("max_lag_s"),
                "node_log_lines": node_lines,
                "node_log_metric_lines": len(node_steps),
                "node_log_other_lines": node_other,
                "central_log_lines": central_lines,
                "central_byte_equal_to_node_log": central == node,
                "db_rank_log_lines": rank.log_lines,
                "db_loss_points": d["n"],
                "db_loss_points_repeated": d["n"] - d["d"],
                "jsonl_loss_entries": len(js),
                "jsonl_loss_repeated": len(js) - js_distinct,
                "node_log_exact": exact(len(node_steps), len(set(node_steps)), min(node_steps, default=None),
                                        max(node_steps, default=None), printed),
                "central_exact": exact(len(central_steps), len(set(central_steps)), min(central_steps, default=None),
                                       max(central_steps, default=None), printed),
                "db_exact": exact(d["n"], d["d"], d["lo"], d["hi"], printed),
                "jsonl_exact": exact(len(js), js_distinct, min(js, default=None), max(js, default=None), printed),
                "rank_state": rank.state,
                "rank_exit_code": rank.exit_code,
                "node_released": not rank.active,
            })  # fmt: skip
        jsonl_sizes_ok.append(len(raw) == job.metrics_bytes)

    def total(key: str) -> int:
        return sum(r[key] for r in per_rank)

    totals = {
        "ranks": len(per_rank),
        "lines_printed_by_ranks": total("rank_printed"),
        "node_log_metric_lines": total("node_log_metric_lines"),
        "central_log_metric_lines": sum(len(commits[k][2]) for k in commits),
        "db_loss_points": total("db_loss_points"),
        "jsonl_loss_entries": total("jsonl_loss_entries"),
        "repeated_db": total("db_loss_points_repeated"),
        "repeated_jsonl": total("jsonl_loss_repeated"),
        "node_log_lines": total("node_log_lines"),
        "central_log_lines": total("central_log_lines"),
        "db_rank_log_lines": total("db_rank_log_lines"),
        "db_points_other_than_loss": other_points,
        "all_central_logs_byte_equal": all(r["central_byte_equal_to_node_log"] for r in per_rank),
        "all_stages_exact": all(
            r["node_log_exact"] and r["central_exact"] and r["db_exact"] and r["jsonl_exact"] for r in per_rank
        ),  # fmt: skip
        "all_jsonl_sizes_equal_committed": all(jsonl_sizes_ok),
        "all_nodes_released": all(r["node_released"] for r in per_rank),
    }
    totals["zero_lost_zero_repeated"] = (
        totals["all_stages_exact"]
        and totals["all_central_logs_byte_equal"]
        and totals["node_log_lines"] == totals["central_log_lines"] == totals["db_rank_log_lines"]
    )
    return {"totals": totals, "per_rank": per_rank}, commits


def check_viewers(viewers: list[dict], printed: dict[tuple[int, int], int], commits: dict) -> dict:
    """What each viewer received against what was printed; missing lines split into those committed while
    the viewer was disconnected (within 1 s before a close and its reopening) and the rest."""
    hist: Counter = Counter()
    by_job: dict[int, Counter] = {}
    rows = []
    lat_max = 0.0
    for v in viewers:
        data = v["data"]
        for k, c in data["latency_ms_hist"].items():
            hist[int(k)] += c
            by_job.setdefault(v["job_id"], Counter())[int(k)] += c
        lat_max = max(lat_max, data["latency_max_ms"])
        windows = [(a - 1.0, b if b is not None else float("inf")) for a, b in data["disconnected"]]
        missing = explained = received = repeated = 0
        for rank_s, rec in data["ranks"].items():
            rank = int(rank_s)
            key = (v["job_id"], rank)
            n = printed.get(key, 0)
            have = set()
            for a, b in rec["ranges"]:
                have.update(range(a, b + 1))
            received += rec["received"]
            repeated += rec["received"] - rec["distinct"]
            gone = [s for s in range(n) if s not in have]
            missing += len(gone)
            ends, stamps, step_end = commits.get(key, ([], [], {}))
            for s in gone:
                i = bisect.bisect_left(ends, step_end.get(s, -1))
                when = stamps[i] if i < len(stamps) else None
                if when is not None and any(a <= when <= b for a, b in windows):
                    explained += 1
        expected = sum(c for (j, _), c in printed.items() if j == v["job_id"])
        missing += sum(c for (j, r), c in printed.items() if j == v["job_id"] and str(r) not in data["ranks"])
        rows.append({
            "viewer": v["label"],
            "expected": expected,
            "received": received,
            "repeated": repeated,
            "missing": missing,
            "missing_while_disconnected": explained,
            "missing_unexplained": missing - explained,
            "other_lines": data["other_lines"],
            "closes": len(data["closes"]),
            "close_reasons": sorted({c[1][:120] for c in data["closes"]}),
            "disconnected_s": round(sum((b or data["t_end"]) - a for a, b in data["disconnected"]), 2),
            "exit": v["exit"],
        })  # fmt: skip
    n = sum(hist.values())

    def q(p: float, h: Counter = hist) -> float | None:
        total = sum(h.values())
        if not total:
            return None
        want, acc = p / 100 * total, 0
        for k in sorted(h):
            acc += h[k]
            if acc >= want:
                return float(k)
        return float(max(h))

    return {
        "viewers": len(rows),
        "lines_expected_total": sum(r["expected"] for r in rows),
        "lines_received_total": sum(r["received"] for r in rows),
        "repeated_total": sum(r["repeated"] for r in rows),
        "missing_total": sum(r["missing"] for r in rows),
        "missing_while_disconnected_total": sum(r["missing_while_disconnected"] for r in rows),
        "missing_unexplained_total": sum(r["missing_unexplained"] for r in rows),
        "latency_ms": {
            "samples": n,
            "p50": q(50),
            "p90": q(90),
            "p99": q(99),
            "max": round(lat_max, 1),
            "resolution_ms": 1,
        },  # fmt: skip
        "latency_ms_by_job": {job: {"samples": sum(h.values()), "p50": q(50, h), "p99": q(99, h)}
                              for job, h in sorted(by_job.items())},  # fmt: skip
        "per_viewer": rows,
    }


def log_slice(path: Path, start: int, end: int | None = None) -> dict:
    data = path.read_bytes()[start:end] if path.exists() else b""
    lines = data.decode("utf-8", "replace").splitlines()
    heads = []
    for ln in lines:
        head = ln[:160]
        if ln and not ln.startswith(" ") and head not in heads and len(heads) < 12:
            heads.append(head)
    return {"lines": len(lines), "traceback_lines": sum(TRACEBACK in ln for ln in lines), "distinct_heads": heads}


def pause(until: float, controller: Controller) -> None:
    """Sleep until a wall-clock time, restarting the worker meanwhile if it exits."""
    while time.time() < until:
        controller.revive_worker()
        time.sleep(max(0.0, min(0.2, until - time.time())))


def supervised(controller: Controller, predicate):
    """A wait_for predicate that also restarts the worker if it has exited."""

    def check():
        controller.revive_worker()
        return predicate()

    return check


def timeline(sampler: Sampler, t_go: float) -> list[list[float]]:
    return [[round(t - t_go, 1), n] for t, n in sampler.db_lines]


# ---- one scenario ------------------------------------------------------------------------------
def run_scenario(kind: str, label: str, n_jobs: int, rate: float, seconds: float, env: dict, tmp: Path, cluster,
                 redis: RedisServer, cookie: str, outage_at: float = 0.0, outage: float = 0.0,
                 end_timeout: float = 300.0, ranks_nice: int = 0) -> dict:  # fmt: skip
    from jobs.models import Job

    t_scn = time.monotonic()
    subprocess.run(["redis-cli", "-p", str(redis.port), "flushall"], capture_output=True, timeout=30, check=True)
    controller = Controller(env, tmp, label)
    viewers: list = []
    tags: list[str] = []
    sampler = None
    cut = None  # rcut's dropped node; the cleanup below reads it even when the launch failed
    try:
        go_name = f"rel-GO-{label}"
        extra = ["--rel-rate", f"{rate:g}", "--rel-seconds", f"{seconds:g}", "--rel-go", go_name]
        t0 = time.monotonic()
        jobs = launch_through_worker([f"{label}-{i}" for i in range(n_jobs)], extra)
        launch_s = time.monotonic() - t0
        tags = [j.tag for j in jobs]
        ranks = ranks_of(jobs)
        wait_for(lambda: all(node_file(r, f"rel-ready-{r.job.tag}").exists() for r in ranks), 300,
                 "every rank to be up and waiting for GO", 0.2)  # fmt: skip
        ready_s = time.monotonic() - t0
        ids = [j.pk for j in jobs]
        wait_for(lambda: not Job.objects.filter(pk__in=ids, current__follower="").exists(), 60,
                 "the worker to follow every job", 0.2)  # fmt: skip
        max_view = seconds + 600
        for j in jobs:
            for k in range(2):
                proc, out, ready = start_viewer(controller.base, j.pk, cookie, tmp, f"{label}-{j.pk}-{k}", max_view)
                viewers.append({"proc": proc, "out": out, "ready": ready, "job_id": j.pk, "label": f"{j.name}/{k}"})
        wait_for(lambda: all(v["ready"].exists() or v["proc"].poll() is not None for v in viewers), 60,
                 "every viewer to connect", 0.1)  # fmt: skip
        if not all(v["ready"].exists() for v in viewers):
            raise RuntimeError("a viewer did not connect: see " + str(tmp))
        idle = idle_cost(controller)
        print(f"[{label}] {n_jobs} jobs running, {len(viewers)} viewers; idle controller: {idle}", flush=True)

        if ranks_nice:  # see --ranks-nice: wrapper, torchrun and the rank, all started and waiting for GO
            for pid in sorted({pid for tag in tags for pid in tagged_pids(tag)}):
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, pid, ranks_nice)
                    # With the kernel's autogroups each session is scheduled as one: a process's niceness
                    # only counts inside its session, and every rank runs in a session of its own.
                    Path(f"/proc/{pid}/autogroup").write_text(str(ranks_nice))
        sampler = Sampler(controller, redis, cluster, set(tags), [v["proc"] for v in viewers], ids)
        sampler.begin()
        t_go = time.time()
        for r in ranks:
            node_file(r, go_name).write_text("go")
        outage_info = None
        if kind == "rcut":
            # one node of the last job goes silent: every packet dropped, that job's processes there frozen
            from tests.loopback import on_node

            victim = next(r for r in ranks if r.job.pk == jobs[-1].pk)
            pause(t_go + outage_at, controller)
            cut = Drop(victim.node.address)
            cut.apply()
            frozen = on_node(tagged_pids(jobs[-1].tag), victim.node.name)
            for pid in frozen:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGSTOP)
            t_down = time.time()
            pause(t_down + outage, controller)
            cut.undo()
            for pid in frozen:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)
            t_back = time.time()
            cut_job = Job.objects.get(pk=jobs[-1].pk)
            outage_info = {"t_down": t_down, "t_back": t_back, "node": victim.node.name, "job": cut_job.name,
                           "job_state_at_back": cut_job.state, "job_failure": cut_job.failure_reason[:300]}  # fmt: skip
            print(f"[{label}] {victim.node.name} silent from GO+{t_down - t_go:.1f}s to GO+{t_back - t_go:.1f}s; "
                  f"{cut_job.name}: {cut_job.state}", flush=True)  # fmt: skip
        if kind == "r3":
            pause(t_go + outage_at, controller)
            sizes_down = controller.log_sizes()
            t_down = time.time()
            redis.stop()
            pause(time.time() + outage, controller)
            redis.start()
            t_back = time.time()
            print(f"[{label}] Redis stopped at GO+{t_down - t_go:.1f}s, back at GO+{t_back - t_go:.1f}s", flush=True)
            pause(t_back + 5, controller)
            from ugro_site.celery import worker_alive

            worker_log = controller.logs["worker"].read_text(errors="replace")
            after_5s = {
                "worker_process_running": controller.worker.poll() is None,
                "worker_restarted_by_bench": bool(controller.restarts),
                "heartbeat_key_present": worker_alive(),
                "worker_logged_unrecoverable_error": "Unrecoverable error" in worker_log,
            }
            pause(t_back + 30, controller)
            sizes_after = controller.log_sizes()
            outage_info = {"t_down": t_down, "t_back": t_back, "sizes_down": sizes_down, "sizes_after": sizes_after,
                           "five_s_after_back": after_5s}  # fmt: skip
        # the cut job's ranks never finish printing: the others do
        done = [node_file(r, f"rel-done-{r.job.tag}.json") for r in ranks if not (cut and r.job.pk == jobs[-1].pk)]
        wait_for(supervised(controller, lambda: all(p.exists() for p in done)), seconds + 600,
                 "every rank to finish printing", 0.2)  # fmt: skip
        t_printed = time.time()
        ended = lambda: not Job.objects.filter(pk__in=ids).exclude(state__in=list(TERMINAL)).exists()  # noqa: E731
        stuck = None
        try:
            wait_for(supervised(controller, ended), end_timeout, "every job to end", 0.2)
        except TimeoutError:
            # Reported, not raised: what arrived where is still worth counting, and why it hangs.
            stuck = {"waited_s_after_all_printed": round(time.time() - t_printed, 1), **worker_dump(controller)}
            print(f"[{label}] jobs not ended {stuck['waited_s_after_all_printed']} s after the last print", flush=True)
        t_final = time.time()
        for v in viewers:
            try:
                v["proc"].wait(timeout=max(5.0, t_final + 60 - time.time()) if stuck is None else 1.0)
            except subprocess.TimeoutExpired:
                end_viewer(v["proc"])
        usage = sampler.end()
        samp, sampler = sampler, None
    finally:
        if cut is not None:
            cut.undo()
        if sampler is not None:
            sampler.halt.set()
        for v in viewers:
            end_viewer(v["proc"])
        controller.stop()
        left = kill_job_processes(tags)

    # ---- what arrived where
    checks, commits = check_jobs(jobs)
    printed = {(next(j.pk for j in jobs if j.name == r["job"]), r["rank"]): r["rank_printed"]
               for r in checks["per_rank"]}  # fmt: skip
    loaded = []
    for v in viewers:
        data = json.loads(v["out"].read_text()) if v["out"].exists() else None
        if data is None:
            raise RuntimeError(f"viewer {v['label']} wrote nothing: see {tmp}")
        loaded.append({"label": v["label"], "job_id": v["job_id"], "data": data, "exit": v["proc"].returncode})
    view = check_viewers(loaded, printed, commits)
    states = Counter(Job.objects.filter(pk__in=ids).values_list("state", flat=True))
    failed = Job.objects.filter(pk__in=ids).exclude(current__failure_reason="")
    failures = list(failed.values_list("name", "current__failure_reason"))
    done_data = [json.loads(p.read_text()) for p in done]
    first_print = min(d["t_first"] for d in done_data)
    last_print = max(d["t_last"] for d in done_data)
    lines_total = checks["totals"]["node_log_lines"]
    db = samp.db_lines
    in_window = [(t, n) for t, n in db if first_print <= t <= last_print]
    db_rate = None
    if len(in_window) >= 2:
        db_rate = round((in_window[-1][1] - in_window[0][1]) / max(1e-9, in_window[-1][0] - in_window[0][0]))
    caught_up = next((t for t, n in db if n >= lines_total), None)
    summary = {
        "jobs": n_jobs,
        "ranks": len(ranks),
        "rate_per_rank_lines_per_s": rate,
        "seconds_per_rank": seconds,
        "target_lines_per_s_all_ranks": rate * len(ranks),
        "launch_through_worker_s": round(launch_s, 1),
        "launch_to_all_ranks_waiting_for_go_s": round(ready_s, 1),
        "idle_before_go": idle,
        "print_window_s": round(last_print - first_print, 2),
        "printed_lines_per_s_all_ranks": round(
            checks["totals"]["lines_printed_by_ranks"] / max(1e-9, last_print - first_print)
        ),  # fmt: skip
        "rank_max_lag_s": max(d.get("max_lag_s") or 0 for d in done_data),
        "last_print_to_all_jobs_final_s": round(t_final - last_print, 2) if stuck is None else None,
        "go_to_all_printed_s": round(t_printed - t_go, 2),
        "job_states": dict(states),
        "jobs_not_ended": stuck,
        "failure_reasons": failures,
        "processes_left_after_controller_stop": left,
        "worker_restarts_by_bench": [
            {**r, "exit_seen_at_s_after_go": round(r.pop("exit_seen_at") - t_go, 2)} for r in controller.restarts
        ],
        "stages": checks["totals"],
        "viewers": view,
        "db_lines_per_s_while_printing": db_rate,
        "last_print_to_db_complete_s": round(caught_up - last_print, 2) if caught_up else None,
        "db_lines_timeline": timeline(samp, t_go),
        "cpu_timeline": samp.timeline(),
        "usage_go_to_end": usage,
        "scenario_wall_s": round(time.monotonic() - t_scn, 1),
    }
    return {"summary": summary, "per_rank": checks["per_rank"], "_go": t_go, "_outage": outage_info,
            "_controller": controller, "_loaded": loaded}  # fmt: skip


def outage_report(result: dict) -> dict:
    """R3: when each viewer was connected and received lines again after Redis came back; what the
    controller's logs said from the stop until 30 s after the restart."""
    info, controller, go = result["_outage"], result["_controller"], result["_go"]
    t_down, t_back = info["t_down"], info["t_back"]
    viewers = []
    for v in result["_loaded"]:
        d = v["data"]
        closes = [c for c in d["closes"] if c[0] >= t_down - 1]
        opens = [t for t in d["opens"] if t >= t_down]
        first_open = next((t for t in opens if t >= t_back), None)
        first_lines = next((e[0] for e in d["events"] if e[0] >= t_back and e[2] > 0), None)
        last_before = max((e[0] for e in d["events"] if e[0] < t_down), default=None)
        viewers.append({
            "viewer": v["label"],
            "closed_during_outage": len([c for c in closes if c[0] <= t_back]),
            "failed_reconnects_during_outage": max(0, len([c for c in closes if c[0] <= t_back]) - 1),
            "first_close_after_stop_s": round(closes[0][0] - t_down, 2) if closes else None,
            "reopened_after_back_s": round(first_open - t_back, 2) if first_open else None,
            "new_lines_after_back_s": round(first_lines - t_back, 2) if first_lines else None,
            "last_lines_before_stop_s": round(t_down - last_before, 2) if last_before else None,
            "close_reasons": sorted({c[1][:120] for c in closes}),
        })  # fmt: skip
    logs = {
        name: log_slice(path, info["sizes_down"].get(name, 0), info["sizes_after"].get(name))
        for name, path in controller.logs.items()
    }
    whole = {name: log_slice(path, 0) for name, path in controller.logs.items()}
    db = result["summary"]["db_lines_timeline"]
    during = [n for t, n in db if t_down - go <= t <= t_back - go]
    return {
        "redis_stopped_at_s_after_go": round(t_down - go, 2),
        "redis_back_at_s_after_go": round(t_back - go, 2),
        "outage_s": round(t_back - t_down, 2),
        "five_s_after_back": info["five_s_after_back"],
        "db_lines_copied_during_outage": (during[-1] - during[0]) if len(during) >= 2 else None,
        "viewers": viewers,
        "logs_from_stop_to_back_plus_30s": logs,
        "traceback_lines_stop_to_back_plus_30s": {k: v["traceback_lines"] for k, v in logs.items()},
        "traceback_lines_whole_run": {k: v["traceback_lines"] for k, v in whole.items()},
        "log_lines_whole_run": {k: v["lines"] for k, v in whole.items()},
    }


# ---- the viewer (a process of its own, so the benchmark's work never delays a receive) ----------
def viewer(url: str, cookie: str, origin: str, out: str, ready: str, max_seconds: float) -> None:
    """Reconnect as the job page does (on close only, 0.5 s doubling to 15 s, reset on open); count every
    metric line per rank (run-length ranges of steps), its delay, and when the viewer was disconnected."""
    import asyncio

    from websockets.asyncio.client import connect

    def on_term(*_):
        raise KeyboardInterrupt  # the results below are written on the way out

    signal.signal(signal.SIGTERM, on_term)
    steps: dict[int, Counter] = {}
    hist: Counter = Counter()
    st = {"lat_max": 0.0, "other": 0, "ended_at": None, "down_since": None}
    closes, opens, disconnected, events = [], [], [], []

    def take(msg: dict, t: float) -> None:
        data = msg.get("data") or {}
        kind = msg.get("kind")
        if kind == "state" and data.get("state") in TERMINAL:
            st["ended_at"] = time.monotonic()
        if kind == "batch":  # a follower's pass: one part per rank, each shaped as a "lines" event
            for part in data.get("parts") or []:
                take({"kind": "lines", "data": part}, t)
            return
        if kind != "lines":
            return
        rank = int(data.get("rank", -1))
        seen = steps.setdefault(rank, Counter())
        n = 0
        for ln in data.get("lines") or []:
            if not ln.startswith('{"step": '):
                st["other"] += 1
                continue
            try:
                step = int(ln[9 : ln.index(",", 9)])
                t_print = float(ln[ln.rindex('"t": "') + 6 : -2])
            except ValueError:
                st["other"] += 1
                continue
            seen[step] += 1
            n += 1
            ms = (t - t_print) * 1000.0
            hist[int(ms)] += 1
            st["lat_max"] = max(st["lat_max"], ms)
        if len(events) < 200_000:
            events.append([round(t, 4), rank, n])

    async def session(deadline: float) -> None:
        headers = {"Cookie": f"sessionid={cookie}"}
        # Browsers answer pings but never send their own: no client keepalive.
        async with connect(url, additional_headers=headers, origin=origin, max_size=2**26, ping_interval=None,
                           open_timeout=10) as ws:  # fmt: skip
            t = time.time()
            opens.append(t)
            if st["down_since"] is not None:
                disconnected.append([st["down_since"], t])
                st["down_since"] = None
            Path(ready).write_text("ok")
            st["delay"] = PAGE_RECONNECT_FIRST_S
            while time.monotonic() < deadline:
                ended_at = st["ended_at"]
                wait = 1.0 if ended_at is None else max(0.01, ended_at + 2.0 - time.monotonic())
                try:
                    raw = await asyncio.wait_for(ws.recv(), timeout=wait)
                except TimeoutError:
                    if ended_at is not None:
                        return  # two quiet seconds after the end: everything is in
                    continue
                take(json.loads(raw), time.time())

    async def main() -> None:
        deadline = time.monotonic() + max_seconds
        st["delay"] = PAGE_RECONNECT_FIRST_S
        for _ in range(10_000):  # bounded; the deadline ends it long before
            try:
                await session(deadline)
                return
            except Exception as exc:  # a close, a refused connect, a failed handshake: the page's onclose
                t = time.time()
                closes.append([t, f"{type(exc).__name__}: {exc}"])
                if st["down_since"] is None and opens:
                    st["down_since"] = t
                if time.monotonic() >= deadline or st["ended_at"] is not None:
                    return
                await asyncio.sleep(st["delay"])
                st["delay"] = min(st["delay"] * 2, PAGE_RECONNECT_MAX_S)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        t_end = time.time()
        if st["down_since"] is not None:
            disconnected.append([st["down_since"], None])
        ranks = {}
        for rank, seen in steps.items():
            ranges: list[list[int]] = []
            for s in sorted(seen):
                if ranges and s == ranges[-1][1] + 1:
                    ranges[-1][1] = s
                else:
                    ranges.append([s, s])
            ranks[str(rank)] = {"received": sum(seen.values()), "distinct": len(seen), "ranges": ranges}
        Path(out).write_text(json.dumps({
            "ranks": ranks, "latency_ms_hist": {str(k): v for k, v in hist.items()},
            "latency_max_ms": round(st["lat_max"], 2), "other_lines": st["other"], "closes": closes, "opens": opens,
            "disconnected": disconnected, "events": events, "t_end": t_end,
        }))  # fmt: skip


# ---- main --------------------------------------------------------------------------------------
def cleanup(cluster, redis: RedisServer | None, tmp: Path, keep: bool) -> None:
    try:
        from jobs.models import Attempt

        kill_job_processes(list(Attempt.objects.values_list("tag", flat=True)))
    except Exception as exc:
        print("could not list the bench's jobs:", exc)
    if cluster is not None:
        cluster.stop()
    try:
        from cluster.links import pool

        pool.close_all()
    except Exception:
        pass
    if redis is not None:
        stop(redis.proc)
    try:
        from django.db import connections

        connections.close_all()
    except Exception:
        pass
    data = tmp / "ugro-data"
    if (data / "postgres" / "postmaster.pid").exists():
        from ugro_site import localdb

        localdb.stop(data)  # the private server, kept on disk with --keep
    if not keep:
        try:
            psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        except Exception as exc:
            print("could not drop the bench database:", exc)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--only", default="r3,r10", help="which scenarios: r3, r10 or both")
    ap.add_argument("--r10-jobs", default="3,10", help="job counts for R10 (3 ranks each), run in this order")
    ap.add_argument("--r10-rate", type=float, default=1000.0)
    ap.add_argument("--r10-seconds", type=float, default=60.0)
    ap.add_argument("--r3-rate", type=float, default=50.0)
    ap.add_argument("--r3-seconds", type=float, default=60.0)
    ap.add_argument("--outage-at", type=float, default=15.0, help="seconds after GO the Redis is stopped")
    ap.add_argument("--outage", type=float, default=10.0, help="seconds the Redis stays down")
    ap.add_argument("--nodes", type=int, default=0, help="start at least this many nodes (default: what R10 needs)")
    ap.add_argument(
        "--end-timeout",
        type=float,
        default=300.0,
        help="seconds after the last print the jobs may take to end before the scenario reports them stuck",
    )
    ap.add_argument(
        "--ranks-nice",
        type=int,
        default=0,
        help="run the jobs' processes on the nodes (wrapper, torchrun, rank) at this niceness (agents stay at 0)",
    )
    ap.add_argument("--suffix", default="", help="store the entries as LABEL-SUFFIX (r10-10jobs-SUFFIX)")
    ap.add_argument("--note", default="")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--db", choices=["private", "system"], default="private",
                    help="UGRO's own PostgreSQL as bin/start runs it (default), or a database on 127.0.0.1:5432")
    args = ap.parse_args()
    if not 0 <= args.ranks_nice <= 19:
        sys.exit("--ranks-nice: 0 to 19")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if not only <= {"r3", "r10", "rcut"}:
        sys.exit(f"--only: unknown scenario in {args.only!r} (r3, r10, rcut)")
    sizes = [int(x) for x in args.r10_jobs.split(",") if x.strip()] if "r10" in only else []
    if any(n < 1 for n in sizes):
        sys.exit("--r10-jobs: job counts must be at least 1")
    if not NODE_ENV.joinpath("bin", "torchrun").exists():
        sys.exit(f"no torchrun in the node env {NODE_ENV} (bin/setup --node-env, or UGRO_NODE_ENV)")

    tmp = make_tmp("ugro-bench-rel-")
    cluster, redis = None, None
    results: dict[str, dict] = {}
    t_start = time.monotonic()
    try:
        redis = RedisServer(tmp)
        redis.start()
        env = setup(tmp, redis.url, args.db)
        info = dash_machine_info()
        info["database"] = (f"PostgreSQL (127.0.0.1:5432, database {DB_NAME})" if args.db == "system"
                            else "UGRO's own PostgreSQL in the data dir (socket), as bin/start runs it")  # fmt: skip
        info["channel_layer"] = f"channels_redis, the benchmark's own redis-server on 127.0.0.1:{redis.port}"
        cluster = start_cluster(tmp, max(args.nodes, 3 * max([1, *sizes, 3 if "rcut" in only else 1])))
        cookie = session_cookie()
        plan = []
        if "r3" in only:
            plan.append(("r3", "r3", 1, args.r3_rate, args.r3_seconds))
        plan += [("r10", f"r10-{n}jobs", n, args.r10_rate, args.r10_seconds) for n in sizes]
        if "rcut" in only:  # R10's load at 3 jobs, one node of the third cut off for --outage s from --outage-at
            plan.append(("rcut", "rcut-3jobs", 3, args.r10_rate, args.r10_seconds))
        for kind, label, n, rate, seconds in plan:
            load0 = [round(x, 2) for x in os.getloadavg()]
            print(f"[{label}] starting: {n} job(s) x 3 ranks, {rate:g} lines/s per rank for {seconds:g}s", flush=True)
            res = run_scenario(kind, label, n, rate, seconds, env, tmp, cluster, redis, cookie,
                               outage_at=args.outage_at, outage=args.outage, end_timeout=args.end_timeout,
                               ranks_nice=args.ranks_nice)  # fmt: skip
            entry = {"summary": res["summary"], "per_rank": res["per_rank"]}
            entry["db_lines_timeline"] = entry["summary"].pop("db_lines_timeline")
            entry["cpu_timeline"] = entry["summary"].pop("cpu_timeline")
            if kind == "r3":
                entry["outage"] = outage_report(
                    {**res, "summary": {**res["summary"], "db_lines_timeline": entry["db_lines_timeline"]}}
                )
            if kind == "rcut":
                info = res["_outage"]
                entry["cut"] = {
                    **{k: v for k, v in info.items() if not k.startswith("t_")},
                    "from_go_s": round(info["t_down"] - res["_go"], 1),
                    "seconds": round(info["t_back"] - info["t_down"], 1),
                }
            entry["loadavg_before_after"] = [load0, [round(x, 2) for x in os.getloadavg()]]
            results[f"{label}-{args.suffix}" if args.suffix else label] = entry
            shown = {k: v for k, v in entry.items() if k not in ("per_rank", "db_lines_timeline", "cpu_timeline")}
            print(json.dumps(shown, indent=1)[:6000], flush=True)
    finally:
        cleanup(cluster, redis, tmp, args.keep)

    path = RESULTS / "reliability.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data["method"] = __doc__.split("\n\n", 2)[2].strip()
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    info["bench_wall_s"] = round(time.monotonic() - t_start, 1)
    names = ("r10_rate", "r10_seconds", "r3_rate", "r3_seconds", "outage_at", "outage", "ranks_nice")
    params = {k: getattr(args, k) for k in names}
    for label, entry in results.items():
        data.setdefault("scenarios", {})[label] = {"machine": info, "params": params, "note": args.note, **entry}
    write_json(path, data)
    print("wrote", path)


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "viewer":
        viewer(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6], float(sys.argv[7]))
    else:
        main()
