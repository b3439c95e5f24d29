"""The planner on its own (jobs/placement.py): backfill, reservations, VRAM fit, fair share, quotas."""

from __future__ import annotations

import math
import random

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


def test_a_pass_that_only_starts_jobs_starts_what_a_pass_with_every_estimate_starts():
    # given many seeded mixed queues on a partly busy cluster of 8, 12 and 24 GB cards
    rng = random.Random(7)
    for _ in range(60):
        nodes = cluster((8, 8), (12, 12), (24, 24), (8, 12))
        busy = rng.sample([(n, g) for n in range(1, 5) for g in range(2)], rng.randint(0, 6))
        running = [
            Running(job=100 + i, slots=[key], ends_at=NOW + rng.choice([60, 600, 6000])) for i, key in enumerate(busy)
        ]
        queued = []
        for i in range(1, rng.randint(2, 40)):
            shape = rng.choice([{"gpus": rng.choice([1, 1, 2, 3, 4, 8])}, {"nodes": rng.choice([1, 2]), "per_node": 2}])
            vram = rng.choice([None, None, 10 * 1024, 20 * 1024])
            limit = rng.choice([60, 600, 3600, 9000])
            priority = rng.choice([0, 0, 10, 50])
            queued.append(Demand(job=i, priority=priority, submitted=i, time_limit=limit, min_vram_mb=vram, **shape))
        for depth in (0, 1, 3):
            limits = Limits(reservations=depth)
            # when one pass plans every estimate and the other only what starts now
            full = plan(NOW, nodes, running, queued, limits=limits)
            quick = plan(NOW, nodes, running, queued, limits=limits, estimates=False)
            # then the same jobs start on the same GPUs
            assert [(d.job, d.placement) for d in full if d.start] == [(d.job, d.placement) for d in quick if d.start]
            assert [d.job for d in full if d.reserved] == [d.job for d in quick if d.reserved]


def loan_setup(reserved_in: float = 3600.0):
    """2 nodes x 2 GPUs; node 1 busy until reserved_in; a 4-GPU job (priority 50) waits, a long 2-GPU job behind."""
    nodes = cluster((8, 8), (8, 8))
    running = [Running(job=1, slots=[(1, 0), (1, 1)], ends_at=NOW + reserved_in)]
    queued = [
        Demand(job=10, priority=50, gpus=4, time_limit=3600, submitted=1),
        Demand(job=11, priority=0, gpus=2, time_limit=7200, submitted=2),  # runs past the reservation
    ]
    return nodes, running, queued


def test_without_preemption_a_job_that_would_run_past_a_reservation_waits():
    nodes, running, queued = loan_setup()
    d = by_job(plan(NOW, nodes, running, queued))
    assert d[10].reserved and not d[11].start and d[11].reason == Reason.RESERVATION


def test_with_preemption_a_later_job_runs_on_loan_on_reserved_gpus_and_is_preempted_when_the_reserved_job_can_start():
    # given preemption on, and a 4-GPU job reserved from when node 1 frees up
    nodes, running, queued = loan_setup()
    limits = Limits(preempt=True)
    d = by_job(plan(NOW, nodes, running, queued, limits=limits))
    # then the long 2-GPU job starts now on node 2, on loan
    assert d[10].reserved and d[10].est_start == NOW + 3600 and not d[10].preempt
    assert d[11].start and d[11].loan and d[11].placement == [(2, [0, 1])]
    assert "on loan: GPUs reserved for job 10" in d[11].detail
    # when node 1's job ends early (before the reservation's estimate), the loan holds node 2
    loaned = [Running(job=11, slots=[(2, 0), (2, 1)], ends_at=NOW + 7200, priority=0, submitted=2, loan=True)]
    d = by_job(plan(NOW + 60, nodes, loaned, queued[:1], limits=limits))
    # then the 4-GPU job does not wait for the loan's time limit: it preempts it (requeue), now
    assert not d[10].start and d[10].reserved and d[10].preempt == [11]
    assert d[10].reason == Reason.PREEMPTING and d[10].est_start == NOW + 60
    assert "requeueing job(s) on loan on its GPUs: 11" in d[10].detail


def test_only_jobs_on_loan_behind_the_reserved_job_are_preempted():
    nodes, _, queued = loan_setup()

    def preempted(**running) -> list[int]:
        r = [Running(job=11, slots=[(2, 0), (2, 1)], ends_at=NOW + 7200, submitted=2, **running)]
        return plan(NOW, nodes, r, queued[:1], limits=Limits(preempt=True))[0].preempt

    assert preempted(loan=True) == [11]
    assert preempted(loan=False) == []  # a job that started normally keeps its GPUs to its time limit
    assert preempted(loan=True, priority=90) == []  # one ahead of the reserved job in the queue's order
    # and with preemption off, loans are ordinary jobs
    r = [Running(job=11, slots=[(2, 0), (2, 1)], ends_at=NOW + 7200, submitted=2, loan=True)]
    assert plan(NOW, nodes, r, queued[:1])[0].preempt == []


def test_gpus_reserved_to_start_soon_are_not_lent():
    # given the reservation starts in 5 minutes (less than the minimum loan)
    nodes, running, queued = loan_setup(reserved_in=300)
    d = by_job(plan(NOW, nodes, running, queued, limits=Limits(preempt=True, min_loan_s=600)))
    # then the long job waits: a loan that short would be requeued before it could checkpoint
    assert not d[11].start and d[11].reason == Reason.RESERVATION


def test_estimates_come_from_user_limits_and_earlier_runs_never_the_default_limit():
    # given one GPU held by a job with the default limit (a day) whose script usually runs 40 s; it began 10 s ago
    day = 86400.0
    nodes = cluster((8,))
    running = [Running(job=1, slots=[(1, 0)], ends_at=NOW - 10 + day, limit_set=False, typical_end=NOW + 30)]
    # and behind it a job like it, then one whose user set 100 s, then one with nothing known
    queued = [
        Demand(job=10, time_limit=day, gpus=1, submitted=1, limit_set=False, typical_s=40),
        Demand(job=11, time_limit=100, gpus=1, submitted=2),
        Demand(job=12, time_limit=day, gpus=1, submitted=3, limit_set=False),
        Demand(job=13, time_limit=60, gpus=1, submitted=4),
    ]
    d = by_job(plan(NOW, nodes, running, queued))
    # then each starts when the one before is expected to end; after the unknown one, nothing is known
    assert [d[j].est_start for j in (10, 11, 12, 13)] == [NOW + 30, NOW + 70, NOW + 170, None]
    assert d[10].detail == "next to start: GPUs reserved for it in 30s"
    # what starts and what is reserved still follow the limits: the reservation's bound is a day away
    assert d[10].reserved and not any(d[j].start for j in (11, 12, 13))
    # and a holder whose end is unknown, or which outlived its earlier runs, makes the estimate unknown
    for typical_end in (None, NOW - 5):
        running[0].typical_end = typical_end
        first = plan(NOW, nodes, running, queued[:1])[0]
        assert (
            first.est_start is None
            and first.detail == "next to start: GPUs reserved for it (when they free up: unknown)"
        )
