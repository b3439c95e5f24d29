"""A job's environment from a lock file on three real sshd nodes (two sharing one working directory), with no
network: the controller's pip takes torch and its dependencies from this machine's local index and a small package
from wheels built here, the nodes build with the uv the controller sends, the ranks start with the environment's
torchrun and import the package, a second launch builds nothing, and nodes made to differ are refused."""

from __future__ import annotations

import glob
import io
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from cluster.models import ClusterSettings
from jobs.models import Job, JobCode

from .conftest import cluster_yaml, end_leftovers, wait_for
from .test_envs import make_wheel

pytestmark = pytest.mark.e2e

TORCH = sorted(glob.glob("/opt/wheels/torch-2.13.0*-cp311-*.whl"))
# torch 2.13.0's dependencies, pinned to what this machine's local index holds (a lock names every package)
LOCK = """torch==2.13.0+cpu
filelock==4.0.8
typing-extensions==4.16.0
setuptools==84.0.0
sympy==1.14.0
mpmath==1.3.0
networkx==3.6.1
jinja2==3.1.6
markupsafe==3.0.3
fsspec==2026.9.0
tinya==1.0
"""
CHECK = """import sys, tinya, torch
print("ENV", sys.executable, tinya.VERSION, torch.__version__, flush=True)
"""


def run(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def ended(name: str) -> Job:
    wait_for(lambda: Job.objects.get(name=name).state in (Job.State.SUCCEEDED, Job.State.FAILED), timeout=240,
             what=f"{name}'s end")  # fmt: skip
    return Job.objects.get(name=name)


@pytest.fixture
def env_lab(loopback, transactional_db, fast_settings, settings, tmp_path, monkeypatch):
    from cluster.config_yaml import import_cluster
    from cluster.links import pool

    from .worker_here import worker_here

    if not TORCH:
        pytest.skip("no torch 2.13.0 cp311 wheel in /opt/wheels on this machine")
    end_leftovers(loopback.root)
    pool.close_all()
    shared = loopback.root / "env-shared-workdir"
    shared.mkdir(exist_ok=True)
    text = cluster_yaml(loopback, 3)
    for node in loopback.nodes[1:3]:  # node2 and node3: one working directory (NFS)
        text = text.replace(f'workdir: "{node.workdir}"', f'workdir: "{shared}"')
    import_cluster(text)
    wheelhouse = tmp_path / "wheelhouse"
    make_wheel(wheelhouse, "tinya", "1.0")
    # pip with no network: this machine's local index and find-links, and the wheels built here
    monkeypatch.setenv("PIP_INDEX_URL", "file:///opt/pypi/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///opt/pypi-more/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", f"/opt/wheels {wheelhouse}")
    settings.DATA_DIR = str(tmp_path / "data")
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / "requirements.txt").write_text(LOCK)
    cs = ClusterSettings.load()
    cs.paths = {**(cs.paths or {}), "sync_roots": [str(locks)]}
    cs.save()
    for workdir in (Path(loopback.nodes[0].workdir), shared):
        (workdir / "check_env.py").write_text(CHECK)
    with worker_here():
        yield locks / "requirements.txt", shared
    pool.close_all()


def test_three_nodes_get_one_environment_from_a_lock_start_with_its_torchrun_and_differing_ones_are_refused(
    env_lab, loopback
):
    """Covers: --packages through a real launch on sshd nodes: torch and a local package fetched once by the
    controller's pip offline, uv and the wheels sent by the transfer path, the environments built by uv on the
    nodes (a shared workdir once), the ranks started with <env>/bin/torchrun and importing the package, a second
    launch building and sending nothing, and a node whose environment was changed refused before any rank starts.
    """
    lock, shared = env_lab
    run("launch", "--name", "env1", "--nodes", "3", "--script", "check_env.py", "--packages", str(lock), "--detach")
    job = ended("env1")
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    rec = JobCode.objects.get(job=job).envs
    nodes = rec["nodes"]
    assert sorted(nodes) == ["node1", "node2", "node3"]
    assert [n["kept"] for _, n in sorted(nodes.items())] == [False, False, True]  # node3 sees node2's build
    assert rec["controller_bytes"] > Path(TORCH[0]).stat().st_size  # the wheels and uv, once each
    logs = run("logs", "env1")
    envs = {n["path"] for n in nodes.values()}
    lines = [ln for ln in logs.splitlines() if "ENV " in ln]
    assert len(lines) == 3, logs[-2000:]
    for line in lines:
        exe, tinya, torch = line.split("ENV ", 1)[1].split()[:3]
        assert any(exe.startswith(p + "/bin/python") for p in envs) and tinya == "1.0" and torch == "2.13.0+cpu"
    assert "torch" in {p[0] for p in nodes["node1"]["packages"]}
    assert "packages: " in run("status", "env1")

    # a second launch: every environment kept, nothing sent
    run("launch", "--name", "env2", "--nodes", "3", "--script", "check_env.py", "--packages", str(lock), "--detach")
    job = ended("env2")
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    rec = JobCode.objects.get(job=job).envs
    assert all(n["kept"] for n in rec["nodes"].values()) and rec["controller_bytes"] == 0

    # node1's environment changed by hand: the next job is refused, naming the package, and nothing starts
    env1 = Path(rec["nodes"]["node1"]["path"])
    meta = next(env1.glob("lib/python*/site-packages/tinya-1.0.dist-info")) / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 1.0", "Version: 1.0.post1"))
    with pytest.raises(CommandError, match="tinya is 1.0.post1 on node1 and 1.0 on node2"):
        run("launch", "--name", "env3", "--nodes", "3", "--script", "check_env.py", "--packages", str(lock),
            "--detach")  # fmt: skip
    job = ended("env3")
    assert job.state == Job.State.FAILED and "tinya is 1.0.post1 on node1 and 1.0 on node2" in job.failure_reason
    assert "Nothing was started" in job.failure_reason and not job.ranks.exclude(pid=None).exists()
