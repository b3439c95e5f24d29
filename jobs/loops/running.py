"""The running loop: a RUNNING job's ranks are what their nodes say, and the job is judged on them.

- Each running rank is checked on its node (`rank_status`): a rank whose wrapper is gone without an exit
  record, or whose node rebooted since it started, is LOST; a rank whose node has not answered for
  NODE_LOST_AFTER_S is LOST (a late answer is not silence). Then the job is judged (lifecycle.judge).
- RUNNING with no metric line for longer than its hang limit: HUNG (jobs/recovery.py check_hang).
- A rank much slower than the others: a straggler alert (jobs/recovery.py check_stragglers).
- Checkpoints beyond the job's --keep: deleted on every node that holds them (jobs/retention.py).
- A running attempt's energy meters folded from the health samples every minute, an ended one's made final
  (jobs/energy.py record_due; a conditional update, so no lock).

Batch: the RUNNING jobs, each claimed under locks.RUNNING (retention: under locks.RETENTION).
"""

from __future__ import annotations

from django.conf import settings
from django.utils import timezone

from cluster.fanout import node_request, on_each, unreachable

from .. import energy, lifecycle, locks, recovery
from ..models import Job, Rank
from . import Report, each_claimed, run_retention, run_rule, scope

STATUS_TIMEOUT_S = 5.0


def run(job_ids: list[int] | None, report: Report, *, wait: bool) -> None:
    """One pass of the loop over every job (job_ids None) or the given ones."""
    running = scope(job_ids).filter(state=Job.State.RUNNING)
    run_rule("running", lambda: each_claimed(locks.RUNNING, running, lambda job: check_job(job, report), wait=wait))
    run_rule("retention", lambda: report.freed.extend(run_retention(running, wait=wait)))
    run_rule("energy", lambda: energy.record_due(scope(job_ids)))


def check_job(job: Job, report: Report) -> None:
    """A running job: its ranks checked on their nodes, then judged; else hang and straggler checks."""
    report.lost += check_ranks(job)
    job.refresh_from_db()
    if lifecycle.judge(job):
        report.judged.append(job.name)
    elif recovery.check_hang(job):
        report.hung.append(job.name)
    else:
        report.stragglers += [f"{job.name}: {m}" for m in recovery.check_stragglers(job)]


def check_ranks(job: Job) -> list[str]:
    """Ask each node how the job's running ranks are; mark the ones that are gone LOST."""
    ranks = list(job.ranks.select_related("node", "job").filter(state=Rank.State.RUNNING))
    by_node: dict[int, list[Rank]] = {}
    for r in ranks:
        by_node.setdefault(r.node_id, []).append(r)

    def status(group: list[Rank]) -> dict:
        items = [
            {"key": r.start_key, "record": r.start_record, "exit_file": r.remote_exit, "tag": job.tag,
             "node": r.node.name}
            for r in group
        ]  # fmt: skip
        return node_request(group[0].node, "rank_status", timeout=STATUS_TIMEOUT_S, ranks=items)

    lost = []
    now = timezone.now()
    lost_after = settings.UGRO["NODE_LOST_AFTER_S"]
    for group, result, err in on_each(list(by_node.values()), status):
        for i, rank in enumerate(group):
            reason = None
            if err is not None:
                since = rank.last_contact or rank.started_at or now
                if unreachable(err) and (now - since).total_seconds() > lost_after:
                    reason = f"node {rank.node.name} stopped answering: {err}"
            else:
                reason = _gone_reason(rank, result["ranks"][i])
            if reason and lifecycle.rank_lost(rank, reason):
                lost.append(f"{job.name}/{rank.index}")
    return lost


def _gone_reason(rank: Rank, st: dict) -> str | None:
    """Why a running rank is gone by its node's account (the agent's rank_status), or None while it may
    still run."""
    if st.get("exit") is not None:
        return None  # it ended and said so: the follower takes its last lines and exit code
    if st.get("rebooted") or (rank.boot_id and st.get("boot_id") and st["boot_id"] != rank.boot_id):
        return f"node {rank.node.name} rebooted since rank {rank.index} started"
    if not st.get("record"):
        return f"node {rank.node.name} has no record of starting rank {rank.index}"
    if not st.get("wrapper_alive") and not st.get("torchrun_alive"):
        return f"rank {rank.index}'s process on {rank.node.name} is gone without recording an exit code"
    return None
