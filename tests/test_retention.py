"""Checkpoint retention (`--keep LATEST[,best:METRIC:K]`, jobs/retention.py): the spec and its refusals, the
choice, and the deletion of every copy through real node agents (the local transport) on three nodes, two of
which share a working directory, one of them silent for a while."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from cluster.config_yaml import ConfigError, export_cluster, import_cluster
from cluster.links import AgentRequestError, Endpoint, NodeLink, pool
from cluster.models import ClusterSettings, Node
from jobs import checkpoints, retention
from jobs.launch import LaunchError, LaunchRequest, create_job
from jobs.models import Checkpoint, Job, Rank
from jobs.reconcile import reconcile
from jobs.retention import Candidate, Keep, choose, lower_is_better, parse
from metrics.models import MetricPoint

from .conftest import two_launch_nodes
from .jobrows import update_jobs

# -- the spec -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "keep", "written"),
    [
        ("3", Keep(3), "3"),
        (3, Keep(3), "3"),
        ("2,best:eval_loss:1", Keep(2, "eval_loss", 1, lower=True), "2,best:eval_loss:1"),
        (" 2 , best:val/ppl:3 ", Keep(2, "val/ppl", 3, lower=True), "2,best:val/ppl:3"),
        ("1,best:accuracy:2", Keep(1, "accuracy", 2, lower=False), "1,best:accuracy:2"),
        ("1,best:eval_loss:1:max", Keep(1, "eval_loss", 1, lower=False), "1,best:eval_loss:1:max"),
        ("1,best:bleu:1:min", Keep(1, "bleu", 1, lower=True), "1,best:bleu:1:min"),
        ("1,BEST:acc:1:MAX", Keep(1, "acc", 1, lower=False), "1,best:acc:1"),
    ],
)
def test_a_spec_reads_as_latest_and_best_and_is_written_back_the_same(text, keep, written):
    assert parse(text) == keep
    assert str(parse(text)) == written and parse(written) == keep


def test_nothing_given_keeps_everything():
    assert parse("") is None and parse(None) is None and parse("  ") is None


@pytest.mark.parametrize(
    ("name", "lower"),
    [("loss", True), ("eval_loss", True), ("val/ppl", True), ("train_perplexity", True), ("top1_error", True),
     ("eval_wer", True), ("cer", True), ("accuracy", False), ("bleu", False), ("power", False),
     ("acceleration", False)],
)  # fmt: skip
def test_lower_is_better_for_losses_perplexities_and_error_rates(name, lower):
    assert lower_is_better(name) is lower


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "--keep: LATEST must be >= 1"),
        ("-2", "--keep: LATEST must be >= 1"),
        ("bst:loss:1", "--keep: LATEST must be a whole number, not 'bst:loss:1'"),
        ("2,bst:loss:1", "--keep: unknown part 'bst:loss:1' (takes LATEST[,best:METRIC:K[:min|:max]])"),
        ("best:loss:1", "--keep: LATEST comes first, e.g. --keep 2,best:loss:1"),
        ("2,best:loss", "--keep: unknown part 'best:loss'"),
        ("2,best:loss:0", "--keep: K must be >= 1"),
        ("2,best:loss:two", "--keep: K must be a whole number, not 'two'"),
        ("2,best:loss:1:up", "--keep: the direction is min or max, not 'up'"),
        ("2,best::1", "--keep: METRIC must be a metric's name"),
        ("2,best:a b:1", "--keep: METRIC must be a metric's name"),
        ("2,best:loss:1,best:acc:1", "--keep: one best:METRIC:K part at most"),
        ("1000001", "--keep: LATEST must be <= 100000"),
    ],
)
def test_a_bad_spec_is_refused_in_one_line(text, message):
    with pytest.raises(ValueError) as refused:
        parse(text)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


@pytest.fixture
def nodes(db):
    return two_launch_nodes()


def test_a_launch_records_the_typed_spec_else_the_clusters_and_refuses_a_bad_one_creating_nothing(nodes):
    # given a cluster whose cluster.yaml keeps 3 by default
    cs = ClusterSettings.load()
    cs.training = {"keep": 3}
    cs.save()
    # when jobs are launched with and without --keep
    typed = create_job(LaunchRequest(name="typed", keep=" 2 , best:eval_loss:1"))
    default = create_job(LaunchRequest(name="default"))
    # then each records what it keeps: what was typed, else the cluster's default as it was at launch
    assert (typed.keep, default.keep) == ("2,best:eval_loss:1", "3")
    # and a bad spec is refused in one line, on the command line as on the API's path, with nothing made
    with pytest.raises(LaunchError, match=r"^--keep: LATEST must be >= 1$"):
        create_job(LaunchRequest(name="bad", keep="0"))
    with pytest.raises(CommandError, match=r"--keep: unknown part 'bst:loss:1'"):
        call_command("launch", "--name", "bad2", "--keep", "2,bst:loss:1", stdout=io.StringIO())
    assert not Job.objects.filter(name__in=["bad", "bad2"]).exists()


CLUSTER_YAML = """cluster:
  master_ip: 127.0.0.2
nodes:
  gpu1:
    ip: 127.0.0.2
    user: me
training:
  keep: {keep}
"""


def test_the_clusters_default_is_checked_on_import_and_exported_back(db):
    with pytest.raises(ConfigError, match=r"^training\.keep: LATEST must be >= 1 \(line 8\)$"):
        import_cluster(CLUSTER_YAML.format(keep="0"))
    with pytest.raises(ConfigError, match=r"^training\.keep: unknown part 'bst:loss:1'"):
        import_cluster(CLUSTER_YAML.format(keep='"2,bst:loss:1"'))
    assert not Node.objects.exists()
    import_cluster(CLUSTER_YAML.format(keep='"2,best:eval_loss:1"'))
    assert "keep: 2,best:eval_loss:1" in export_cluster()


# -- the choice ---------------------------------------------------------------------------------------------------


def keys(kept: dict[str, str]) -> list[str]:
    return sorted(kept)


CANDIDATES = [
    Candidate("s10", 10, value=0.50),
    Candidate("s20", 20, value=0.90),
    Candidate("s30", 30, value=0.70),
    Candidate("s40", 40, value=0.80),
    Candidate("s50", 50, value=None),  # no eval logged by then
]


def test_the_newest_are_kept_by_step():
    assert keys(choose(CANDIDATES, Keep(2), {})) == ["s40", "s50"]


def test_the_best_by_a_lower_is_better_metric_are_kept_beside_the_newest():
    kept = choose(CANDIDATES, Keep(1, "eval_loss", 2, lower=True), {})
    assert kept == {"s50": "latest", "s10": "best eval_loss 0.5", "s30": "best eval_loss 0.7"}


def test_max_keeps_the_highest_and_a_best_that_is_also_latest_is_kept_once_for_both():
    kept = choose(CANDIDATES[:4], Keep(1, "eval_loss", 2, lower=False), {})
    assert kept == {"s40": "latest, best eval_loss 0.8", "s20": "best eval_loss 0.9"}


def test_a_checkpoint_without_the_metric_is_never_best_but_may_be_latest():
    only = [Candidate("a", 5, value=None), Candidate("b", 6, value=float("nan"))]
    assert choose(only, Keep(1, "loss", 1), {}) == {"b": "latest"}


def test_a_protected_checkpoint_stays_whatever_its_rank():
    kept = choose(CANDIDATES, Keep(1), {"s20": "job x attempt 2 resumes from it", "zz": "not a candidate"})
    assert kept == {"s50": "latest", "s20": "protected: job x attempt 2 resumes from it"}


# -- deleting on the nodes ----------------------------------------------------------------------------------------


@pytest.fixture
def agent():
    link = NodeLink(Endpoint(name="local-agent", address="127.0.0.1", transport="local"), connect_timeout=10)
    yield link
    link.close()


def test_the_agent_deletes_only_the_jobs_checkpoints_and_refuses_anything_else_in_one_line(agent, tmp_path):
    own = tmp_path / "outputs" / "j1"
    (own / "code").mkdir(parents=True)
    (own / "checkpoint_step5.pt").write_bytes(b"x" * 5)
    (tmp_path / "runs" / "checkpoint-10").mkdir(parents=True)
    (tmp_path / "runs" / "checkpoint-10" / "model.safetensors").write_bytes(b"y" * 7)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "glob").mkdir()
    (tmp_path / "glob" / "j1.state").write_bytes(b"z" * 3)
    ask = {"workdir": str(tmp_path), "job": "j1", "globs": ["glob/{job}.state".replace("{job}", "j1")]}
    for path in [tmp_path / "notes.txt", own, own / "code", tmp_path / ".ugro" / "x.pt", Path("/etc/passwd"),
                 tmp_path / "outputs" / "other" / "checkpoint_step1.txt"]:  # fmt: skip
        with pytest.raises(AgentRequestError, match=r"^refused to delete .*: neither under .*outputs/j1/ nor a"):
            agent.request("remove_checkpoints", timeout=10, paths=[str(own / "checkpoint_step5.pt"), str(path)], **ask)
    assert (own / "checkpoint_step5.pt").exists() and (tmp_path / "notes.txt").exists()
    with pytest.raises(AgentRequestError, match="refused: no job directory"):
        agent.request("remove_checkpoints", timeout=10, paths=["/x.pt"], workdir="/", job="j1")
    wanted = [own / "checkpoint_step5.pt", tmp_path / "runs" / "checkpoint-10", tmp_path / "glob" / "j1.state",
              own / "checkpoint_step6.pt"]  # fmt: skip
    answer = agent.request("remove_checkpoints", timeout=10, paths=[str(p) for p in wanted], **ask)
    assert answer["removed"] == {str(wanted[0]): 5, str(wanted[1]): 7, str(wanted[2]): 3}
    assert answer["absent"] == [str(wanted[3])]
    assert not any(p.exists() for p in wanted) and (own / "code").is_dir() and (tmp_path / "notes.txt").exists()


@pytest.fixture
def three(transactional_db, tmp_path):
    """n1 and n2 share one working directory (one workdir id), n3 has its own; each reached through a real agent
    (the local transport)."""
    shared, own = tmp_path / "shared", tmp_path / "n3"
    shared.mkdir()
    own.mkdir()
    made = {}
    for name, workdir, wid in (("n1", shared, "a" * 32), ("n2", shared, "a" * 32), ("n3", own, "b" * 32)):
        made[name] = Node.objects.create(name=name, address="127.0.0.1", transport="local", workdir=str(workdir),
                                         workdir_id=wid, agent_python=sys.executable)  # fmt: skip
    yield made
    pool.close_all()


def saved(job: Job, node: Node, step: int, attempt: int = 1, size: int = 100) -> Checkpoint:
    """checkpoint_step<N>.pt written in the job's directory on the node, recorded as the follower records it."""
    path = Path(node.workdir) / "outputs" / job.name / f"checkpoint_step{step}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"w" * size)
    return Checkpoint.objects.create(job=job, node=node, path=str(path), size=size, mtime=path.stat().st_mtime,
                                     step=step, ready=True, attempt=attempt)  # fmt: skip


def point(job: Job, name: str, step: int, value: float, attempt: int = 1) -> None:
    MetricPoint.objects.create(job=job, rank=0, step=step, name=name, value=value, time=timezone.now(),
                               attempt=attempt)  # fmt: skip


def two_attempts(three: dict[str, Node], keep: str) -> tuple[Job, dict[int, Checkpoint], Path]:
    """A job whose attempt 1 (n1, n2) saved steps 10 and 20 in the shared directory and failed; attempt 2 resumed
    from step 20 on n2 and n3 (the checkpoint copied to n3, as ensure_on copies it, with no row of its own) and
    saved 30 and 40 on n3. eval_loss was logged every 10 steps, at 5 before the first checkpoint."""
    n1, n2, n3 = three["n1"], three["n2"], three["n3"]
    job = Job.objects.create(name="ret", script="train.py", keep=keep, state=Job.State.SUCCEEDED)
    rows = {10: saved(job, n1, 10), 20: saved(job, n1, 20)}
    Rank.objects.create(job=job, node=n1, index=0, state=Rank.State.EXITED)
    Rank.objects.create(job=job, node=n2, index=1, state=Rank.State.EXITED)
    from jobs.models import Attempt

    second = Attempt.objects.create(job=job, number=2, resume_checkpoint=rows[20], from_step=20)
    Job.objects.filter(pk=job.pk).update(current=second)
    job.refresh_from_db()
    Rank.objects.create(job=job, attempt=second, node=n2, index=0, state=Rank.State.EXITED)
    Rank.objects.create(job=job, attempt=second, node=n3, index=1, state=Rank.State.EXITED)
    copy = Path(checkpoints.target_path(rows[20], n3))
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_bytes(Path(rows[20].path).read_bytes())
    rows |= {30: saved(job, n3, 30, attempt=2), 40: saved(job, n3, 40, attempt=2)}
    for step, value in ((5, 0.6), (10, 0.5), (20, 0.9), (30, 0.7), (40, 0.8)):
        point(job, "eval_loss", step, value, attempt=1 if step <= 20 else 2)
    return job, rows, copy


def deletions(monkeypatch) -> list[tuple[str, str]]:
    """Every remove_checkpoints request retention sends, as (node, path)."""
    sent: list[tuple[str, str]] = []
    real = retention.node_request

    def spy(node, op, /, **fields):
        if op == "remove_checkpoints":
            sent.extend((node.name, p) for p in fields["paths"])
        return real(node, op, **fields)

    monkeypatch.setattr(retention, "node_request", spy)
    return sent


def test_the_latest_and_the_best_stay_and_every_copy_of_the_others_goes_once_per_shared_directory(three, monkeypatch):
    # given a job that keeps its newest checkpoint and its best by eval_loss, with four on three nodes
    job, rows, copy = two_attempts(three, "1,best:eval_loss:1")
    sent = deletions(monkeypatch)
    # when the reconciler's ended loop passes over it
    report = reconcile([job.pk], loops=["ended"])
    # then step 40 (latest) and step 10 (best: 0.5) are left; 20 is gone from the shared directory, deleted once
    # for its two nodes, and from n3, where the resume copied it; 30 is gone from n3
    assert report.freed == ["ret: freed 2"]
    assert Path(rows[40].path).exists() and Path(rows[10].path).exists()
    assert not Path(rows[20].path).exists() and not copy.exists() and not Path(rows[30].path).exists()
    assert sorted(sent) == sorted([("n1", rows[20].path), ("n3", str(copy)), ("n3", rows[30].path)])
    # and the record says why, copy by copy, and what was freed in all
    reasons = dict(Checkpoint.objects.filter(job=job).values_list("path", "keep_reason"))
    assert reasons[rows[40].path] == "latest" and reasons[rows[10].path] == "best eval_loss 0.5"
    freed = Checkpoint.objects.filter(job=job, removed_at__isnull=False)
    assert sorted((c.node.name, c.step, c.size) for c in freed) == [("n1", 20, 100), ("n3", 20, 100), ("n3", 30, 100)]
    assert {c.keep_reason for c in freed} == {"freed: not among the newest 1 nor the best 1 by eval_loss (lowest)"}
    assert [c.step for c in checkpoints.offered(job)] == [40, 10]
    assert retention.summary_text(job) == (
        "checkpoints: kept 2 (latest 1, best eval_loss 1), freed 2 (300 B); --keep 1,best:eval_loss:1"
    )
    # and the job page and the API's job record say the same, the freed copies struck through on the page
    client = Client()
    client.force_login(User.objects.create_user("vic"))
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="retention">checkpoints: kept 2 (latest 1, best eval_loss 1), freed 2 (300 B)' in page
    assert f"<del><code>{rows[30].path}</code></del>" in page and "best eval_loss 0.5</span>" in page
    record = client.get("/api/v1/jobs/ret/").json()["retention"]
    counts = [record[k] for k in ("kept", "latest", "best", "freed", "freed_bytes")]
    assert counts == [2, 1, 1, 2, 300] and record["keep"] == "1,best:eval_loss:1"
    # and a second pass has nothing left to do
    assert reconcile([job.pk], loops=["ended"]).freed == [] and len(sent) == 3


def test_a_node_that_does_not_answer_keeps_its_copy_until_it_answers_again(three, monkeypatch):
    # given the same job, with n1 and n3 not answering (n2, which shares n1's directory, does)
    job, rows, copy = two_attempts(three, "1,best:eval_loss:1")
    for name in ("n1", "n3"):
        Node.objects.filter(name=name).update(agent_python="/nonexistent/python3")
    sent = deletions(monkeypatch)
    # when the ended loop passes over it
    reconcile([job.pk], loops=["ended"])
    # then the shared directory's copy of step 20 went through n2, and what n3 holds is still there, said so
    assert not Path(rows[20].path).exists() and ("n2", rows[20].path) in sent
    assert copy.exists() and Path(rows[30].path).exists()
    left = Checkpoint.objects.get(job=job, node__name="n3", step=30)
    assert left.removed_at is None and left.keep_reason.startswith("freeing: not among the newest 1")
    assert left.keep_reason.endswith("n3 did not answer, tried again later")
    assert [c.step for c in checkpoints.offered(job)] == [40, 10]  # one being freed is not offered
    text = retention.summary_text(job)
    assert "freed 0 (100 B), 2 still to delete on a node that did not answer" in text, text
    # when n3 answers again and the loop passes once more
    Node.objects.filter(name="n3").update(agent_python=sys.executable)
    reconcile([job.pk], loops=["ended"])
    # then its copies are gone too, and every copy is recorded as freed
    assert not copy.exists() and not Path(rows[30].path).exists() and Path(rows[40].path).exists()
    assert Checkpoint.objects.filter(job=job, removed_at__isnull=True).count() == 2
    assert retention.summary_text(job).startswith("checkpoints: kept 2 (latest 1, best eval_loss 1), freed 2 (300 B)")


def test_a_queued_resume_a_retry_and_a_service_keep_what_they_use(three):
    from serving.models import Service

    n1 = three["n1"]
    job = Job.objects.create(name="used", script="train.py", keep="1", state=Job.State.FAILED, retry_on=["oom"])
    rows = {step: saved(job, n1, step) for step in (10, 20, 30, 40, 50)}
    # given a job that keeps one: a resume of another job queued from step 10, one of this job running from 20
    # that has written nothing of its own yet, a service serving 30, and a retry that would start from 50
    other = Job.objects.create(name="other", script="train.py", state=Job.State.QUEUED)
    update_jobs(Job.objects.filter(pk=other.pk), resume_checkpoint=rows[10], resume_step=10)
    Service.objects.create(name="chat", job=job, checkpoint=rows[30])
    running = Job.objects.create(name="again", script="train.py", state=Job.State.RUNNING)
    update_jobs(Job.objects.filter(pk=running.pk), resume_checkpoint=rows[20], resume_step=20)
    # when retention passes over it
    retention.retain(job)
    # then only step 40 goes
    gone = {c.step for c in Checkpoint.objects.filter(job=job, removed_at__isnull=False)}
    assert gone == {40} and not Path(rows[40].path).exists()
    reasons = dict(Checkpoint.objects.filter(job=job).values_list("step", "keep_reason"))
    assert reasons[10] == "protected: other attempt 1 resumes from it"
    assert reasons[20] == "protected: again attempt 1 resumes from it"
    assert reasons[30] == "protected: service chat serves it" and reasons[50] == "latest"
    # when the running resume has written a checkpoint of its own, and the service stopped, and the queued one ran
    saved(running, n1, 21)
    Service.objects.filter(name="chat").update(state=Service.State.STOPPED)
    Job.objects.filter(pk=other.pk).update(state=Job.State.SUCCEEDED)
    retention.retain(job)
    # then they go too; the latest, which a retry would start from, stays
    assert {c.step for c in Checkpoint.objects.filter(job=job, removed_at__isnull=True)} == {50}


def test_a_checkpoint_written_again_where_it_was_deleted_is_judged_again(three):
    # given a job that kept one of two: step 10 freed
    job = Job.objects.create(name="again", script="train.py", keep="1", state=Job.State.SUCCEEDED)
    first, _ = saved(job, three["n3"], 10), saved(job, three["n3"], 20)
    retention.retain(job)
    assert Checkpoint.objects.get(pk=first.pk).removed_at is not None
    # when a later attempt writes step 10 again and the follower records it
    rank = Rank.objects.create(job=job, node=three["n3"], index=0, state=Rank.State.EXITED)
    path = Path(first.path)
    path.write_bytes(b"new" * 10)
    checkpoints._record(rank, [{"path": str(path), "dir": False, "size": 30, "mtime": path.stat().st_mtime}], set())
    # then it is there again, and judged again (not among the newest one: freed again)
    back = Checkpoint.objects.get(pk=first.pk)
    assert back.removed_at is None and back.keep_reason == "" and back.size == 30
    retention.retain(job)
    assert Checkpoint.objects.get(pk=first.pk).removed_at is not None and not path.exists()


def test_a_checkpoint_another_scan_recorded_meanwhile_is_not_an_error(three, monkeypatch):
    # given a rank's checkpoint that a second scan records between this scan's read of the known ones and its insert
    job = Job.objects.create(name="twice", script="train.py", state=Job.State.RUNNING)
    first = saved(job, three["n1"], 10)
    rank = Rank.objects.create(job=job, node=three["n1"], index=0, state=Rank.State.RUNNING)
    monkeypatch.setattr(checkpoints, "seeing", lambda node: [])  # this scan read none as known
    entry = {"path": first.path, "dir": False, "size": first.size, "mtime": first.mtime}
    # when this scan records it too: no error, and still one row, the first scan's
    checkpoints._record(rank, [entry], set())
    assert list(Checkpoint.objects.filter(job=job).values_list("pk", flat=True)) == [first.pk]


def test_parts_recorded_after_their_checkpoint_was_judged_go_with_it_and_an_unfinished_one_stays(three):
    # given an ended job that keeps one: its step 10 freed, its step 20 kept
    job = Job.objects.create(name="late", script="train.py", keep="1", state=Job.State.SUCCEEDED)
    first = saved(job, three["n1"], 10)
    saved(job, three["n1"], 20)
    reconcile([job.pk], loops=["ended"])
    assert Checkpoint.objects.get(pk=first.pk).removed_at is not None
    # when what another rank wrote of both (a Trainer's rank 1 writes its part of checkpoint-N on its own node), and
    # a checkpoint it never finished, are recorded afterwards
    parts = [saved(job, three["n3"], step) for step in (10, 20, 30)]
    Checkpoint.objects.filter(pk__in=[p.pk for p in parts]).update(ready=False)
    reconcile([job.pk], loops=["ended"])
    # then the freed one's part goes too, the kept one's is kept with it, and the unfinished one stays, said so
    on_n3 = Checkpoint.objects.filter(job=job, node__name="n3")
    got = {c.step: (c.keep_reason, c.removed_at is not None) for c in on_n3}
    assert got[10][1] and not Path(parts[0].path).exists()
    assert got[20] == ("latest", False) and got[30] == ("kept: never complete", False) and Path(parts[2].path).exists()
    # and retention has nothing left to do for it
    assert not Job.objects.filter(pk=job.pk).filter(retention._work_left()).exists()


def test_a_job_that_keeps_everything_is_left_alone(three):
    job = Job.objects.create(name="all", script="train.py", state=Job.State.SUCCEEDED)
    rows = [saved(job, three["n1"], step) for step in (10, 20)]
    assert retention.retain(job) is None and reconcile([job.pk], loops=["ended"]).freed == []
    assert all(Path(c.path).exists() for c in rows) and retention.summary_text(job) == ""
