"""--scale-probe (jobs/scale_probe.py): the count chosen from recorded step lines, the weights from the measured
time per sample, and the probe run on in-memory node agents whose ranks log at a pace each node count sets (a
clock of their own). The real thing on sshd nodes and torchrun: tests/test_scale_probe_e2e.py."""

from __future__ import annotations

import base64
import json
import re

import pytest

from cluster.models import Node
from jobs import launch, lifecycle, scale_probe
from jobs.models import Allocation, Job, Rank
from jobs.scale_probe import CountRun, StepLine, choose, measure, parse_probe, weights_from, with_efficiency


def lines(node_rank: int, step_s: float, compute_s: float, n: int = 6, every: int = 2, wait_s: float = 0.0):
    """A rank's step lines as train/train_production.py logs them, seen every `every` steps of `step_s`."""
    return [
        StepLine(s, {"loss": 2.0, "compute_s": compute_s, "sync_wait_s": wait_s}, node_rank, 10.0 + s * step_s)
        for s in range(every, every * (n + 1), every)
    ]


def test_a_count_is_measured_from_its_step_lines_after_the_warm_up():
    # given two nodes' ranks stepping every 0.05 s with 8 samples each, the first node computing 0.02 s a step
    run = CountRun(nodes=["a", "b"], workers=2, local_batches=[8, 8], workers_per_node=[1, 1],
                   lines={"a": lines(0, 0.05, 0.02, wait_s=0.03), "b": lines(1, 0.05, 0.04)})  # fmt: skip
    row = measure(run)
    # then 20 steps/s x 16 samples, its compute and sync split, each node's time per sample
    assert row["steps_per_s"] == pytest.approx(20.0) and row["samples_per_s"] == pytest.approx(320.0)
    assert (row["compute_s"], row["sync_wait_s"], row["unit"]) == (0.02, 0.03, "samples")
    assert row["per_sample_s"] == {"a": pytest.approx(0.0025), "b": pytest.approx(0.005)}
    # a job with no batch known is measured in per-rank batches
    run.local_batches = [None, None]
    assert measure(run)["unit"] == "per-rank batches" and measure(run)["samples_per_s"] == pytest.approx(40.0)
    # a script that logs on rank 0 only, which joined on the second node: timed from that node's lines
    run.lines = {"a": [], "b": lines(0, 0.05, 0.04)}
    assert measure(run)["steps_per_s"] == pytest.approx(20.0)
    # one step line (the warm-up) or none is no rate, and says so
    run.lines = {"a": lines(0, 0.05, 0.02, n=1)}
    assert measure(run)["error"] == "too few step lines (1) to measure a rate"
    run.lines = {}
    assert measure(run)["error"] == "no step lines"


def rows(*samples_per_s: float) -> list[dict]:
    return with_efficiency([{"nodes": i + 1, "workers": i + 1, "samples_per_s": v, "unit": "samples"}
                            for i, v in enumerate(samples_per_s)])  # fmt: skip


def test_the_fastest_count_runs_and_fewer_nodes_win_a_tie():
    assert choose(rows(100, 190, 270), asked=3, forced=False).nodes == 3
    assert rows(100, 190, 270)[2]["efficiency"] == 0.9
    # a slow link: one node is fastest; the others are freed, and the line says why
    picked = choose(rows(100, 60, 45), asked=3, forced=False)
    assert picked.nodes == 1 and picked.line == (
        "runs on 1 of 3 nodes: 100.0 samples/s against 45.0 samples/s on all 3; the others are freed"
    )
    # where the script reports its compute/sync split, the line says how much of a step the exchange took
    split = rows(100, 60, 45)
    split[2].update(compute_s=0.08, sync_wait_s=0.32)
    assert choose(split, asked=3, forced=False).line == (
        "runs on 1 of 3 nodes: 100.0 samples/s against 45.0 samples/s on all 3, where 80 % of a step (0.320 s of "
        "0.400 s) was waiting for the gradient exchange; the others are freed"
    )
    # within 2 %: the fewest nodes (the GPUs are worth more elsewhere)
    assert choose(rows(100, 199, 200), asked=3, forced=False).nodes == 2
    # --min-nodes is a floor
    assert choose(rows(100, 60, 45), asked=3, forced=False, floor=2).nodes == 2


def test_named_nodes_run_as_asked_with_a_warning_when_fewer_would_be_faster():
    picked = choose(rows(100, 60, 45), asked=3, forced=True)
    assert picked.nodes == 3 and picked.warning
    assert picked.line == ("fewer nodes would be faster: 1 measured 100.0 samples/s, all 3 named nodes 45.0 "
                           "samples/s; runs on the 3 nodes named, as asked")  # fmt: skip
    assert not choose(rows(100, 190), asked=2, forced=True).warning


def test_auto_weights_give_the_slower_node_the_smaller_share():
    probe = [{"nodes": 2, "per_sample_s": {"a": 0.0025, "b": 0.005}}, {"nodes": 1, "per_sample_s": {"a": 0.003}}]
    assert weights_from(probe, ["a", "b"]) == {"a": 2.0, "b": 1.0}
    # a node the probe could not time gets the mean of the others; nothing timed: none
    assert weights_from(probe, ["a", "b", "c"])["c"] == 1.5
    assert weights_from([{"nodes": 1}], ["a"]) == {}


@pytest.mark.parametrize(
    "text, message",
    [("fast", "is not a duration like 60s or 2m, or off"), ("1s", "must be from 2s to 10m per node count"),
     ("1h", "must be from 2s to 10m per node count")],
)  # fmt: skip
def test_a_bad_probe_time_is_one_line(text, message):
    assert parse_probe("60s") == 60 and parse_probe("off") is None and parse_probe("") is None
    with pytest.raises(ValueError, match=message):
        parse_probe(text)


class PacedNodes:
    """In-memory node agents for a probe: the ranks of a K-node run log a step line every `every` steps of
    step_s[K] seconds of a clock of their own (advanced by the first node's reads), each node its compute_s."""

    def __init__(self, names: list[str], step_s: dict[int, float], compute_s: dict[str, float]) -> None:
        self.names, self.step_s, self.compute_s, self.every = names, step_s, compute_s, 2
        self.now = 0.0
        self.runs: dict[str, dict] = {}
        self.started: list[tuple[str, list[str], dict]] = []
        self.killed: list[str] = []

    def install(self, monkeypatch) -> PacedNodes:
        monkeypatch.setattr(Node, "link", lambda node: _PacedLink(self, node.name))
        monkeypatch.setattr(scale_probe, "clock", lambda: self.now)
        return self


class _PacedLink:
    def __init__(self, nodes: PacedNodes, name: str) -> None:
        self.nodes, self.name = nodes, name

    def request(self, op: str, timeout: float = 30.0, when_silent: bool = True, **f) -> dict:
        nodes = self.nodes
        if op == "start":
            count = int(next(a for a in f["argv"] if a.startswith("--nnodes=")).split("=")[1])
            nodes.started.append((self.name, f["argv"], f["env"]))
            nodes.runs[self.name] = {"count": count, "step": 0, "rank": int(f["env"]["UGRO_NODE_RANK"])}
            return {"pid": 1000}
        if op == "tail":
            run = nodes.runs[self.name]
            if self.name == nodes.names[0]:
                nodes.now += nodes.step_s[run["count"]] * nodes.every
            run["step"] += nodes.every
            line = json.dumps({"step": run["step"], "loss": 2.0, "rank": run["rank"],
                               "compute_s": nodes.compute_s[self.name], "sync_wait_s": 0.001})  # fmt: skip
            data = base64.b64encode((line + "\n").encode()).decode()
            return {"files": [{"key": f["files"][0]["key"], "size": 1, "data": data, "zlib": False, "eof": True,
                               "exit": None}]}  # fmt: skip
        if op == "kill":
            nodes.killed.append(self.name)
            return {"pids": [1000] if f["signal"] == 15 else []}
        if op == "procs":
            return {"pids": []}
        raise AssertionError(op)


@pytest.fixture
def three(db, monkeypatch):
    monkeypatch.setattr(lifecycle, "send_task", lambda *a: True)
    return [Node.objects.create(name=f"n{i}", address=f"10.9.0.{i}", role="master" if i == 1 else "worker", order=i,
                                workdir="/w") for i in (1, 2, 3)]  # fmt: skip


def starting(nodes: list[Node], **params) -> tuple[Job, list[Rank]]:
    """A job claimed on these nodes (STARTING), as the scheduler leaves it for launch()."""
    job = Job.objects.create(name="probed", script="train.py", script_args=["--batch-size", "{local_batch}",
                             "--output-dir", "{job_dir}"], params={"scale_probe_s": 2, **params})  # fmt: skip
    assert lifecycle.claim_nodes(job, nodes)
    job.current.rdzv_endpoint = "10.9.0.1:29500"
    job.current.save(update_fields=["rdzv_endpoint"])
    return job, list(job.ranks.select_related("node", "job").order_by("index"))


def test_the_probe_runs_each_count_then_the_job_runs_on_the_fastest_and_frees_the_rest(three, monkeypatch):
    # given 3 nodes whose link makes 2 nodes the fastest (3 nodes step far slower)
    paced = PacedNodes(["n1", "n2", "n3"], {1: 0.10, 2: 0.06, 3: 0.20}, {"n1": 0.02, "n2": 0.04, "n3": 0.02})
    paced.install(monkeypatch)
    job, ranks = starting(three, batch_per_gpu=8, batch_weights="auto")
    # when the launch probes
    kept, weights = launch._probe_scaling(job, ranks, {n.pk: "/w" for n in three})
    # then 1, 2 and 3 nodes ran, each with its own rendezvous id and a scratch directory for its outputs
    counts = [int(re.search(r"--nnodes=(\d+)", " ".join(argv)).group(1)) for _, argv, _ in paced.started]
    assert counts == [1, 2, 2, 3, 3, 3]
    name, argv, env = paced.started[-1]
    assert f"--rdzv-id={job.tag}-probe3" in argv and argv[argv.index("--output-dir") + 1] == env["UGRO_JOB_DIR"]
    assert env["UGRO_JOB_DIR"] == f"/w/.ugro/jobs/{job.tag}/probe_3/job" and env["UGRO_JOB"] == job.tag
    # and the job runs on the first 2 nodes; n3's rank is gone and its node free
    assert [r.node.name for r in kept] == ["n1", "n2"]
    assert list(job.ranks.values_list("node__name", flat=True).order_by("index")) == ["n1", "n2"]
    assert not Allocation.objects.filter(node__name="n3", active=True).exists()
    job.refresh_from_db()
    probe = job.current.scale_probe
    assert probe["chosen"] == 2 and [r["nodes"] for r in probe["rows"]] == [1, 2, 3]
    assert [r["samples_per_s"] for r in probe["rows"]] == [pytest.approx(v) for v in (80, 266.667, 120)]
    assert job.held_gpus == 2 and probe["line"].startswith("runs on 2 of 3 nodes")
    # and n2, twice as slow a sample, gets the smaller share of the 16 samples
    assert weights == {"n1": 2.0, "n2": 1.0} == probe["weights"]
    launch.assign_batches(job, kept, weights)
    assert [r.local_batch for r in kept] == [11, 5]
    # and status shows the table
    from jobs.report import job_detail

    shown = "\n".join(job_detail(job))
    assert "scale probe: runs on 2 of 3 nodes" in shown and "batch weights from the probe's time per sample" in shown


def test_named_nodes_run_whole_and_a_cancel_mid_probe_stops_it(three, monkeypatch):
    paced = PacedNodes(["n1", "n2", "n3"], {1: 0.05, 2: 0.10, 3: 0.20}, {"n1": 0.01, "n2": 0.01, "n3": 0.01})
    paced.install(monkeypatch)
    job, ranks = starting(three)
    job.current.requested_nodes = ["n1", "n2", "n3"]
    job.current.save(update_fields=["requested_nodes"])
    kept, weights = launch._probe_scaling(job, ranks, {n.pk: "/w" for n in three})
    assert len(kept) == 3 and weights == {}
    assert job.current.scale_probe["warning"] and "fewer nodes would be faster" in job.current.scale_probe["line"]
    assert job.current.scale_probe["rows"][0]["unit"] == "per-rank batches"  # no --batch-per-gpu
    # a cancel while the probe runs: the probe stops its ranks and the launch goes no further
    job2 = Job.objects.create(name="cancelled", script="train.py", params={"scale_probe_s": 5})
    Job.objects.filter(pk=job.pk).update(state=Job.State.FAILED)  # (it held n1..n3)
    Allocation.objects.filter(job=job).update(active=False)
    assert lifecycle.claim_nodes(job2, three)
    job2.current.rdzv_endpoint = "10.9.0.1:29500"
    job2.current.save(update_fields=["rdzv_endpoint"])
    Job.objects.filter(pk=job2.pk).update(state=Job.State.CANCELLING)
    paced.killed.clear()
    ranks2 = list(job2.ranks.select_related("node", "job").order_by("index"))
    assert launch._probe_scaling(job2, ranks2, {n.pk: "/w" for n in three}) is None
    assert paced.killed == ["n1"]


def test_a_probe_that_cannot_run_says_so_in_one_line_and_the_job_runs_as_asked(three, monkeypatch):
    paced = PacedNodes(["n1", "n2"], {}, {})
    paced.install(monkeypatch)
    # one node: nothing to compare
    job, ranks = starting(three[:1])
    assert launch._probe_scaling(job, ranks, {three[0].pk: "/w"}) == (ranks, {})
    assert job.current.scale_probe["line"] == "scale probe did not run: the job has one node; runs as asked"
    assert paced.started == []
    # a script that logs no step: the first count says why, the job keeps its nodes
    Job.objects.filter(pk=job.pk).update(state=Job.State.FAILED)
    Allocation.objects.filter(job=job).update(active=False)
    monkeypatch.setattr(scale_probe, "FIRST_STEP_WAIT_S", 5.0)
    silent = _PacedLink.request

    def no_steps(self, op, timeout=30.0, when_silent=True, **f):
        if op != "tail":
            return silent(self, op, timeout, when_silent, **f)
        self.nodes.now += 1.0
        data = base64.b64encode(b"loading the data\n").decode()
        return {"files": [{"key": 1, "size": 1, "data": data, "zlib": False, "eof": True, "exit": None}]}

    monkeypatch.setattr(_PacedLink, "request", no_steps)
    job2 = Job.objects.create(name="quiet", script="train.py", params={"scale_probe_s": 5})
    assert lifecycle.claim_nodes(job2, three[:2])
    ranks2 = list(job2.ranks.select_related("node", "job").order_by("index"))
    kept, _ = launch._probe_scaling(job2, ranks2, {n.pk: "/w" for n in three})
    assert len(kept) == 2
    assert job2.current.scale_probe["line"] == (
        "scale probe did not run: no step line within 5s; runs on the 2 nodes asked"
    )
    assert [n for n, _, _ in paced.started] == ["n1"]  # a count that cannot run: larger ones are not tried


def test_the_job_page_and_the_api_show_the_table_and_escape_what_a_node_said(db, settings, tmp_path):
    from django.contrib.auth.models import User
    from django.test import Client

    settings.JOBS_DIR = tmp_path / "jobs"
    job = Job.objects.create(name="shown", script="train.py")
    hostile = "<script>alert(1)</script>"
    probe = {"phase": "done", "asked": 2, "chosen": 1, "line": "runs on 1 of 2 nodes: 100.0 samples/s",
             "rows": with_efficiency([{"nodes": 1, "workers": 1, "samples_per_s": 100.0, "unit": "samples",
                                       "compute_s": 0.08, "sync_wait_s": 0.0},
                                      {"nodes": 2, "workers": 2, "error": f"did not start: {hostile}"}]),
             "weights": {"n1": 2.0, "n2": 1.0}}  # fmt: skip
    scale_probe.record(job, probe)
    client = Client()
    client.force_login(User.objects.create_superuser("probe-admin", password="pw-probe-123"))
    html = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="scale-probe-table"' in html and "runs on 1 of 2 nodes" in html and "n1=2.0" in html
    assert hostile not in html and "&lt;script&gt;" in html
    detail = client.get("/api/v1/jobs/shown/").json()
    assert detail["scale_probe"]["chosen"] == 1 and detail["scale_probe"]["rows"][0]["efficiency"] == 1.0


def test_the_clusters_default_probe_is_checked_on_import_taken_at_launch_and_off_turns_it_off(db):
    from cluster.config_yaml import ConfigError, import_cluster
    from jobs.launch import LaunchError, LaunchRequest, build_job

    yaml_text = ("cluster:\n  master_ip: 127.0.0.2\nnodes:\n  gpu1:\n    ip: 127.0.0.2\n    user: me\n"
                 "    workdir: /w\ntraining:\n  script: train.py\n  scale_probe: {probe}\n")  # fmt: skip
    with pytest.raises(ConfigError, match=r"^training\.scale_probe: --scale-probe 'soon' is not a duration"):
        import_cluster(yaml_text.format(probe="soon"))
    assert not Node.objects.exists()
    import_cluster(yaml_text.format(probe="20s"))
    assert build_job(LaunchRequest(name="a"))[0].params["scale_probe_s"] == 20
    assert build_job(LaunchRequest(name="b", scale_probe="45s"))[0].params["scale_probe_s"] == 45
    assert "scale_probe_s" not in build_job(LaunchRequest(name="c", scale_probe="off"))[0].params
    with pytest.raises(LaunchError, match=r"^--scale-probe must be from 2s to 10m per node count$"):
        build_job(LaunchRequest(name="d", scale_probe="1s"))
