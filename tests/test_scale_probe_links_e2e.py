"""--scale-probe over links of a home network's speed: three real sshd nodes of their own (127.77.N.2-4), each rank's
gloo bound to its node's address (an address under a label of its own on lo, named by the node's env as a user
names an interface) so that tc can slow each node's link (htb: this kernel has no netem; tests/links.py). At full
speed the probe runs the job on all three nodes; with every link cut to a home network's rate and a model whose
gradient is large, on one, saying why. The per-count arithmetic is in tests/test_scale_probe.py; the probe against
every count at 2 model sizes and 3 rates is bench/scaling.py."""

from __future__ import annotations

import io
import os
import shutil

import pytest
from django.core.management import call_command

from cluster.models import Node
from jobs.models import Job

from .conftest import NODE_ENV, REPO, cluster_yaml, end_leftovers, rendezvous_ports
from .links import labelled, shaped

pytestmark = pytest.mark.e2e

RATE = "100mbit"  # 12.5 MB/s: a home network's rate (Fast Ethernet, Wi-Fi between rooms), far under loopback's
# the compute a sample takes on each node's "GPU" (a sleep in the reference script: the three ranks share this
# machine's two cores, so CPU-bound compute would not scale at any link speed): at full speed, enough that the
# ranks' own CPU (more of it on a loaded machine) stays a small part of a step; over the slow links, a fast GPU's
SAMPLE_SLEEP = {"full": "0.02", "slow": "0.005"}


@pytest.fixture
def linked_lab(tmp_path_factory, transactional_db, fast_settings):
    """Three loopback nodes whose ranks' gloo binds each node's own address (lo:Nu2, lo:Nu3, lo:Nu4), with a worker
    on a thread of this process. Not the session's nodes: another test's ranks must never meet these shaped links."""
    from cluster.config_yaml import import_cluster
    from cluster.links import pool

    from .loopback import LoopbackCluster
    from .worker_here import worker_here

    subnet = f"127.77.{os.getpid() % 250}"  # this process's own: two runs of the suite at once seldom share it
    cluster = LoopbackCluster(tmp_path_factory.mktemp("linked"), count=3, subnet=subnet)
    with labelled([f"{subnet}.{i}" for i in (2, 3, 4)]) as labels:
        cluster.start()
        try:
            cluster.rdzv_port = rendezvous_ports()
            for node in cluster.nodes:
                shutil.copytree(REPO / "train", node.workdir / "train", ignore=shutil.ignore_patterns("__pycache__"))
            import_cluster(cluster_yaml(cluster, 3))
            for node in cluster.nodes:
                Node.objects.filter(address=node.address).update(env={"GLOO_SOCKET_IFNAME": labels[node.address]})
            with worker_here():
                yield cluster
        finally:
            end_leftovers(cluster.root)
            cluster.stop()
            pool.close_all()


def probe_launch(name: str, model: str, sample_sleep: str) -> tuple[Job, str]:
    for node in Node.objects.all():
        Node.objects.filter(pk=node.pk).update(env={**node.env, "TRAIN_SAMPLE_SLEEP": sample_sleep})
    out = io.StringIO()
    call_command("launch", "--name", name, "--scale-probe", "4s", "--batch-per-gpu", "8", "--", "--model-name", model,
                 "--max-steps", "12", "--seq-len", "16", "--batch-size", "{local_batch}", "--log-every", "1",
                 "--save-every", "0", "--output-dir", "{job_dir}", stdout=out)  # fmt: skip
    return Job.objects.get(name=name), out.getvalue()


def test_the_probe_takes_every_node_at_full_speed_and_one_when_the_links_are_slow(linked_lab):
    """Covers: --scale-probe on 3 nodes at loopback speed picks all 3; with each node's link at a home network's
    rate and the larger model (a 3.4 MB gradient a step), it picks 1, frees the other two, and its line says the
    larger counts spent their steps waiting for the gradient exchange; the interface a node's env names (an address
    label) is used by its ranks."""
    assert NODE_ENV.exists()
    # at full speed: the tiny model's exchange is small beside a step's compute, and three nodes do 3x the samples
    fast, printed = probe_launch("full-speed", "tiny", SAMPLE_SLEEP["full"])
    assert fast.state == Job.State.SUCCEEDED, fast.failure_reason
    probe = fast.current.scale_probe
    rows = {r["nodes"]: r for r in probe["rows"]}
    print(probe["line"], {n: (r.get("samples_per_s"), r.get("sync_wait_s")) for n, r in rows.items()})
    assert sorted(rows) == [1, 2, 3] and probe["chosen"] == 3, probe
    assert rows[1]["samples_per_s"] == pytest.approx(8 * rows[1]["steps_per_s"], rel=0.01)  # 8 samples a rank
    assert probe["line"].startswith("runs on all 3 nodes") and fast.ranks.count() == 3
    assert "scale probe: runs on all 3 nodes" in printed

    # every node's link at a home network's rate, and the model whose gradient is 26x larger
    with shaped([n.address for n in linked_lab.nodes], RATE):
        slow, printed = probe_launch("slow-links", "small", SAMPLE_SLEEP["slow"])
    assert slow.state == Job.State.SUCCEEDED, slow.failure_reason
    probe = slow.current.scale_probe
    rows = {r["nodes"]: r for r in probe["rows"]}
    print(probe["line"], {n: (r.get("samples_per_s"), r.get("sync_wait_s")) for n, r in rows.items()})
    assert probe["chosen"] == 1 and rows[1]["samples_per_s"] > max(r["samples_per_s"] for n, r in rows.items() if n > 1)
    # the line says why: most of a 3-node step waited for the exchange; the job ran on one node, the others freed
    assert probe["line"].startswith("runs on 1 of 3 nodes: ") and "waiting for the gradient exchange" in probe["line"]
    assert rows[3]["sync_wait_s"] > rows[3]["compute_s"], rows[3]
    assert slow.ranks.count() == 1 and "scale probe: runs on 1 of 3 nodes" in printed
    status = io.StringIO()
    call_command("status", "slow-links", stdout=status)
    assert "runs on 1 of 3 nodes" in status.getvalue()
