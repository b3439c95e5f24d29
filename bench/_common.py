"""Shared pieces of the launch benchmarks: a throwaway Django setup, tagged-process scans, cleanup.

All loopback nodes are this machine, so "is the rank running on node X" is answered by reading
/proc/*/environ for the UGRO_JOB=<tag> marker every rank carries.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
RESULTS = BENCH / "results"
CONTROLLER_PY = REPO / ".venv" / "bin" / "python"
NODE_ENV = Path(os.environ.get("UGRO_NODE_ENV", REPO / ".venv-node"))
NODE_PY = NODE_ENV / "bin" / "python"
NODE_TORCHRUN = NODE_ENV / "bin" / "torchrun"
SUBNET = "127.0.1"  # never 127.0.0.x: the test suite's loopback nodes live there
SSH_OPTS = [
    "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
    "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
]  # fmt: skip
# Celery's broker must not reach anybody's Redis: a closed loopback port fails at once.
DEAD_REDIS = "redis://127.0.0.1:9/0"
# The benchmarks that run a real Celery worker (and the `ugro` commands beside it) use this Redis
# database, flushed before and after: one of the benchmark's own, never another run's.
BENCH_REDIS = os.environ.get("UGRO_BENCH_REDIS_URL", "redis://127.0.0.1:6379/11")


def ugro_env(tmp: Path, database_url: str) -> dict[str, str]:
    """Environment for a throwaway UGRO: its own database (bench/_db.py's throwaway_database) and data dir
    under tmp."""
    data = tmp / "ugro-data"
    data.mkdir(parents=True, exist_ok=True)
    return {
        "DATABASE_URL": database_url,
        "UGRO_DATA_DIR": str(data),
        "REDIS_URL": DEAD_REDIS,
        "DJANGO_SETTINGS_MODULE": "ugro_site.settings",
    }


def setup_django(tmp: Path, database_url: str, migrate: bool = True) -> dict[str, str]:
    """Point UGRO at a throwaway database (its URL, from bench/_db.py's throwaway_database) and a data dir
    in tmp, then django.setup() (and migrate)."""
    env = ugro_env(tmp, database_url)
    os.environ.update(env)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import django

    django.setup()
    if migrate:
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        os_operator()
    return env


def os_operator() -> None:
    """An operator account named like the OS user: `manage.py` commands run as it (accounts/commands.py)."""
    import getpass

    from django.contrib.auth.models import Group, User

    user, _ = User.objects.get_or_create(username=getpass.getuser())
    user.groups.add(Group.objects.get(name="operator"))


def node_rows(cluster) -> list:
    """One Node row per node of a tests.loopback.LoopbackCluster (the first the master), in its order."""
    from cluster.models import Node

    return [
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


def make_tmp(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def tagged_pids(tag: str, prefix: bool = False) -> list[int]:
    """Every process on this machine whose environment carries UGRO_JOB=<tag> (or UGRO_JOB=<tag>...)."""
    want = f"UGRO_JOB={tag}".encode()
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        env = _read(f"/proc/{name}/environ")
        if not env:
            continue
        entries = env.split(b"\0")
        if any(e.startswith(want) for e in entries) if prefix else want in entries:
            out.append(int(name))
    return out


def kill_tagged(tag: str, timeout: float = 15.0, prefix: bool = False) -> int:
    """SIGKILL every process carrying the tag and wait (bounded) until none is left; returns survivors.

    prefix=True: every process whose UGRO_JOB starts with `tag` (a job name plus "-", before the
    benchmark knows the tag UGRO chose).
    """
    deadline = time.monotonic() + timeout
    while True:
        pids = tagged_pids(tag, prefix)
        if not pids:
            return 0
        if time.monotonic() > deadline:
            return len(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def bashrc_cost(samples: int = 5) -> dict[str, float]:
    """What root's .bashrc adds to every SSH command: sshd runs `bash -c CMD`, which sources it.

    Wall time (median) and CPU time (user+sys of the shell and its children, median) per run.
    """

    def measure(argv: list[str]) -> tuple[float, float]:
        walls, cpus = [], []
        for _ in range(samples):
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.monotonic()
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            walls.append(time.monotonic() - t0)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        return statistics.median(walls), statistics.median(cpus)

    bare_wall, bare_cpu = measure(["bash", "--norc", "-c", "true"])
    rc_wall, rc_cpu = measure(["bash", "-c", ". ~/.bashrc; true"])
    return {
        "bash_norc_wall_s": round(bare_wall, 4),
        "bash_with_bashrc_wall_s": round(rc_wall, 4),
        "bashrc_extra_wall_s": round(rc_wall - bare_wall, 4),
        "bashrc_extra_cpu_s": round(rc_cpu - bare_cpu, 4),
    }


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields), idle


def cpu_busy(window: float = 0.3) -> float:
    """Fraction of all CPUs busy over the next `window` seconds (other people's work included)."""
    total0, idle0 = _cpu_times()
    time.sleep(window)
    total1, idle1 = _cpu_times()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_quiet(max_busy: float, timeout: float) -> float:
    """Wait (bounded) until the machine is at most max_busy busy; returns the last busy fraction."""
    deadline = time.monotonic() + timeout
    busy = cpu_busy()
    while busy > max_busy and time.monotonic() < deadline:
        busy = cpu_busy()
    return busy


def machine_info() -> dict:
    info = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "controller_python": platform.python_version(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        info["cpu_model"] = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
        info["git_head"] = head.stdout.strip()
        info["git_uncommitted_paths"] = len(dirty.stdout.splitlines())
    except OSError:
        pass
    try:
        out = subprocess.run(["ssh", "-V"], capture_output=True, text=True, timeout=5)
        info["openssh"] = (out.stderr or out.stdout).strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def fmt(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if unit == "ms" else f"{value:.3f}"


class Drop:
    """Every packet to and from one address dropped, through an iptables chain of this process's own."""

    def __init__(self, address: str) -> None:
        self.address, self.chain, self.on = address, f"UGRO_BENCH_{os.getpid()}", False

    def apply(self) -> None:
        run = ["iptables", "-w"]
        subprocess.run([*run, "-N", self.chain], check=True, capture_output=True)
        for way in ("-s", "-d"):
            subprocess.run([*run, "-A", self.chain, way, self.address, "-j", "DROP"], check=True, capture_output=True)
        for hook in ("INPUT", "OUTPUT"):
            subprocess.run([*run, "-I", hook, "-j", self.chain], check=True, capture_output=True)
        self.on = True

    def undo(self) -> None:
        if not self.on:
            return
        for args in (("-D", "INPUT", "-j", self.chain), ("-D", "OUTPUT", "-j", self.chain), ("-F", self.chain),
                     ("-X", self.chain)):  # fmt: skip
            subprocess.run(["iptables", "-w", *args], capture_output=True)
        self.on = False
