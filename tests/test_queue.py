"""One GPU (or GPU-less node), one job, enforced by the database; queued jobs start in order as GPUs free up."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from cluster.models import Node
from jobs.launch import LaunchError, LaunchRequest, create_job
from jobs.models import Allocation, Job
from jobs.scheduler import place, place_queued

pytestmark = pytest.mark.django_db


@pytest.fixture
def three_nodes():
    return [Node.objects.create(name=f"n{i}", address=f"10.9.9.{i}", role="master" if i == 0 else "worker",
                                order=i) for i in range(3)]  # fmt: skip


def test_the_database_refuses_a_second_active_job_on_a_node_without_gpus(three_nodes):
    a = Job.objects.create(name="a", script="s.py")
    b = Job.objects.create(name="b", script="s.py")
    Allocation.objects.create(job=a, node=three_nodes[0], gpu_index=Allocation.WHOLE_NODE)
    with pytest.raises(IntegrityError), transaction.atomic():
        Allocation.objects.create(job=b, node=three_nodes[0], gpu_index=Allocation.WHOLE_NODE)
    # an inactive (finished) allocation does not hold the node
    Allocation.objects.filter(job=a).update(active=False)
    Allocation.objects.create(job=b, node=three_nodes[0], gpu_index=Allocation.WHOLE_NODE)


def test_placement_puts_the_master_first_and_marks_the_job_starting(three_nodes):
    job = create_job(LaunchRequest(name="p1", count=2))
    assert place(job)
    assert job.state == Job.State.STARTING and job.tag.startswith("p1-")
    assert list(job.ranks.order_by("index").values_list("node__name", flat=True)) == ["n0", "n1"]
    rank = job.ranks.get(index=1)
    assert rank.remote_log.endswith(f"/.ugro/jobs/{job.tag}/rank_1.log")


def test_a_job_whose_nodes_are_busy_waits_and_later_jobs_do_not_overtake_it(three_nodes):
    # (the third job's time limit runs past the second's reservation: it may not backfill)
    first = create_job(LaunchRequest(name="first", count=2, time_limit_s=3600))
    second = create_job(LaunchRequest(name="second", count=3, time_limit_s=3600))
    third = create_job(LaunchRequest(name="third", nodes=["n2"], time_limit_s=7200))
    assert [j.name for j in place_queued()] == ["first"]
    for j in (second, third):
        j.refresh_from_db()
        assert j.state == Job.State.QUEUED and not j.ranks.exists()
    # when the first job ends and frees its nodes, the queue moves in order
    Job.objects.filter(pk=first.pk).update(state=Job.State.SUCCEEDED)
    first.allocations.update(active=False)
    assert [j.name for j in place_queued()] == ["second"]
    assert place_queued() == []
    second.refresh_from_db()
    Job.objects.filter(pk=second.pk).update(state=Job.State.FAILED)
    second.allocations.update(active=False)
    assert [j.name for j in place_queued()] == ["third"]


def test_a_job_naming_its_nodes_starts_on_exactly_those_nodes(three_nodes):
    # (the scheduler reads the names as text and decodes them only when there are some)
    named = create_job(LaunchRequest(name="named", nodes=["n2", "n0"], time_limit_s=600))
    create_job(LaunchRequest(name="any", count=1, time_limit_s=600))
    assert [j.name for j in place_queued()] == ["named", "any"]
    named.refresh_from_db()
    assert sorted(named.ranks.values_list("node__name", flat=True)) == ["n0", "n2"]
    assert Job.objects.get(name="any").ranks.get().node.name == "n1"


def test_higher_priority_starts_first(three_nodes):
    create_job(LaunchRequest(name="low", count=3))
    create_job(LaunchRequest(name="high", count=3, priority=5))
    assert [j.name for j in place_queued()] == ["high"]


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (LaunchRequest(name="bad name"), "job name 'bad name' is not allowed"),
        (LaunchRequest(name="x", count=4), "asked for 4 nodes but the cluster has 3 enabled"),
        (LaunchRequest(name="x", nodes=["nope"]), "node 'nope' is not in the cluster"),
        (LaunchRequest(name="x", epochs=0), "epochs must be a whole number from 1"),
        (LaunchRequest(name="x", lr=float("nan")), "learning rate must be a number above 0"),
        (LaunchRequest(name="x", extra_args=["a\x00b"]), "NUL"),
    ],
)
def test_bad_requests_are_refused_with_one_line_and_create_nothing(three_nodes, req, message):
    with pytest.raises(LaunchError, match=message.replace("(", r"\(")):
        create_job(req)
    assert not Job.objects.exists()


def test_duplicate_job_names_are_refused(three_nodes):
    create_job(LaunchRequest(name="dup"))
    with pytest.raises(LaunchError, match="already exists"):
        create_job(LaunchRequest(name="dup"))
