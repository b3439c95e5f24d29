"""GPUs as the unit in the database: allocations, the per-GPU constraint under racing schedulers, time
limits, VRAM refusal, quotas, and a scheduling pass whose query count does not grow with the queue."""

from __future__ import annotations

import io
import json
import re
import threading
from datetime import datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import IntegrityError, connections, transaction
from django.utils import timezone

from cluster.models import GPU, ClusterSettings, HealthSample, Node
from jobs import lifecycle
from jobs.launch import LaunchError, LaunchRequest, create_job, rank_command, rank_env
from jobs.loops.starts import stop_overdue
from jobs.models import Allocation, Job, Rank
from jobs.scheduler import place_queued, queue

from .jobrows import update_jobs

pytestmark = pytest.mark.django_db


def lab_nodes(*sizes_gb: tuple[float, ...]) -> list[Node]:
    """Nodes gpu0.., each with GPUs of the given sizes (GB); rows come from gpu_count, sizes set after."""
    nodes = []
    for i, sizes in enumerate(sizes_gb):
        node = Node.objects.create(
            name=f"gpu{i}", address=f"10.8.0.{i + 1}", order=i, role="master" if i == 0 else "worker",
            gpu_count=len(sizes), gpu_vram_gb=max(sizes, default=0), gpu_model="RTX",
        )  # fmt: skip
        for index, gb in enumerate(sizes):
            GPU.objects.filter(node=node, index=index).update(vram_mb=gb * 1024, model=f"RTX {gb:g}GB")
        nodes.append(node)
    return nodes


def test_gpu_rows_follow_the_declared_count():
    (node,) = lab_nodes((8, 8))
    assert list(node.gpus.values_list("index", flat=True)) == [0, 1]
    node.gpu_count = 3
    node.save()
    assert list(node.gpus.values_list("index", flat=True)) == [0, 1, 2]
    node.gpu_count = 0
    node.save()
    assert not node.gpus.exists()


def test_two_jobs_share_a_node_on_different_gpus_each_seeing_only_its_own():
    lab_nodes((8, 8))
    a = create_job(LaunchRequest(name="a", gpus=1))
    b = create_job(LaunchRequest(name="b", gpus=1))
    assert [j.name for j in place_queued()] == ["a", "b"]
    ranks = {j.name: j.ranks.get() for j in (a, b)}
    assert ranks["a"].gpu_indices == [0] and ranks["b"].gpu_indices == [1]
    for rank in ranks.values():
        env = rank_env(rank.job, rank)
        assert env["CUDA_VISIBLE_DEVICES"] == str(rank.gpu_indices[0])
        assert "--nproc-per-node=1" in rank_command(rank.job, rank, 1, "x:1")
    held = Allocation.objects.filter(active=True).values_list("job__name", "node__name", "gpu_index")
    assert sorted(held) == [("a", "gpu0", 0), ("b", "gpu0", 1)]
    # a third waits; when a ends, its GPU is released in the same step and the third gets it
    c = create_job(LaunchRequest(name="c", gpus=1))
    assert place_queued() == []
    Job.objects.filter(pk=a.pk).update(state=Job.State.RUNNING)
    a.refresh_from_db()
    assert lifecycle.succeed(a)
    assert not a.allocations.filter(active=True).exists()
    assert [j.name for j in place_queued()] == ["c"]
    assert c.ranks.get().gpu_indices == [0]


def test_nodes_times_gpus_per_node_sets_nproc_to_match():
    lab_nodes((8, 8, 8), (8, 8, 8))
    job = create_job(LaunchRequest(name="k2m2", count=2, gpus_per_node=2))
    assert place_queued() == [job]
    ranks = list(job.ranks.select_related("node").order_by("index"))
    assert [(r.node.name, r.gpu_indices) for r in ranks] == [("gpu0", [0, 1]), ("gpu1", [0, 1])]
    assert all("--nproc-per-node=2" in rank_command(job, r, 2, "x:1") for r in ranks)
    assert rank_env(job, ranks[1])["CUDA_VISIBLE_DEVICES"] == "0,1"
    job.refresh_from_db()
    assert job.held_gpus == 4


def test_the_database_refuses_a_second_active_allocation_of_a_gpu():
    (node,) = lab_nodes((8,))
    a = Job.objects.create(name="a", script="s.py")
    b = Job.objects.create(name="b", script="s.py")
    Allocation.objects.create(job=a, node=node, gpu_index=0)
    with pytest.raises(IntegrityError), transaction.atomic():
        Allocation.objects.create(job=b, node=node, gpu_index=0)


@pytest.mark.django_db(transaction=True)
def test_two_schedulers_racing_for_one_gpu_never_both_get_it():
    # given one GPU and two queued jobs, each wanted by its own scheduler (own thread, own connection)
    (node,) = lab_nodes((8,))
    jobs = [Job.objects.create(name=f"race{i}", script="s.py", gpus=1) for i in range(2)]
    barrier = threading.Barrier(2)
    results: dict[str, bool | str] = {}

    def scheduler(job: Job) -> None:
        try:
            barrier.wait(timeout=10)
            results[job.name] = lifecycle.claim_nodes(Job.objects.get(pk=job.pk), [node], [[0]])
        except Exception as exc:  # noqa: BLE001 - reported below
            results[job.name] = repr(exc)
        finally:
            connections.close_all()

    for _ in range(5):  # a few rounds: the interleaving differs each time
        update_jobs(Job.objects.filter(pk__in=[j.pk for j in jobs]), state=Job.State.QUEUED, started_at=None)
        Allocation.objects.all().delete()
        Rank.objects.filter(job__in=jobs).delete()
        threads = [threading.Thread(target=scheduler, args=(j,)) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        # then exactly one won; the loser is still queued with nothing held
        assert sorted(results.values()) == [False, True], results
        loser = next(j for j in jobs if results[j.name] is False)
        loser.refresh_from_db()
        assert loser.state == Job.State.QUEUED and not loser.ranks.exists() and not loser.allocations.exists()
        assert Allocation.objects.filter(active=True).count() == 1


def test_a_scheduling_pass_costs_the_same_queries_for_10_or_200_queued_jobs(django_assert_max_num_queries):
    lab_nodes((8, 8), (12, 12))
    for i in range(4):  # the cluster is full
        create_job(LaunchRequest(name=f"run{i}", gpus=1))
    place_queued()
    assert Allocation.objects.filter(active=True).count() == 4
    for n in (10, 200):
        Job.objects.bulk_create(Job(name=f"q{n}-{i}", script="s.py", gpus=1 + i % 3, priority=i % 5) for i in range(n))
        with django_assert_max_num_queries(10):
            assert place_queued() == []
        # the queue reads one more: the earlier runs its estimates learn from (a pass needs no estimates)
        with django_assert_max_num_queries(11):
            entries = queue()
        assert len(entries) == Job.objects.filter(state=Job.State.QUEUED).count()
        with django_assert_max_num_queries(11):
            call_command("queue", stdout=io.StringIO())


def test_queue_shows_position_reason_and_estimated_start():
    lab_nodes((8,), (8,))
    big = create_job(LaunchRequest(name="big", gpus=1, time_limit_s=3600))
    place_queued()
    big.refresh_from_db()
    small = create_job(LaunchRequest(name="small", gpus=1, time_limit_s=60))
    create_job(LaunchRequest(name="wide", gpus=2, time_limit_s=3600, priority=10))
    entries = {e.job.name: e for e in queue()}
    assert entries["wide"].decision.position == 1 and entries["wide"].decision.reason == "resources"
    est = entries["wide"].est_start
    assert abs((est - (big.started_at + timedelta(hours=1))).total_seconds()) < 2
    assert entries["small"].decision.start  # it ends long before wide's reservation
    out = io.StringIO()
    call_command("queue", stdout=out)
    text = out.getvalue()
    assert "wide" in text and "resources" in text and "small" in text
    assert small.name in text and "big" in text  # running jobs and the GPUs they hold are listed too
    out = io.StringIO()
    call_command("queue", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert [(q["position"], q["name"], q["reason"]) for q in data["queue"]] == [
        (1, "wide", "resources"),
        (2, "small", None),
    ]
    assert data["queue"][1]["starts_now"] and data["holding"] == {"big": ["gpu0:0"]}


def _estimates(client) -> dict[str, tuple]:
    """Each waiting job's estimate as `queue --json`, `queue` (its text row), the API and the queue page give it."""
    out = io.StringIO()
    call_command("queue", "--json", stdout=out)
    cli = {q["name"]: q["estimated_start"] for q in json.loads(out.getvalue())["queue"]}
    out = io.StringIO()
    call_command("queue", stdout=out)
    rows = {line.split()[1]: line for line in out.getvalue().splitlines()[1:] if line.split()[:1] != []}
    api = {q["name"]: q["estimated_start"] for q in client.get("/api/v1/queue").json()}
    page = client.get("/jobs/queue/").content.decode()
    return {name: (cli[name], rows[name], api[name], page) for name in cli}


def test_a_job_behind_one_with_no_time_limit_is_estimated_from_earlier_runs_of_its_script_else_unknown(client):
    # given one GPU, held for 10 s by a job of fast.py that set no time limit (the cluster default applies)
    lab_nodes((8,))
    client.force_login(User.objects.create_superuser("ops"))
    quick = create_job(LaunchRequest(name="quick", gpus=1, script="fast.py"))
    place_queued()
    started = timezone.now() - timedelta(seconds=10)
    update_jobs(Job.objects.filter(pk=quick.pk), started_at=started)
    create_job(LaunchRequest(name="next", gpus=1, script="fast.py"))
    # when fast.py never ran to the end before: the estimate is unknown, never the default limit
    (entry,) = queue()
    assert (
        entry.est_start is None
        and entry.decision.detail == "next to start: GPUs reserved for it (when they free up: unknown)"
    )
    cli, row, api, page = _estimates(client)["next"]
    assert cli is None and api is None and " unknown " in row and "23h" not in row
    assert re.search(r'<tr data-job="next".*?<span class="muted">unknown</span>', page, re.S)
    # given three earlier runs of 40 s (a failed run says nothing of how long the script takes)
    end = timezone.now() - timedelta(hours=2)
    for i in range(3):
        Job.objects.create(name=f"earlier{i}", script="fast.py", state=Job.State.SUCCEEDED,
                           started_at=end - timedelta(seconds=40), finished_at=end)  # fmt: skip
    Job.objects.create(name="broke", script="fast.py", state=Job.State.FAILED,
                       started_at=end - timedelta(hours=5), finished_at=end)  # fmt: skip
    # then it is expected to start when the running one has run 40 s: about 30 s from now
    (entry,) = queue()
    assert abs((entry.est_start - (started + timedelta(seconds=40))).total_seconds()) < 2
    cli, row, api, _ = _estimates(client)["next"]
    assert abs((datetime.fromisoformat(cli) - (started + timedelta(seconds=40))).total_seconds()) < 2
    assert re.search(r" in \d+s \(", row) and cli[:19] == api[:19]


def test_a_job_past_its_time_limit_is_stopped_with_kind_timeout():
    lab_nodes((8,))
    job = create_job(LaunchRequest(name="long", gpus=1, time_limit_s=60))
    place_queued()
    update_jobs(
        Job.objects.filter(pk=job.pk), state=Job.State.RUNNING, started_at=timezone.now() - timedelta(seconds=59)
    )
    assert stop_overdue() == []
    update_jobs(Job.objects.filter(pk=job.pk), started_at=timezone.now() - timedelta(seconds=61))
    assert stop_overdue() == ["long"]
    job.refresh_from_db()
    assert job.state == Job.State.FAILING and job.failure_kind == "TIMEOUT"
    assert "time limit of 1m00s" in job.failure_reason


def test_the_cluster_default_time_limit_applies_to_jobs_that_name_none():
    lab_nodes((8,))
    cs = ClusterSettings.load()
    cs.default_time_limit_s = 120
    cs.save()
    job = create_job(LaunchRequest(name="dflt", gpus=1))
    place_queued()
    update_jobs(
        Job.objects.filter(pk=job.pk), state=Job.State.RUNNING, started_at=timezone.now() - timedelta(seconds=121)
    )
    assert stop_overdue() == ["dflt"]


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (LaunchRequest(name="x", gpus=1, min_vram_mb=16 * 1024),
         "no GPU has 16.0 GB; the largest is gpu0 GPU 0 (RTX 12GB, 12.0 GB)"),
        (LaunchRequest(name="x", gpus=4), "asked for 4 GPUs but the cluster has 3"),
        (LaunchRequest(name="x", gpus=2, min_vram_mb=10 * 1024), "asked for 2 GPUs but the cluster has 1 with 10.0 GB"),
        (LaunchRequest(name="x", count=2, gpus_per_node=2), "asked for 2 nodes with 2 GPUs each; the cluster has 1"),
        (LaunchRequest(name="x", gpus=1, count=1), "--gpus N asks for GPUs on any nodes"),
        (LaunchRequest(name="x", gpus=1, priority=101), "priority must be a whole number from 0 to 100"),
        (LaunchRequest(name="x", gpus=1, time_limit_s=9 * 24 * 3600), "--time-limit may be at most 168h"),
    ],
)  # fmt: skip
def test_requests_no_gpu_could_ever_satisfy_are_refused_at_submit(req, message):
    lab_nodes((12,), (8, 8))
    with pytest.raises(LaunchError) as err:
        create_job(req)
    assert str(err.value).startswith(message)
    assert not Job.objects.exists()


def test_launch_command_parses_time_limit_and_vram_and_refuses_bad_ones_in_one_line():
    lab_nodes((12,), (8,))
    call_command("launch", "--name", "v", "--gpus", "1", "--min-vram", "10G", "--time-limit", "1h30m",
                 "--dry-run", stdout=io.StringIO())  # fmt: skip
    with pytest.raises(CommandError, match=r"^time limit 'soon' is not a duration"):
        call_command("launch", "--name", "v", "--time-limit", "soon", stdout=io.StringIO())
    with pytest.raises(CommandError, match=r"^VRAM 'lots' is not a size"):
        call_command("launch", "--name", "v", "--min-vram", "lots", stdout=io.StringIO())
    with pytest.raises(CommandError, match=r"^no GPU has 24.0 GB; the largest is gpu0 GPU 0"):
        call_command("launch", "--name", "v", "--gpus", "1", "--min-vram", "24G", stdout=io.StringIO())
    assert not Job.objects.exists()


def test_vram_is_learned_from_the_peak_of_an_earlier_run_of_the_same_script():
    nodes = lab_nodes((12,), (8,))
    # given an earlier run of the script on gpu0's GPU 0, sampled at 9 GB used at its peak
    old = create_job(LaunchRequest(name="old", gpus=1, script="train/big.py", min_vram_mb=10 * 1024))
    place_queued()
    started = timezone.now() - timedelta(minutes=10)
    update_jobs(
        Job.objects.filter(pk=old.pk), state=Job.State.SUCCEEDED, running_at=started, finished_at=timezone.now()
    )
    for minutes, used in ((9, 4000), (5, 9216), (2, 8000)):
        HealthSample.objects.create(node=nodes[0], time=started + timedelta(minutes=minutes),
                                    gpus=[{"index": 0, "mem_used_mb": used, "mem_total_mb": 12288}])  # fmt: skip
    HealthSample.objects.create(
        node=nodes[1], time=started + timedelta(minutes=5), gpus=[{"index": 0, "mem_used_mb": 8100}]
    )  # fmt: skip (another job's GPU)
    old.allocations.update(active=False)
    # when the same script is launched without --min-vram
    new = create_job(LaunchRequest(name="new", gpus=1, script="train/big.py"))
    # then it needs the peak plus a margin, and says where that came from
    assert new.min_vram_mb == round(9216 * 1.05)
    assert new.vram_source == "learned: peak 9.0 GB of job old"
    assert place_queued() == [new] and new.ranks.get().node == nodes[0]


def test_queued_job_quota_is_refused_at_submit_per_user():
    lab_nodes((8,))
    cs = ClusterSettings.load()
    cs.quota_max_queued = 2
    cs.save()
    alice, bob = User.objects.create_user("alice"), User.objects.create_user("bob")
    for i in range(2):
        create_job(LaunchRequest(name=f"a{i}", gpus=1, owner=alice))
    with pytest.raises(LaunchError, match="^alice already has 2 queued jobs \\(quota 2\\)"):
        create_job(LaunchRequest(name="a2", gpus=1, owner=alice))
    create_job(LaunchRequest(name="b0", gpus=1, owner=bob))
    assert Job.objects.count() == 3


def test_gpu_quota_keeps_a_user_to_its_share_while_others_start():
    lab_nodes((8, 8, 8))
    cs = ClusterSettings.load()
    cs.quota_max_gpus = 2
    cs.save()
    alice, bob = User.objects.create_user("alice"), User.objects.create_user("bob")
    for i in range(3):
        create_job(LaunchRequest(name=f"a{i}", gpus=1, owner=alice))
    create_job(LaunchRequest(name="b0", gpus=1, owner=bob))
    assert sorted(j.name for j in place_queued()) == ["a0", "a1", "b0"]
    (entry,) = queue()
    assert entry.job.name == "a2" and entry.decision.reason == "quota"


def test_fair_share_starts_the_user_who_used_less_first():
    lab_nodes((8,))
    alice, bob = User.objects.create_user("alice"), User.objects.create_user("bob")
    # alice used the GPU for the last two hours
    Job.objects.create(name="past", script="s.py", owner=alice, state=Job.State.SUCCEEDED, held_gpus=1,
                       started_at=timezone.now() - timedelta(hours=2), finished_at=timezone.now())  # fmt: skip
    create_job(LaunchRequest(name="alice1", gpus=1, owner=alice))
    create_job(LaunchRequest(name="bob1", gpus=1, owner=bob))
    assert [j.name for j in place_queued()] == ["bob1"]


def test_gpu_rows_take_model_and_memory_from_the_health_readings():
    from cluster.gpus import record_readings

    (node,) = lab_nodes((8, 8))
    readings = [
        {"index": 0, "name": "NVIDIA GeForce RTX 5070 Ti", "mem_total_mb": 12227, "uuid": "GPU-a"},
        {"index": 1, "name": "NVIDIA GeForce RTX 4070", "mem_total_mb": 8188, "uuid": "GPU-b"},
        {"index": 7, "name": "not declared", "mem_total_mb": 1},  # past gpu_count: ignored
    ]
    assert record_readings({node.name: readings}, [node]) == 2
    rows = {g.index: (g.model, g.vram_mb, g.uuid) for g in node.gpus.all()}
    assert rows == {
        0: ("NVIDIA GeForce RTX 5070 Ti", 12227.0, "GPU-a"),
        1: ("NVIDIA GeForce RTX 4070", 8188.0, "GPU-b"),
    }
    assert record_readings({node.name: readings}, [node]) == 0  # unchanged: nothing written
    # a job asking for 10 GB now fits only GPU 0
    job = create_job(LaunchRequest(name="big", gpus=1, min_vram_mb=10 * 1024))
    assert place_queued() == [job] and job.ranks.get().gpu_indices == [0]


def test_admin_shows_a_nodes_gpus_and_a_jobs_allocations():
    from django.test import Client

    (node,) = lab_nodes((8, 12))
    job = create_job(LaunchRequest(name="adm", gpus=2))
    place_queued()
    client = Client()
    client.force_login(User.objects.create_superuser("boss", password="pw-boss-12345"))
    node_page = client.get(f"/admin/cluster/node/{node.pk}/change/").content.decode()
    assert "RTX 12GB" in node_page and "12288" in node_page
    job_page = client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert "Allocations" in job_page or "allocations" in job_page
    assert client.get("/admin/jobs/sweep/").status_code == 200


def test_status_shows_what_a_job_asked_for_and_each_ranks_gpus():
    lab_nodes((8, 8))
    job = create_job(LaunchRequest(name="st", gpus=2, time_limit_s=5400, min_vram_mb=4096))
    place_queued()
    out = io.StringIO()
    call_command("status", "st", stdout=out)
    text = out.getvalue()
    assert "  asks 2 GPUs >=4G, time limit 1h30m00s" in text
    assert "rank 0 on gpu0           GPUs 0,1" in text
    assert job.name in text


def test_a_job_after_another_waits_with_reason_dependency_until_that_one_succeeded():
    lab_nodes((8, 8))
    first = create_job(LaunchRequest(name="prep", gpus=1))
    then = create_job(LaunchRequest(name="train", gpus=1, after="prep"))
    # then only the first starts; the second says what it waits for
    assert place_queued() == [first]
    (entry,) = queue()
    assert (entry.job.name, entry.decision.reason) == ("train", "dependency")
    assert entry.decision.detail == "starts after job prep succeeds (now starting)"
    # once the first succeeded, it starts
    Job.objects.filter(pk=first.pk).update(state=Job.State.SUCCEEDED)
    first.allocations.update(active=False)
    assert place_queued() == [then]
    # a job after a failed one is refused at submit; one whose job failed meanwhile says it never starts
    Job.objects.filter(pk=first.pk).update(state=Job.State.FAILED)
    with pytest.raises(LaunchError, match="^--after prep: that job failed; this one would never start"):
        create_job(LaunchRequest(name="never", gpus=1, after="prep"))
    with pytest.raises(LaunchError, match="^--after 'nope': no such job"):
        create_job(LaunchRequest(name="never", gpus=1, after="nope"))
    Job.objects.filter(pk=then.pk).update(state=Job.State.QUEUED)
    then.allocations.update(active=False)
    (entry,) = queue()
    assert entry.decision.detail.startswith("job prep failed: this job will not start")


def test_the_api_launches_on_gpus_with_a_time_limit_and_its_queue_says_why_jobs_wait():
    from django.contrib.auth.models import Group
    from django.test import Client

    from accounts.tokens import create_token

    lab_nodes((12,), (8,))
    user = User.objects.create_user("carol")
    user.groups.add(Group.objects.get(name="launcher"))
    _, token = create_token(user, "laptop", "launch")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def launch(**body):
        return client.post("/api/v1/jobs/", {"name": "x", **body}, content_type="application/json")

    answer = launch(name="big", gpus=1, time_limit="2h", min_vram="10G")
    assert answer.status_code == 201, answer.json()
    job = Job.objects.get(name="big")
    assert (job.gpus, job.time_limit_s, job.min_vram_mb, job.owner) == (1, 7200, 10240, user)
    place_queued()
    launch(name="next", gpus=1, min_vram="10G", time_limit="1h")
    queued = client.get("/api/v1/queue").json()
    assert [(q["position"], q["name"], q["reason"], q["gpus"]) for q in queued] == [(1, "next", "resources", "gpu0:0")]
    assert queued[0]["estimated_start"] and not queued[0]["starts_now"]
    # bad values are refused in one line, nothing created
    refused = launch(name="bad", time_limit="soon")
    assert refused.status_code == 400 and "time limit 'soon' is not a duration" in str(refused.json())
    refused = launch(name="bad", gpus=1, min_vram="16G")
    assert refused.status_code == 400 and "no GPU has 16.0 GB; the largest is gpu0 GPU 0" in str(refused.json())
    assert not Job.objects.filter(name="bad").exists()
