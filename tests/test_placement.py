"""The planner on its own (jobs/placement.py): backfill, reservations, VRAM fit, fair share, quotas."""

from __future__ import annotations

import math

from jobs.placement import Decision, Demand, Limits, NodeView, Reason, Running, Slot, decayed_usage, plan

NOW = 1_000_000.0


def cluster(*vram_gb_per_node: tuple[float, ...]) -> list[NodeView]:
    """Nodes 1..n, each with GPUs of the given sizes (GB); () makes a node without GPUs."""
    nodes = []
    for node_id, sizes in enumerate(vram_gb_per_node, start=1):
        slots = [Slot(node_id, i, gb * 1024) for i, gb in enumerate(sizes)] or [Slot(node_id, -1)]
        nodes.append(NodeView(node_id, f"n{node_id}", True, slots))
    return nodes


def by_job(decisions: list[Decision]) -> dict[int, Decision]:
    return {d.job: d for d in decisions}


def test_a_small_job_backfills_beside_a_waiting_large_one_without_delaying_it():
    # given 2 nodes x 2 GPUs, 2 of them held for up to 100 s more by a running job
    nodes = cluster((8, 8), (8, 8))
    running = [Running(job=1, slots=[(1, 0), (1, 1)], ends_at=NOW + 100)]
    # when a 4-GPU job (high priority) waits, and two 1-GPU jobs are behind it
    queued = [
        Demand(job=10, priority=50, gpus=4, time_limit=3600, submitted=1),
        Demand(job=11, priority=0, gpus=1, time_limit=60, submitted=2),  # ends before the reservation
        Demand(job=12, priority=0, gpus=1, time_limit=600, submitted=3),  # would run past it
    ]
    d = by_job(plan(NOW, nodes, running, queued))
    # then the large job holds a reservation from when the running job's time is up
    assert not d[10].start and d[10].reserved and d[10].est_start == NOW + 100
    assert d[10].reason == Reason.RESOURCES
    # the short job starts now on a free GPU, the long one waits for the reservation's sake
    assert d[11].start and d[11].placement == [(2, [0])]
    assert not d[12].start and d[12].reason == Reason.RESERVATION
    # and the large job's estimated start did not move
    assert plan(NOW, nodes, running, queued[:1])[0].est_start == d[10].est_start


def test_gpus_no_reservation_needs_can_be_used_by_any_job():
    # given a 2-node job waiting for node 1 only (named), node 2 idle
    nodes = cluster((8, 8), (8, 8))
    running = [Running(job=1, slots=[(1, 0)], ends_at=NOW + 100)]
    queued = [
        Demand(job=10, priority=9, named=(1,), time_limit=3600),  # whole node 1
        Demand(job=11, gpus=2, time_limit=10_000),
    ]
    d = by_job(plan(NOW, nodes, running, queued))
    # then the long job takes node 2, which the reservation does not need
    assert d[10].reserved and d[10].est_start == NOW + 100
    assert d[11].start and d[11].placement == [(2, [0, 1])]


def test_without_a_reservation_depth_later_jobs_are_not_held_back():
    nodes = cluster((8, 8))
    running = [Running(job=1, slots=[(1, 0)], ends_at=NOW + 100)]
    queued = [Demand(job=10, priority=9, gpus=2, time_limit=3600), Demand(job=11, gpus=1, time_limit=10_000)]
    assert by_job(plan(NOW, nodes, running, queued, limits=Limits(reservations=0)))[11].start
    assert not by_job(plan(NOW, nodes, running, queued, limits=Limits(reservations=1)))[11].start


def test_gpus_spread_over_nodes_one_rank_per_node_and_one_node_when_it_fits():
    nodes = cluster((8, 8), (8, 8, 8))
    d = plan(NOW, nodes, [], [Demand(job=1, gpus=3), Demand(job=2, gpus=2)])
    assert d[0].placement == [(2, [0, 1, 2])]  # the node with room for all three
    assert d[1].placement == [(1, [0, 1])]
    d = plan(NOW, nodes, [], [Demand(job=1, gpus=5)])
    assert sorted(d[0].placement) == [(1, [0, 1]), (2, [0, 1, 2])]


def test_nodes_times_gpus_per_node_and_whole_nodes():
    nodes = cluster((8, 8), (8, 8), ())
    d = by_job(plan(NOW, nodes, [], [Demand(job=1, nodes=2, per_node=1), Demand(job=2, nodes=1)]))
    assert d[1].placement == [(1, [0]), (2, [0])]
    # a whole-node job takes the node without GPUs (the GPU nodes are partly held)
    assert d[2].placement == [(3, [])]


def test_vram_fit_takes_the_smallest_card_that_fits_and_keeps_big_cards_for_big_models():
    # given the user's lab: 12 GB, 8 GB, 8 GB
    nodes = cluster((12,), (8,), (8,))
    queued = [Demand(job=1, gpus=1, submitted=1), Demand(job=2, gpus=1, min_vram_mb=10 * 1024, submitted=2)]
    d = by_job(plan(NOW, nodes, [], queued))
    # then the 10 GB model gets the 12 GB card, the small one an 8 GB card
    assert d[1].placement == [(2, [0])] and d[2].placement == [(1, [0])]


def test_a_job_that_fits_but_must_wait_says_why():
    nodes = cluster((12,), (8,))
    running = [Running(job=1, slots=[(1, 0)], ends_at=NOW + 300)]
    d = plan(NOW, nodes, running, [Demand(job=2, gpus=1, min_vram_mb=10 * 1024)])[0]
    assert not d.start and d.reason == Reason.RESOURCES and d.est_start == NOW + 300
    assert "reserved for it in 5m" in d.detail


def test_a_job_that_no_usable_gpu_fits_waits_with_no_estimate():
    nodes = cluster((12,), (8,))
    nodes[0].usable = False  # the 12 GB node is down
    d = plan(NOW, nodes, [], [Demand(job=2, gpus=1, min_vram_mb=10 * 1024)])[0]
    assert not d.start and d.est_start is None and d.reason == Reason.NO_FIT
    assert d.detail == "needs 1 GPUs with at least 10.0 GB; 0 such GPUs are up"


def test_running_jobs_past_their_limit_are_expected_to_free_their_gpus_now():
    nodes = cluster((8,))
    d = plan(NOW, nodes, [Running(job=1, slots=[(1, 0)], ends_at=NOW - 50)], [Demand(job=2, gpus=1)])[0]
    assert not d.start and d.est_start == NOW


def test_estimates_queue_up_behind_each_other():
    nodes = cluster((8,))
    queued = [Demand(job=i, gpus=1, time_limit=100, submitted=i) for i in range(1, 4)]
    d = plan(NOW, nodes, [], queued)
    assert [x.start for x in d] == [True, False, False]
    assert [x.est_start for x in d] == [NOW, NOW + 100, NOW + 200]
    assert [x.reason for x in d[1:]] == [Reason.RESOURCES, Reason.PRIORITY]


def test_fair_share_puts_the_lighter_user_first_at_equal_priority():
    nodes = cluster((8,))
    queued = [Demand(job=1, owner=7, gpus=1, submitted=1), Demand(job=2, owner=8, gpus=1, submitted=2)]
    usage = {7: 5000.0, 8: 10.0}
    d = plan(NOW, nodes, [], queued, usage=usage)
    assert [x.job for x in d] == [2, 1] and d[0].start
    # but priority still comes first
    queued[0].priority = 1
    assert plan(NOW, nodes, [], queued, usage=usage)[0].job == 1


def test_usage_decays_with_the_half_life():
    hour = 3600.0
    # one GPU for one hour that ended one half-life ago counts half as much as one that just ended
    old = decayed_usage([(1, NOW - 25 * hour, NOW - 24 * hour, 1)], NOW, 24 * hour)[1]
    new = decayed_usage([(1, NOW - hour, NOW, 1)], NOW, 24 * hour)[1]
    assert math.isclose(old / new, 0.5, rel_tol=1e-9)
    assert math.isclose(new, hour, rel_tol=0.02)  # an hour ago barely decayed
    # GPUs multiply, a running job counts up to now
    assert math.isclose(decayed_usage([(2, NOW - hour, NOW + hour, 4)], NOW, 24 * hour)[2], 4 * new)


def test_gpu_quota_holds_back_a_users_job_but_not_others():
    nodes = cluster((8, 8, 8, 8))
    running = [Running(job=1, slots=[(1, 0), (1, 1)], ends_at=NOW + 100, owner=7)]
    queued = [Demand(job=2, owner=7, gpus=1, submitted=1), Demand(job=3, owner=8, gpus=2, submitted=2)]
    d = by_job(plan(NOW, nodes, running, queued, limits=Limits(quota_max_gpus=2)))
    assert not d[2].start and d[2].reason == Reason.QUOTA
    assert d[2].detail == "its owner holds 2 of at most 2 GPUs at once and it needs 1"
    assert d[3].start


def test_a_sweep_runs_at_most_its_max_concurrent_trials():
    nodes = cluster((8, 8, 8, 8))
    queued = [Demand(job=i, gpus=1, group=5, submitted=i) for i in range(1, 5)]
    d = plan(NOW, nodes, [], queued, limits=Limits(group_limits={5: 2}))
    assert [x.start for x in d] == [True, True, False, False]
    assert d[2].reason == Reason.QUOTA and "at most 2 trials" in d[2].detail
