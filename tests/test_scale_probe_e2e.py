"""--scale-probe on real sshd nodes with torchrun and the reference script (the choice's rules one by one, on
in-memory agents: tests/test_scale_probe.py; the probe against every count on shaped links: bench/scaling.py)."""

from __future__ import annotations

import io
from statistics import median

import pytest
from django.core.management import call_command

from cluster.models import Node
from jobs.models import Job
from metrics.models import MetricPoint

pytestmark = pytest.mark.e2e


def test_the_probe_measures_each_count_and_auto_weights_give_a_slow_node_the_smaller_share(lab):
    """Covers: --scale-probe on real nodes: 1 then 2 nodes run the reference script's first steps (their own
    rendezvous ids, outputs in a scratch directory), each count's samples/s from its step lines, the choice and its
    warning for named nodes, the table in the launch's output and `status`; --batch-weights auto from the probe's
    per-sample compute time (one node slowed per sample) gives that node the smaller share of the global batch, and
    the run's samples/s rise over the probe's even split.
    """
    fast, slow = Node.objects.order_by("order")[:2]
    slow.env = {"TRAIN_SAMPLE_SLEEP": "0.02"}  # a slower GPU: 20 ms more per sample on this node
    slow.save(update_fields=["env"])
    out = io.StringIO()
    call_command("launch", "--name", "probed", "--node", fast.name, "--node", slow.name, "--scale-probe", "2s",
                 "--batch-per-gpu", "8", "--batch-weights", "auto", "--", "--max-steps", "20", "--seq-len", "16",
                 "--batch-size", "{local_batch}", "--log-every", "2", "--save-every", "0", "--output-dir",
                 "{job_dir}", stdout=out)  # fmt: skip
    job = Job.objects.get(name="probed")
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    probe = job.current.scale_probe
    rows = {r["nodes"]: r for r in probe["rows"]}
    assert sorted(rows) == [1, 2] and all(r["samples_per_s"] > 0 for r in rows.values()), probe
    assert rows[2]["per_sample_s"][slow.name] > rows[2]["per_sample_s"][fast.name]
    # the slowed node holds the 2-node run back: one node is faster, but the nodes were named, so both run
    assert probe["chosen"] == 2 and probe["line"].startswith("fewer nodes would be faster: 1 measured"), probe
    # and the slow node gets the smaller share of the 16 samples
    batches = dict(job.ranks.values_list("node__name", "batch_weight"))
    assert batches[slow.name] < 1 < batches[fast.name]
    assert probe["weights"][fast.name] > probe["weights"][slow.name] == 1.0
    # and the weighted split trains faster than the probe's even one on the same two nodes: samples/s from the same
    # step lines (rank 0's compute and sync-wait times a step, warm-up dropped), 16 samples a step either way
    points = {name: dict(MetricPoint.objects.filter(job=job, rank=0, name=name, attempt=job.attempt)
                         .values_list("step", "value")) for name in ("compute_s", "sync_wait_s")}  # fmt: skip
    step_s = median([points["compute_s"][s] + points["sync_wait_s"][s] for s in sorted(points["compute_s"])[1:]
                     if s in points["sync_wait_s"]])  # fmt: skip
    even_s = rows[2]["compute_s"] + rows[2]["sync_wait_s"]
    print(f"samples/s: even {16 / even_s:.1f} (probe), weighted {16 / step_s:.1f} (the run)")
    assert 16 / step_s > 1.1 * 16 / even_s, (step_s, even_s)
    printed = out.getvalue()
    assert "scale probe: fewer nodes would be faster" in printed and "batch weights from the probe" in printed
    status = io.StringIO()
    call_command("status", "probed", stdout=status)
    assert "scale probe: fewer nodes would be faster" in status.getvalue()
    # nothing of the probe reached the job's own directory: its checkpoints are the real run's
    assert job.checkpoints.exists() and not any("/probe_" in c.path for c in job.checkpoints.all())
