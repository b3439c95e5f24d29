"""A real UGRO worker for the benchmarks that time a command handing work to it (launch_fanout, first_step).

Started as bin/start starts it (`bin/worker`: Celery with beat on a thread, thread pool), on the benchmark's
Redis database (_common.BENCH_REDIS) and throwaway database, in a session of its own. Between its trials it
is paused (SIGSTOP, never inside a database transaction, heartbeat key deleted) so that it takes no CPU and
no job while other methods run; resumed (SIGCONT, heartbeat back) before each of its trials.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from _common import BENCH_REDIS, REPO

HEARTBEAT_KEY = "ugro:worker-alive"  # ugro_site.celery.HEARTBEAT_KEY
# The worker's PGAPPNAME (libpq's default application_name): its database sessions are told apart from the
# benchmark's own, daphne's and the commands' in pg_stat_activity.
WORKER_APP = "ugro-bench-worker"


def bench_redis():
    import redis

    return redis.Redis.from_url(BENCH_REDIS, socket_timeout=2, socket_connect_timeout=2)


def heartbeat_present() -> bool:
    """What ugro_site.celery.worker_alive() answers for a command pointed at BENCH_REDIS."""
    return bool(bench_redis().exists(HEARTBEAT_KEY))


def worker_out_of_transactions() -> bool:
    """Whether no database session of the worker is inside a transaction or holds a lock right now. A worker
    paused inside one would keep its row locks (a job's, a node's, a GPU's) and its snapshot until resumed:
    the launches of the other methods would wait on them. Read through this process's Django connection, in
    autocommit: each query sees pg_stat_activity afresh."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity AS a WHERE a.datname = current_database()"
            " AND a.application_name = %s"
            " AND (a.xact_start IS NOT NULL OR EXISTS (SELECT 1 FROM pg_locks AS l WHERE l.pid = a.pid))",
            [WORKER_APP],
        )
        return cursor.fetchone()[0] == 0


class Worker:
    """`bin/worker -n bench@%h` in its own session; pause() and resume() around its trials."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env = tmp, {**env, "PGAPPNAME": WORKER_APP}
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self.log = tmp / "worker.log"
        self.pause_retries = 0
        self.argv = [str(REPO / "bin" / "worker"), "-n", "bench@%h"]

    def start(self, timeout: float = 90.0) -> float:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        t0 = time.monotonic()
        self.wait_alive(timeout)
        return time.monotonic() - t0

    def wait_alive(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not heartbeat_present():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}): {self.log.read_text()[-1500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no worker heartbeat after {timeout:.0f}s: {self.log.read_text()[-1500:]}")
            time.sleep(0.05)

    def group_pids(self) -> list[int]:
        """The worker and any children: its process group."""
        out = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                if os.getpgid(int(name)) == self.proc.pid:
                    out.append(int(name))
            except (ProcessLookupError, PermissionError):
                pass
        return out

    def cpu(self) -> float:
        """CPU seconds (user+sys, threads and reaped children included) of the worker's process group."""
        tick, total = os.sysconf("SC_CLK_TCK"), 0
        for pid in self.group_pids():
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        return total / tick

    def pause(self) -> None:
        """SIGSTOP the worker, never while it is inside a transaction; drop its heartbeat."""
        for _ in range(50):
            os.killpg(self.proc.pid, signal.SIGSTOP)
            if worker_out_of_transactions():
                break
            os.killpg(self.proc.pid, signal.SIGCONT)
            self.pause_retries += 1
            time.sleep(0.1)
        else:
            raise RuntimeError("the worker stayed inside a database transaction for 5 s")
        self.paused = True
        bench_redis().delete(HEARTBEAT_KEY)  # a command now sees no worker, as with none running

    def resume(self, settle: float = 1.0) -> None:
        """SIGCONT; wait for its heartbeat, then let beat's catch-up ticks (missed while paused) pass."""
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.paused = False
        self.wait_alive(15.0)
        time.sleep(settle)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for pid in self.group_pids():  # children of the group that outlived the leader
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            bench_redis().delete(HEARTBEAT_KEY)
        except Exception:  # noqa: BLE001 - the key expires by itself in 10 s
            pass
