"""Recovery on real sshd nodes and real torchrun: checkpoints, resume as a new attempt, retries, hangs, stragglers.

Failures are injected for real: a rank's training process is killed with SIGKILL, a node's sshd is
stopped, the reference script sleeps, runs out of (injected) CUDA memory, or one rank sleeps longer.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from jobs import checkpoints
from jobs.models import Attempt, Checkpoint, Job, Rank
from metrics.models import FinalMetric, JobMetrics, MetricPoint

from .conftest import job_pids, training_pids, wait_for
from .loopback import on_node

pytestmark = pytest.mark.e2e
# 100 short steps, a checkpoint every 50, a metric line every 10 (the same on every run: same seed)
TRAIN = ["--max-steps", "100", "--seq-len", "16", "--batch-size", "4", "--log-every", "10", "--save-every", "50",
         "--step-sleep", "0.05"]  # fmt: skip


@pytest.fixture
def recovery_settings(lab, fast_settings, monkeypatch):
    monkeypatch.setattr("jobs.follow.CHECKPOINT_SCAN_S", 0.5)
    monkeypatch.setattr("jobs.recovery.RETRY_BACKOFF_S", 0.5)
    return lab


def run(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def last_step(job: Job) -> int:
    return MetricPoint.objects.filter(job=job, attempt=job.attempt, name="loss").order_by("-step").values_list(
        "step", flat=True
    ).first() or 0  # fmt: skip


def follow_until(job: Job, predicate, timeout: float = 240, what: str = "condition"):
    """Wait while the worker follows and reconciles the job, until predicate() holds (bounded: a whole CI run on 2
    cores kept a Hugging Face Trainer from its step 25 for over 120 s)."""
    return wait_for(predicate, timeout=timeout, interval=0.1, what=what)


def final_losses(job: Job, step: int) -> dict[int, float]:
    return dict(
        MetricPoint.objects.filter(job=job, name="loss", step=step, superseded=False).values_list("rank", "value")
    )


# -- checkpoints ----------------------------------------------------------------------------------


def test_checkpoints_are_recorded_with_step_node_and_size_and_only_complete_ones_are_offered(
    recovery_settings, client, django_user_model
):
    """Covers: checkpoints a real run writes on its node, scanned through the agent: step, node and size recorded,
    temporary, growing and incomplete ones not offered; the page and `results` list them.
    """
    lab = recovery_settings
    # given a running job that saves checkpoint_step<N>.pt and has a glob for other files
    run("launch", "--name", "ck", "--nodes", "2", "--checkpoint-glob", "extra/{job}/*.bin", "--detach", "--",
        "--max-steps", "2000", "--seq-len", "16", "--batch-size", "4", "--log-every", "5", "--save-every", "10",
        "--step-sleep", "0.1")  # fmt: skip
    job = Job.objects.get(name="ck")
    follow_until(job, lambda: Checkpoint.objects.filter(job=job, ready=True).count() >= 2, what="two checkpoints")
    saved = Checkpoint.objects.filter(job=job, ready=True).order_by("step").first()
    assert saved.path.endswith(f"outputs/ck/checkpoint_step{saved.step}.pt") and saved.step % 10 == 0
    assert saved.size == Path(saved.path).stat().st_size > 0 and saved.kind == "file"
    node_dir = Path(saved.path).parent
    rank = job.ranks.select_related("node", "job").get(node=saved.node)
    workdir = Path(rank.node.workdir)

    # when an HF directory without trainer_state.json, a temp file and a growing file appear
    hf = node_dir / "checkpoint-500"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"x" * 1000)
    (node_dir / ".checkpoint_step999.pt.tmp.42").write_bytes(b"y" * 10)
    growing = workdir / "extra" / "ck" / "weights_step700.bin"
    growing.parent.mkdir(parents=True)
    growing.write_bytes(b"z" * 100)
    checkpoints.scan(rank)
    growing.write_bytes(b"z" * 200)  # still being written between two listings
    checkpoints.scan(rank)
    # then none of them is offered, the temp file is not even recorded
    by_path = {c.path: c for c in Checkpoint.objects.filter(job=job)}
    assert not by_path[str(hf)].ready and by_path[str(hf)].step == 500 and by_path[str(hf)].kind == "dir"
    assert not by_path[str(growing)].ready and by_path[str(growing)].step == 700
    assert not any(".tmp." in Path(p).name for p in by_path)
    assert 500 not in [c.step for c in checkpoints.offered(job)]

    # when the Trainer writes trainer_state.json and the file stops growing
    (hf / "trainer_state.json").write_text("{}")
    checkpoints.scan(rank)
    checkpoints.scan(rank)
    offered = {c.step for c in checkpoints.offered(job)}
    # then both are offered, the directory with the size of everything in it
    assert {500, 700} <= offered
    assert Checkpoint.objects.get(job=job, path=str(hf)).size == 1002

    # and the page and `results` list them (step, node, size, age) without asking a node
    run("cancel", "ck")
    from django.contrib.auth.models import Group

    viewer = django_user_model.objects.create_user("alice", password="x" * 12)
    client.force_login(viewer)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "checkpoint-500" in page and 'id="resume-btn"' not in page  # she may look, not resume
    viewer.groups.add(Group.objects.get(name="operator"))
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="checkpoints"' in page and "checkpoint-500" in page and saved.node.name in page
    assert 'id="resume-btn"' in page and '<option value="700">step 700</option>' in page
    results = run("results", "ck")
    assert "complete)" in results and "checkpoint-500" in results and f" {saved.step} " in results
    assert job_pids(job.tag) == [] and lab


# -- resume ---------------------------------------------------------------------------------------


def test_a_rank_killed_at_step_60_resumes_from_step_50_and_ends_as_an_uninterrupted_run(recovery_settings):
    """Covers: a rank's training process SIGKILLed on a real node (the job fails naming rank, node and signal, the
    other rank stopped, the critical alert opened), then resume on two other nodes: the checkpoint copied to rank 0's
    node (sha256), the run ending exactly as an uninterrupted one, one curve, each attempt's logs apart.
    """
    # given an uninterrupted run of the reference script
    run("launch", "--name", "whole", "--nodes", "2", "--", *TRAIN)
    whole = Job.objects.get(name="whole")
    assert whole.state == Job.State.SUCCEEDED, whole.failure_reason
    expected = final_losses(whole, 100)
    assert sorted(expected) == [0, 1]

    # when the same run has a rank killed (SIGKILL) after step 60, with a checkpoint at step 50
    run("launch", "--name", "cut", "--nodes", "2", "--detach", "--", *TRAIN)
    job = Job.objects.get(name="cut")
    follow_until(job, lambda: last_step(job) >= 60, what="step 60")
    victim = job.ranks.select_related("node").get(index=1).node.name
    pids = training_pids(job.tag, victim)
    assert pids and last_step(job) < 100
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    follow_until(job, lambda: Job.objects.get(pk=job.pk).is_ended, what="the job to fail")
    job.refresh_from_db()
    # then the job fails naming the rank, its node and the signal, nothing of it survives, and people are told
    assert job.state == Job.State.FAILED, job.state
    assert (job.failure_kind, job.failure_rank, job.failure_node, job.failure_signal) == ("KILLED", 1, victim, 9)
    assert job.failure_reason.startswith(f"KILLED on rank 1 ({victim}), signal 9 (SIGKILL)"), job.failure_reason
    assert job_pids(job.tag) == []
    from cluster.models import Alert

    # the alert is opened after the final state commits (by the teardown's thread): wait for it
    wait_for(lambda: Alert.objects.filter(key="job_failed:cut", resolved_at__isnull=True).exists(), timeout=10,
             what="the job's failure alert")  # fmt: skip
    failed = Alert.objects.get(key="job_failed:cut", resolved_at__isnull=True)
    assert failed.severity == Alert.Severity.CRITICAL and failed.node.name == victim
    failed_at = last_step(job)
    ckpt = checkpoints.choose(job, "latest")
    assert ckpt.step == 50 and ckpt.ready

    # and it is resumed on two nodes that do not hold the checkpoint (it must be copied to rank 0's node)
    others = [n for n in ("node1", "node2", "node3") if n != ckpt.node.name]
    with pytest.raises(CommandError, match="no complete checkpoint at step 70"):
        run("resume", "cut", "--from", "70")
    out = run("resume", "cut", "--from", "50", "--nodes", ",".join(others))
    job.refresh_from_db()
    assert "queued as attempt 2" in out and job.attempt == 2, out
    assert job.ranks.select_related("node").get(index=0).node.name == others[0]
    run("logs", "cut", "--follow")
    job.refresh_from_db()

    # then attempt 2 succeeded, started from step 50, and ends exactly where the uninterrupted run did
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    assert final_losses(job, 100) == pytest.approx(expected, abs=1e-6)
    copied = Path(f"{job.ranks.get(index=0).node.workdir}/outputs/cut/checkpoint_step50.pt")
    assert copied.read_bytes() == Path(ckpt.path).read_bytes()
    assert Checkpoint.objects.get(pk=ckpt.pk).sha256
    config = json.loads((job.job_dir / "config.json").read_text())
    assert config["attempt"] == 2 and "outputs/cut/checkpoint_step50.pt" in config["ranks"][0]["command"]
    # one continuous curve: each step once, attempt 1 up to 50, attempt 2 from 60 (its points replace
    # attempt 1's 60.. which are kept, marked superseded)
    curve = MetricPoint.objects.filter(job=job, name="loss", rank=0, superseded=False).order_by("step")
    assert [p.step for p in curve] == list(range(10, 101, 10))
    assert {p.step: p.attempt for p in curve} == {s: 1 if s <= 50 else 2 for s in range(10, 101, 10)}
    assert MetricPoint.objects.filter(job=job, name="loss", attempt=1, superseded=True, step__gt=50).count() >= 2
    attempt1 = Attempt.objects.get(job=job, number=1)
    assert attempt1.state == "failed" and attempt1.last_step == failed_at and "from step 50" in attempt1.next_reason
    # logs keep each attempt apart
    first_logs, now_logs = run("logs", "cut", "--attempt", "1"), run("logs", "cut")
    assert '"step": 60' in first_logs and "resuming from" not in first_logs
    assert "resuming from outputs/cut/checkpoint_step50.pt" in now_logs and '"step": 60' in now_logs
    assert '"step": 10,' not in now_logs
    with pytest.raises(CommandError, match="no attempt 5"):
        run("logs", "cut", "--attempt", "5")
    # and the chart endpoint marks where attempt 2 joined
    from django.test import Client

    c = Client()
    c.force_login(__import__("django.contrib.auth", fromlist=["get_user_model"]).get_user_model().objects.create_user(
        "bob", password="x" * 12))  # fmt: skip
    series = c.get(f"/api/jobs/{job.pk}/series?name=loss").json()
    assert series["attempts"] == [{"attempt": 2, "step": 50}]
    assert series["ranks"]["0"]["x"] == list(range(10, 101, 10))
    assert job_pids(job.tag) == [] and not Rank.objects.filter(active=True).exists()


def test_resume_refuses_a_running_or_unknown_job_with_one_line_and_changes_nothing(recovery_settings):
    """Covers: `resume` refusing a really running job, an unknown job and an unknown node in one line; the refusals
    themselves are plain logic (a fast test on job rows could hold them).
    """
    run("launch", "--name", "live", "--nodes", "1", "--detach", "--", *TRAIN)
    job = Job.objects.get(name="live")
    with pytest.raises(CommandError, match="only a failed or cancelled job can be resumed"):
        run("resume", "live")
    with pytest.raises(CommandError, match="no job named"):
        run("resume", "nope")
    run("cancel", "live")
    with pytest.raises(CommandError, match="not an enabled node"):
        run("resume", "live", "--from", "scratch", "--nodes", "node9")
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED and job.attempt == 1 and not job.earlier_attempts.exists()


# -- the retry policy -----------------------------------------------------------------------------

SHORT = ["--max-steps", "40", "--seq-len", "16", "--log-every", "5", "--save-every", "20", "--step-sleep", "0.05"]


def drive(job: Job, predicate, timeout: float = 150, what: str = "condition"):
    """Wait while the worker follows, reconciles (hangs, stragglers, the retry policy) and starts the job's
    queued attempts, until predicate() holds."""
    return wait_for(predicate, timeout=timeout, interval=0.1, what=what)


def test_an_oom_with_a_batch_template_is_retried_with_half_the_batch_and_twice_the_accumulation(recovery_settings):
    """Covers: the retry policy acting on a real OOM: attempt 2 started from the step-20 checkpoint with half the batch
    and twice the accumulation; the decision alone is tests/test_recovery.py's.
    """
    from cluster.models import Alert

    # given a job that runs out of memory at step 30 while its per-rank batch is above 2
    run("launch", "--name", "oomy", "--nodes", "1", "--retry", "oom", "--max-attempts", "3",
        "--batch-template=--batch-size {batch} --grad-accum {accum}", "--batch", "4", "--detach", "--",
        *SHORT, "--oom-at-step", "30:2")  # fmt: skip
    job = Job.objects.get(name="oomy")
    # when it fails and the policy acts
    drive(job, lambda: Job.objects.get(pk=job.pk).attempt == 2 and Job.objects.get(pk=job.pk).is_ended,
          what="the retried attempt to end")  # fmt: skip
    job.refresh_from_db()
    # then attempt 2 ran from the step-20 checkpoint with batch 2 x accumulation 2 and finished
    first = Attempt.objects.get(job=job, number=1)
    assert first.failure_kind == "OOM" and "batch 2 x accum 2" in first.next_reason, first.next_reason
    assert job.state == Job.State.SUCCEEDED and job.resume_step == 20, job.failure_reason
    # the job keeps what was asked; each attempt its own batch
    assert job.current.batch == {"batch": 2, "accum": 2} and first.batch == job.batch and job.batch["batch"] == 4
    config = json.loads((job.job_dir / "config.json").read_text())
    command = config["ranks"][0]["command"]
    # the batch arguments after the user's (the last value wins), then the resume argument
    assert command[-6:] == ["--batch-size", "2", "--grad-accum", "2", "--resume-from",
                            "outputs/oomy/checkpoint_step20.pt"]  # fmt: skip
    assert last_step(job) == 40
    assert Alert.objects.filter(key="recovery:oomy", message__contains="retry: attempt 2 of 3 from step 20").exists()


def test_two_attempts_failing_at_the_same_step_stop_as_a_crash_loop(recovery_settings):
    """Covers: two real attempts failing at the same step judged a crash loop, nothing more started across the worker's
    passes.
    """
    from cluster.models import Alert

    # given a script error before step 28, every time, and a policy that would retry it five times
    run("launch", "--name", "loop", "--nodes", "1", "--retry", "script-error", "--max-attempts", "5", "--detach",
        "--", *SHORT, "--batch-size", "4", "--fail-at-step", "28")  # fmt: skip
    job = Job.objects.get(name="loop")

    def decided_twice():
        j = Job.objects.get(pk=job.pk)
        return j.attempt == 2 and j.state == Job.State.FAILED and j.recovery_note

    drive(job, decided_twice, what="attempt 2 to fail and be judged")
    job.refresh_from_db()
    # then attempt 2 (resumed from step 20) failed at step 25 like attempt 1, and nothing more is tried
    assert job.failure_kind == "SCRIPT_ERROR" and job.resume_step == 20
    assert "crash loop" in job.recovery_note and "failed at step 25" in job.recovery_note, job.recovery_note
    alert = Alert.objects.get(key="recovery:loop", resolved_at__isnull=True)
    assert alert.severity == Alert.Severity.CRITICAL and "crash loop" in alert.message
    time.sleep(3)  # three of the worker's reconciler passes
    job.refresh_from_db()
    assert job.attempt == 2 and job.state == Job.State.FAILED


def test_a_lost_node_without_min_nodes_waits_queued_and_the_job_resumes_there_from_its_checkpoint(
    recovery_settings,
):
    """Covers: a lost node, ranks frozen, no --min-nodes: the retry waits QUEUED for it, its frozen processes are
    stopped when it is back, and it resumes there from a checkpoint copied to the other node; what the lost rank
    wrote while its node was away is fetched into attempt 1's log once it is back.
    """

    lab = recovery_settings
    # given a 2-node job that may be retried after a lost node, but names no --min-nodes
    run("launch", "--name", "away", "--nodes", "2", "--retry", "node-lost", "--max-attempts", "3", "--detach", "--",
        "--max-steps", "60", "--seq-len", "16", "--batch-size", "4", "--log-every", "5", "--save-every", "10",
        "--step-sleep", "0.1")  # fmt: skip
    job = Job.objects.get(name="away")
    drive(job, lambda: checkpoints.offered(job) and last_step(job) >= 15, what="a checkpoint")
    # the node cut off is the one that holds the checkpoints (global rank 0's): they exist only there
    gone = checkpoints.offered(job)[0].node.name
    kept = next(n for n in job.ranks.values_list("node__name", flat=True) if n != gone)
    cut = lab.nodes[int(gone[-1]) - 1]
    tag = job.tag
    frozen = on_node(job_pids(tag), gone)
    assert frozen
    try:
        # when that node falls off the network: its sshd stops and its ranks freeze (they never answer again)
        cut.stop()
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        drive(job, lambda: Job.objects.filter(pk=job.pk, state=Job.State.QUEUED, current__number=2).exists(),
              what="the retry to wait in the queue")  # fmt: skip
        queued = time.monotonic() - t0
        job.refresh_from_db()
        # then attempt 1 failed as NODE_LOST and attempt 2 is QUEUED, waiting for that node, from its checkpoint
        first = Attempt.objects.get(job=job, number=1)
        assert first.failure_kind == "NODE_LOST" and gone in first.failure_reason
        assert job.wait_nodes == [gone] and f"once {gone} is back" in job.recovery_note, job.recovery_note
        assert job.resume_checkpoint.node.name == gone and job.resume_step >= 10 and job.resume_step % 10 == 0
        assert f"waiting for node {gone} to come back" in run("queue")
        # and it is not started elsewhere while the node is away (the third node is free)
        time.sleep(3)  # three of the worker's reconciler and scheduler passes
        job.refresh_from_db()
        assert job.state == Job.State.QUEUED and job.wait_nodes == [gone] and not job.ranks.exists()
        # when, while the node is away, its training process wakes (its torchrun stays frozen): it finds its peer
        # gone and says so in its log on the node, which no one can read from here
        lost = Rank.objects.get(attempt=first, node__name=gone)
        copied = lost.log_offset
        for pid in frozen:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"train_production.py" in cmdline and b"torchrun" not in cmdline:
                os.kill(pid, signal.SIGCONT)
        wait_for(lambda: Path(lost.remote_log).stat().st_size > copied, timeout=60, what="the woken rank to write")
    finally:
        # when the node is back
        cut.start()
    t1 = time.monotonic()

    def training_again() -> bool:
        j = Job.objects.get(pk=job.pk)
        return j.state in (Job.State.RUNNING, Job.State.SUCCEEDED) and last_step(j) > (j.resume_step or 0)

    drive(job, training_again, what="attempt 2 to train")
    back = time.monotonic() - t1
    drive(job, lambda: Job.objects.get(pk=job.pk).is_ended, what="attempt 2 to end")
    job.refresh_from_db()
    # then attempt 1's frozen processes there were stopped before anything started, and attempt 2 ran on the
    # same two nodes from the checkpoint that lived only on the lost node, copied (sha256) to the other
    assert on_node(job_pids(tag), gone) == []
    assert job.state == Job.State.SUCCEEDED and job.attempt == 2, job.failure_reason
    assert sorted(job.ranks.values_list("node__name", flat=True)) == sorted([gone, kept])
    ckpt = job.resume_checkpoint
    rel = checkpoints.path_for_rank0(ckpt)
    node_dir = {n.name: n.workdir for n in lab.nodes}
    copy = Path(node_dir[kept]) / rel
    assert copy.read_bytes() == Path(ckpt.path).read_bytes() and len(Checkpoint.objects.get(pk=ckpt.pk).sha256) == 64
    steps = sorted(set(MetricPoint.objects.filter(job=job, name="loss", attempt=2).values_list("step", flat=True)))
    assert steps[0] == job.resume_step + 5 and steps[-1] == 60, steps
    assert f"resuming from {rel}" in run("logs", "away")
    # and what attempt 1's rank on that node wrote while the node was away reached attempt 1's archived log once
    # the node was back (jobs/follow.py recover_earlier_output), byte for byte the node's
    lost = Rank.objects.select_related("job", "attempt").get(pk=lost.pk)
    assert lost.state == Rank.State.LOST
    on_node_log = Path(lost.remote_log)
    assert on_node_log.stat().st_size > copied
    drive(job, lambda: Rank.objects.get(pk=lost.pk).log_offset == on_node_log.stat().st_size,
          what="attempt 1's lost rank's output")  # fmt: skip
    assert lost.local_log.read_bytes() == on_node_log.read_bytes() and "attempt_1" in str(lost.local_log)
    print(f"node lost, no --min-nodes: queued after {queued:.1f}s, training again {back:.1f}s after the node was back")


# -- hangs and stragglers -------------------------------------------------------------------------


def test_a_hung_job_is_flagged_its_stacks_dumped_and_the_retry_policy_applied(recovery_settings):
    """Covers: a real job falling silent: flagged HUNG, every rank's stacks dumped into its log (SIGUSR1 through the
    agent), then retried from its checkpoint.
    """
    from cluster.models import Alert

    # given a job that stops printing after step 25 (it sleeps), with a 3 s hang limit and one retry allowed
    run("launch", "--name", "hung", "--nodes", "2", "--hang-after", "3", "--retry", "hang", "--max-attempts", "2",
        "--detach", "--", *SHORT, "--batch-size", "4", "--sleep-at-step", "25:600")  # fmt: skip
    job = Job.objects.get(name="hung")
    # when it falls silent
    drive(job, lambda: Job.objects.get(pk=job.pk).attempt == 2, what="the hang to be retried")
    # then it was flagged HUNG with an alert, and every rank's stacks are in its logs (faulthandler on SIGUSR1)
    first = Attempt.objects.get(job=job, number=1)
    assert first.failure_kind == "HANG" and "no metric line for" in first.failure_reason
    assert Alert.objects.filter(key="hung:hung", message__contains="HUNG").exists()
    logs = run("logs", "hung", "--attempt", "1")
    assert logs.count("most recent call first") >= 2 and "train_production.py" in logs
    assert "SIGUSR1" in first.failure_reason or "py-spy" in first.failure_reason
    # and the retry resumed from the step-20 checkpoint (giving up after the last attempt: test_recovery.py)
    job.refresh_from_db()
    assert job.resume_step == 20
    run("cancel", "hung")
    assert job_pids(job.tag) == []


def test_a_rank_sleeping_half_again_per_step_is_flagged_as_a_straggler(recovery_settings, client,
                                                                      django_user_model):  # fmt: skip
    """Covers: step times of three real ranks, one 50 % slower, flagged as a straggler on the page and in an alert on
    its node; the ratio rule alone is tests/test_recovery.py's.
    """
    from cluster.models import Alert
    from jobs.recovery import stragglers

    # given three ranks, one of which sleeps 50 % more per step
    run("launch", "--name", "slow", "--nodes", "3", "--detach", "--", "--max-steps", "2000", "--seq-len", "16",
        "--batch-size", "4", "--log-every", "5", "--step-sleep", "0.2", "--slow-rank", "2:0.1")  # fmt: skip
    job = Job.objects.get(name="slow")
    # when three windows of step times are in
    drive(job, lambda: Alert.objects.filter(key="straggler:slow").exists(), what="the straggler alert")
    # then rank 2 is flagged, with the node that runs it, on the page and in an alert on that node
    found = stragglers(job)
    assert [s["rank"] for s in found] == [2] and found[0]["ratio"] > 1.33
    node = found[0]["node"]
    assert any('"rank": 2,' in line for line in run("logs", "slow", "--rank", str(
        job.ranks.get(node=node).index)).splitlines())  # fmt: skip
    alert = Alert.objects.get(key="straggler:slow")
    assert alert.node == node and "rank 2" in alert.message and "straggler" in alert.message
    client.force_login(django_user_model.objects.create_user("carol", password="x" * 12))
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="straggler-2"' in page and f"rank 2 on {node.name} is a straggler" in page
    run("cancel", "slow")
    assert job_pids(job.tag) == []


def test_a_hugging_face_trainer_resumes_from_its_checkpoint_directory_on_other_nodes(recovery_settings):
    """Covers: an unmodified Hugging Face Trainer's checkpoint-N directory found where it wrote it, copied to other
    nodes and resumed through its own --resume_from_checkpoint; retention (`--keep 1,best:eval_loss:1`) keeping the
    latest and the best by the Trainer's own eval_loss across the three nodes, every copy of the others deleted by
    the nodes' agents (the resume's copies too), as status NAME says; its printed logs read at its own steps, eval
    and final metrics, progress (the parser alone runs on recorded output: tests/test_framework_corpus.py).
    """
    import shutil

    frameworks = Path(__file__).parent / "data" / "frameworks"
    for node in recovery_settings.nodes[:3]:
        (node.workdir / "frameworks").mkdir(exist_ok=True)
        shutil.copy(frameworks / "hf_trainer.py", node.workdir / "frameworks" / "hf_trainer.py")
    # given an unmodified Trainer script with its own output_dir (not outputs/<job>: UGRO is told nothing of
    # it), saving checkpoint-<N>/ every 10 steps and crashing at step 25
    # (evaluating every 10 steps; keeping the latest checkpoint and the best by eval_loss)
    run("launch", "--name", "hfr", "--nodes", "2", "--script", "frameworks/hf_trainer.py",
        "--resume-template=--resume_from_checkpoint {checkpoint}", "--keep", "1,best:eval_loss:1", "--detach", "--",
        "--max-steps", "30", "--logging-steps", "5", "--save-steps", "10", "--eval-steps", "10",
        "--fail-at-step", "25", "--output-dir", "my_runs/hf")  # fmt: skip
    job = Job.objects.get(name="hfr")
    follow_until(job, lambda: Job.objects.get(pk=job.pk).is_ended, what="the crash")
    job.refresh_from_db()
    assert job.state == Job.State.FAILED, job.state
    # then both of its checkpoints were found where it wrote them (the worker's follower records them as it
    # scans, its last scan at the end) and judged by retention; the latest is offered, step 10 only if its
    # eval_loss is the best so far
    rows = Checkpoint.objects.filter(job=job)  # (a Trainer's rank 1 writes its part of checkpoint-N on its node)
    follow_until(job, lambda: set(rows.values_list("step", flat=True)) == {10, 20} and not rows.filter(
        keep_reason="").exists(), timeout=60, what="its checkpoints, judged")  # fmt: skip
    evals = dict(MetricPoint.objects.filter(job=job, name="eval_loss").values_list("step", "value"))
    assert sorted(evals) == [10, 20], evals
    follow_until(job, lambda: [c.step for c in checkpoints.offered(job)] == ([20, 10] if evals[10] < evals[20] else
                 [20]), timeout=60, what="retention's first choice")  # fmt: skip
    ckpt = checkpoints.choose(job, "latest")
    assert (ckpt.step, ckpt.kind) == (20, "dir") and ckpt.path.endswith("my_runs/hf/checkpoint-20")
    # when it is resumed on two nodes without that directory
    others = [n for n in ("node1", "node2", "node3") if n != ckpt.node.name]
    run("resume", "hfr", "--nodes", ",".join(others))
    run("logs", "hfr", "--follow")
    job.refresh_from_db()
    # then the Trainer went on from step 20 (its own global step) with the copied directory, and finished
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    steps = sorted(set(MetricPoint.objects.filter(job=job, name="loss", attempt=2).values_list("step", flat=True)))
    assert steps == [25, 30], steps
    config = json.loads((job.job_dir / "config.json").read_text())
    assert config["ranks"][0]["command"][-2:] == ["--resume_from_checkpoint", "my_runs/hf/checkpoint-20"]
    # and retention kept the newest (30) and the best by eval_loss; every copy of the others is gone from the three
    # nodes (step 20 from where it was written and from both nodes the resume copied it to), the kept ones stay
    evals = dict(MetricPoint.objects.filter(job=job, name="eval_loss", superseded=False).values_list("step", "value"))
    assert sorted(evals) == [10, 20, 30], evals
    kept = {30, min(evals, key=lambda s: (evals[s], -s))}
    # (the seeded run's eval_loss rises on its random tokens: 10 is the best, 20 the one to free everywhere)
    assert kept == {10, 30}, evals
    follow_until(job, lambda: not Checkpoint.objects.filter(job=job, removed_at__isnull=True).exclude(
        step__in=kept).exists(), timeout=60, what="retention")  # fmt: skip
    runs = {n.name: Path(n.workdir) / "my_runs" / "hf" for n in recovery_settings.nodes[:3]}
    held = {(n, s) for n, d in runs.items() for s in (10, 20, 30) if (d / f"checkpoint-{s}").exists()}
    assert {s for _, s in held} == kept, held
    whole = Checkpoint.objects.filter(job=job, ready=True, removed_at__isnull=True)
    assert sorted(c.step for c in whole) == [10, 30] and all(Path(c.path).exists() for c in whole)
    freed = Checkpoint.objects.filter(job=job, removed_at__isnull=False).select_related("node")
    assert {c.node.name for c in freed} == {"node1", "node2", "node3"} and {c.step for c in freed} == {20}, freed
    said = f"checkpoints: kept {len(kept)} (latest 1, best eval_loss 1), freed {3 - len(kept)} ("
    assert said in run("status", "hfr")
    # and the Trainer's printed logs (transformers 5: its numbers as strings) were read at its own steps, on the
    # rank whose node ran global rank 0: one curve across both attempts
    loss: dict[int, list[int]] = {}
    for rank, step in (
        MetricPoint.objects.filter(job=job, name="loss", superseded=False).order_by("step").values_list("rank", "step")
    ):
        loss.setdefault(rank, []).append(step)
    assert len(loss) == 1 and list(loss.values())[0] == [5, 10, 15, 20, 25, 30], loss
    (rank,) = loss
    # and its end-of-training summary is the job's final metrics, not a curve point; progress is out of its bar's M
    finals = dict(FinalMetric.objects.filter(job=job, rank=rank).values_list("name", "value"))
    assert {"train_runtime", "train_loss", "train_samples_per_second"} <= finals.keys(), finals
    assert not MetricPoint.objects.filter(job=job, name__in=["train_runtime", "train_loss"]).exists()
    progress = JobMetrics.objects.get(job=job)
    assert (progress.step, progress.total_steps) == (30, 30)
    assert f"final train_loss rank {rank}: {finals['train_loss']:.6g} at step 30" in run("results", "hfr")
