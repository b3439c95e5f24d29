"""Why a queued job waits names the node it needs and that node's state, in the queue and in what an attached
`manage.py launch` prints (the `ugro` client's attached launch: tests/test_client_commands.py)."""

from __future__ import annotations

import pytest

from cluster.models import Node
from jobs.launch import LaunchRequest, create_job
from jobs.management.commands.launch import waiting_reason
from jobs.snapshot import queue

pytestmark = pytest.mark.django_db


def test_a_job_waiting_for_a_node_that_is_not_up_names_it_and_its_state():
    # given a job on gpu-master and gpu3, with gpu3 down
    Node.objects.create(name="gpu-master", address="10.9.9.1", role="master")
    gpu3 = Node.objects.create(name="gpu3", address="10.9.9.3", status=Node.Status.DOWN)
    job = create_job(LaunchRequest(name="e8x", nodes=["gpu-master", "gpu3"]))
    # then the queue says which node keeps it waiting, and in which state
    (entry,) = queue()
    assert entry.decision.detail == "needs 2 nodes (whole); not enough such nodes are up (gpu3 down)"
    assert waiting_reason(job) == "(resources): needs 2 nodes (whole); not enough such nodes are up (gpu3 down)"
    # when gpu3 answers again but is drained, the reason says that instead
    Node.objects.filter(pk=gpu3.pk).update(status=Node.Status.HEALTHY, enabled=False)
    assert waiting_reason(job).endswith("not enough such nodes are up (gpu3 drained)")
    # and once it can start, there is no reason to give
    Node.objects.filter(pk=gpu3.pk).update(enabled=True)
    assert waiting_reason(job) == ""


def test_a_job_on_any_nodes_names_only_the_nodes_that_could_take_it():
    # given two GPU-less nodes, one down, one drained, and a job on 3 whole nodes
    Node.objects.create(name="a", address="10.9.9.1", role="master")
    Node.objects.create(name="b", address="10.9.9.2", status=Node.Status.DOWN)
    Node.objects.create(name="c", address="10.9.9.3")
    job = create_job(LaunchRequest(name="many", count=3))
    Node.objects.filter(name="c").update(enabled=False)
    # then both are named with their state
    assert waiting_reason(job).endswith("needs 3 nodes (whole); not enough such nodes are up (b down, c drained)")
