#!/usr/bin/env python
"""Recovery: detection time, time back to training and steps lost, UGRO's retry policy beside torchrun --max-restarts 3.

    .venv/bin/python bench/recovery.py [--scenarios killed,node_lost,oom,hang,node_wait] [--only ugro|torchrun]
        [--keep]

Three real sshd nodes on 127.0.6.2-4 (tests/loopback.py; never the test suite's 127.0.0.x), each with
the repo's train/ in its working dir, and a throwaway PostgreSQL UGRO with the nodes imported from
cluster.yaml. Every run trains train/train_production.py (tiny model, `--seq-len 16 --batch-size 4
--log-every 5 --save-every 25 --step-sleep 0.05 --max-steps 400 --num-epochs 10`) and a failure is injected once the
run has printed step 60 (so the last checkpoint is step 50):

  killed     SIGKILL to the training process of node rank 1          UGRO: --retry killed,script-error
  node_lost  the sshd of a node without the checkpoints is stopped   UGRO: 3 nodes, --retry node-lost --min-nodes 2
             (its processes go on, unreachable), started again after  torchrun: SIGKILL to one agent and its worker
  node_wait  the node that holds the checkpoints falls off: its sshd  UGRO: 2 nodes, --retry node-lost (no --min-nodes):
             stopped and its processes frozen (SIGSTOP); back         the retry waits QUEUED for the node
             AWAY_S after UGRO queued the retry (torchrun: after      torchrun: SIGSTOP one agent and its worker,
             AWAY_S + 20 s)                                           SIGCONT after the same time
  oom        --oom-at-step 60:2 (CUDA out of memory while batch > 2)  UGRO: --retry oom with a batch template
  hang       --sleep-at-step 60:3600 (silent after step 60)          UGRO: --retry hang --hang-after 10

UGRO runs in this process the way the worker runs it: the job is recorded as `launch` records it
(create_job; the command itself refuses with no worker running), the follower runs continuously (follow
passes of 0.5 s), a stopping job's teardown on a thread beside it (the worker's teardown_job), the
reconciler every 5 s (beat's period: hangs and the retry policy are decided there), and a queued
attempt is scheduled at once (the requeue queues `schedule_jobs` after commit). Settings are
UGRO's defaults (NODE_LOST_AFTER_S 20 s, RETRY_BACKOFF_S 10 s, CHECKPOINT_SCAN_S 30 s), except the
job's `--hang-after 10` (default floor 60 s).

torchrun: two agents started by this benchmark on two of the nodes' addresses (`--nnodes 2 --max-restarts
3 --rdzv-backend c10d --rdzv-conf join_timeout=30`), the same script and arguments, LOGLEVEL=INFO so
the agent says when it restarts its workers; the same failures injected at the same step. torchrun
restarts the script with the same arguments: from step 0.

Measured, per scenario and tool (wall clock; all nodes are this machine):
  detection_s     from the injection (the kill, the sshd stop; for oom and hang the arrival of the last
                  line before it: step 55 / step 60) to the failure recorded (UGRO: the job left RUNNING;
                  torchrun: its agent logged that it restarts the workers or gave up)
  back_s          from detection to the first metric line of the next attempt / restart (node_wait: from the
                  node's return, sshd started / SIGCONT, to the first metric line after it)
  queued_s        node_wait, UGRO: from detection to the retry QUEUED, waiting for the node
  steps_lost      the last step printed before the failure minus the step training went on from
  outcome         what happened next
Results: bench/results/recovery.json (the rows of the scenarios and tools run replace their old ones;
the others are kept) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    NODE_TORCHRUN,
    REPO,
    RESULTS,
    kill_tagged,
    machine_info,
    make_tmp,
    setup_django,
    tagged_pids,
    write_json,
)
from _db import throwaway_database  # noqa: E402
from first_step import cluster_yaml  # noqa: E402

SUBNET = "127.0.6"
TRAIN = ["--max-steps", "400", "--num-epochs", "10", "--seq-len", "16", "--batch-size", "4", "--log-every", "5",
         "--save-every", "25", "--step-sleep", "0.05"]  # fmt: skip
INJECT_AT = 60
SCENARIOS = ("killed", "node_lost", "oom", "hang", "node_wait")
AWAY_S = 30.0  # node_wait: how long the node stays away once UGRO queued the retry
RECONCILE_EVERY = 5.0
TIMEOUT = 240.0
STEP_RE = re.compile(rb'^\{"step": (\d+),')


def worker_pids(tag: str, node: str) -> list[int]:
    """The training processes (not torchrun's agent) carrying a tag on a node."""
    out = []
    for pid in tagged_pids(tag):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (not node or f"UGRO_NODE={node}".encode() in env) and b"train_production.py" in argv:
            if b"torchrun" not in argv:
                out.append(pid)
    return out


# -- UGRO -------------------------------------------------------------------------------------------


class UgroRun:
    """One job under UGRO's recovery, driven as the worker drives it."""

    def __init__(self, cluster, scenario: str) -> None:
        self.cluster, self.scenario = cluster, scenario
        self.name = f"rec-{scenario.replace('_', '')}-{uuid.uuid4().hex[:6]}"
        self.last_reconcile = 0.0
        self.teardown: threading.Thread | None = None
        self.row: dict = {"tool": "ugro", "scenario": scenario, "job": self.name}

    def launch(self) -> None:
        """The job as `launch` records it (create_job): the command refuses with no worker running, and here
        this process is the worker."""
        from jobs.launch import LaunchRequest, create_job

        policy = {
            "killed": {"count": 2, "retry": "killed,script-error"},
            "node_lost": {"count": 3, "retry": "node-lost", "min_nodes": 2},
            "oom": {"count": 2, "retry": "oom", "batch_template": "--batch-size {batch} --grad-accum {accum}",
                    "batch": 4},
            "hang": {"count": 2, "retry": "hang", "hang_after_s": 10.0},
            "node_wait": {"count": 2, "retry": "node-lost"},
        }[self.scenario]  # fmt: skip
        extra = {"oom": ["--oom-at-step", f"{INJECT_AT}:2"], "hang": ["--sleep-at-step", f"{INJECT_AT}:3600"]}
        create_job(LaunchRequest(name=self.name, extra_args=[*TRAIN, *extra.get(self.scenario, [])], **policy))

    def job(self):
        from jobs.models import Job

        return Job.objects.get(name=self.name)

    def pump(self, until, timeout: float = TIMEOUT):
        """Follow, tear a stopping job down, reconcile every RECONCILE_EVERY s, schedule a queued attempt,
        until until() is truthy."""
        from jobs.follow import follow
        from jobs.models import Job
        from jobs.reconcile import reconcile
        from jobs.scheduler import schedule

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = until()
            if value:
                return value
            job = self.job()
            if job.state == Job.State.QUEUED:
                schedule(only=[job.pk])
            if job.is_stopping and not (self.teardown and self.teardown.is_alive()):
                # the worker's teardown_job, queued as the job starts stopping, runs beside its follower
                self.teardown = threading.Thread(target=self._teardown, args=(job.pk,), daemon=True)
                self.teardown.start()
            follow(0.5, job_ids=[job.pk])
            if time.monotonic() - self.last_reconcile >= RECONCILE_EVERY:
                self.last_reconcile = time.monotonic()
                reconcile([job.pk], orphans=False)
        raise TimeoutError(f"{self.name}: timed out")

    @staticmethod
    def _teardown(job_id: int) -> None:
        from django.db import connections

        from jobs import lifecycle
        from jobs.models import Job

        try:
            lifecycle.teardown(Job.objects.get(pk=job_id))
        finally:
            connections.close_all()

    def last_point(self, attempt: int):
        from metrics.models import MetricPoint

        return (
            MetricPoint.objects.filter(job__name=self.name, attempt=attempt, name="loss")
            .order_by("-step", "-time")
            .values_list("step", "time")
            .first()
        )

    def run(self) -> dict:
        from jobs import checkpoints
        from metrics.models import MetricPoint

        self.launch()
        inject_step = INJECT_AT - (5 if self.scenario == "oom" else 0)
        self.pump(lambda: (self.last_point(1) or (0,))[0] >= inject_step)
        job = self.job()
        stopped = None
        if self.scenario == "killed":
            victim = job.ranks.select_related("node").get(index=1).node.name
            t_inject = time.time()
            for pid in worker_pids(job.tag, victim):
                os.kill(pid, signal.SIGKILL)
        elif self.scenario == "node_lost":
            self.pump(lambda: checkpoints.offered(self.job()))
            keeper = checkpoints.offered(self.job())[0].node.name
            gone = next(n for n in self.cluster.nodes if n.name not in (keeper, "node1"))
            t_inject = time.time()
            gone.stop()
            stopped = gone
            self.row["lost_node"] = gone.name
        elif self.scenario == "node_wait":
            self.pump(lambda: checkpoints.offered(self.job()))
            keeper = checkpoints.offered(self.job())[0].node.name
            gone = next(n for n in self.cluster.nodes if n.name == keeper)
            from tests.loopback import on_node

            frozen = on_node(tagged_pids(job.tag), keeper)
            t_inject = time.time()
            gone.stop()
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            stopped = gone
            self.row["lost_node"] = gone.name
        else:  # oom, hang: the last line printed before the failure
            t_inject = self.last_point(1)[1].timestamp()
        try:
            self.pump(lambda: self.job().state != "running")
            t_detect = time.time()
            failed_at = self.last_point(1)[0]
            t_from = t_detect
            if self.scenario == "node_wait":
                self.pump(lambda: self.job().attempt >= 2)
                t_queued = time.time()
                job = self.job()
                self.row.update(queued_s=round(t_queued - t_detect, 2), wait_nodes=job.wait_nodes,
                                state_while_away=job.state)  # fmt: skip
                away_until = time.monotonic() + AWAY_S
                self.pump(lambda: time.monotonic() >= away_until or self.job().state != "queued")
                self.row["state_after_away"] = self.job().state
                stopped.start()
                stopped, t_from = None, time.time()  # back_s counts from the node's return
            self.pump(lambda: self.job().attempt >= 2 and self.last_point(2))
            job = self.job()
            first2 = MetricPoint.objects.filter(job=job, attempt=2).order_by("time").values_list("time", flat=True)[0]
            attempt1 = job.attempts.get(number=1)
            self.row.update(
                detection_s=round(t_detect - t_inject, 2),
                back_s=round(first2.timestamp() - t_from, 2),
                failed_at_step=failed_at,
                resumed_from_step=job.resume_step,
                steps_lost=failed_at - (job.resume_step or 0),
                failure_kind=attempt1.failure_kind,
                outcome=f"attempt 2 trains from step {job.resume_step}: {attempt1.next_reason}",
                nodes_attempt2=sorted(job.ranks.values_list("node__name", flat=True)),
            )
        finally:
            from jobs import lifecycle

            job = self.job()
            if self.teardown is not None:
                self.teardown.join(timeout=60)
            if not job.is_ended:
                lifecycle.teardown(lifecycle.cancel(job))
            if stopped is not None:
                stopped.start()
        return self.row


# -- torchrun --max-restarts 3 ---------------------------------------------------------------------------


class TorchrunRun:
    """Two torchrun agents with --max-restarts 3 on two nodes' addresses, the same failure injected."""

    def __init__(self, cluster, scenario: str, tmp: Path, port: int) -> None:
        self.cluster, self.scenario, self.tmp, self.port = cluster, scenario, tmp, port
        self.tag = f"bench-rec-tr-{uuid.uuid4().hex[:8]}"
        self.logs = [tmp / f"{self.tag}-agent{i}.log" for i in range(2)]
        self.procs: list[subprocess.Popen] = []
        self.seen: list[tuple[float, int, int]] = []  # (time, agent, step) of each metric line
        self.events: list[tuple[float, int, str]] = []  # (time, agent, line) of restart / give-up lines
        self.offsets = [0, 0]
        self.partial = [b"", b""]
        self.row: dict = {"tool": "torchrun --max-restarts 3", "scenario": scenario}

    def start(self) -> None:
        extra = {"oom": ["--oom-at-step", f"{INJECT_AT}:2"], "hang": ["--sleep-at-step", f"{INJECT_AT}:3600"]}
        for i, node in enumerate(self.cluster.nodes[:2]):
            argv = [str(NODE_TORCHRUN), "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={self.cluster.nodes[0].address}:{self.port}", f"--rdzv-id={self.tag}",
                    "--rdzv-conf=join_timeout=30", f"--local-addr={node.address}", "--max-restarts=3",
                    "train/train_production.py", *TRAIN, "--output-dir", f"outputs/{self.tag}",
                    *extra.get(self.scenario, [])]  # fmt: skip
            env = {**os.environ, "UGRO_JOB": self.tag, "UGRO_NODE": node.name, "LOGLEVEL": "INFO",
                   "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip
            for key in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE"):
                env.pop(key, None)
            self.procs.append(subprocess.Popen(argv, cwd=node.workdir, env=env, stdin=subprocess.DEVNULL,
                                               stdout=open(self.logs[i], "wb"), stderr=subprocess.STDOUT,
                                               start_new_session=True))  # fmt: skip

    def poll(self) -> None:
        now = time.time()
        for i, path in enumerate(self.logs):
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets[i])
                    data = fh.read()
            except OSError:
                continue
            self.offsets[i] += len(data)
            lines = (self.partial[i] + data).split(b"\n")
            self.partial[i] = lines.pop()
            for line in lines:
                m = STEP_RE.match(line)
                if m:
                    self.seen.append((now, i, int(m.group(1))))
                elif (
                    b"will restart worker group" in line
                    or b"exceeded max_restarts" in line.lower()
                    or (b"Rendezvous" in line and b"timed out" in line.lower())
                ):
                    self.events.append((now, i, line.decode("utf-8", "replace")[-300:]))

    def wait(self, until, timeout: float) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            value = until()
            if value:
                return value
            time.sleep(0.05)
        self.poll()
        return until()

    def last_step(self) -> int:
        return max((s for _, _, s in self.seen), default=0)

    def run(self) -> dict:
        self.start()
        try:
            inject_step = INJECT_AT - (5 if self.scenario == "oom" else 0)
            if not self.wait(lambda: self.last_step() >= inject_step, TIMEOUT):
                self.row["outcome"] = "never reached the injection step"
                return self.row
            n_seen = len(self.seen)
            if self.scenario == "node_wait":
                return self.freeze_and_thaw(n_seen)
            if self.scenario == "killed":
                t_inject = time.time()
                for pid in worker_pids(self.tag, self.cluster.nodes[1].name):
                    os.kill(pid, signal.SIGKILL)
            elif self.scenario == "node_lost":
                t_inject = time.time()
                for pid in tagged_pids(self.tag):
                    env = Path(f"/proc/{pid}/environ").read_bytes() if Path(f"/proc/{pid}").exists() else b""
                    if f"UGRO_NODE={self.cluster.nodes[1].name}".encode() in env:
                        os.kill(pid, signal.SIGKILL)
            else:
                t_inject = max(t for t, _, s in self.seen if s == inject_step)
            failed_at = self.last_step()
            limit = 90.0 if self.scenario == "hang" else TIMEOUT
            detected = self.wait(lambda: self.events, limit)
            if not detected:
                self.row.update(outcome=f"not detected within {limit:g}s (still running, silent)", detection_s=None)
                return self.row
            t_detect = self.events[0][0]
            self.row.update(detection_s=round(t_detect - t_inject, 2), failed_at_step=failed_at,
                            first_event=self.events[0][2])  # fmt: skip
            back = self.wait(lambda: [t for t, _, s in self.seen[n_seen:] if t > t_detect and s <= failed_at], 120)
            if back:
                self.row.update(back_s=round(back[0] - t_detect, 2), resumed_from_step=0, steps_lost=failed_at)
            if self.scenario == "killed" and back:
                self.row["outcome"] = "restarted from step 0 (the same arguments: no resume)"
                return self.row
            ended = self.wait(lambda: self.procs[0].poll() is not None, TIMEOUT)
            restarts = sum("will restart" in e for _, _, e in self.events)
            codes = [p.poll() for p in self.procs]
            self.row["outcome"] = (
                f"{'ended' if ended else 'still running'}: exit codes {codes}, {restarts} restart(s) logged, "
                f"last step {self.last_step()}"
            )
        finally:
            for p in self.procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            kill_tagged(self.tag)
        return self.row

    def freeze_and_thaw(self, n_seen: int) -> dict:
        """node_wait: node rank 1's agent and worker stop (SIGSTOP) as if the node fell off, and go on
        (SIGCONT) AWAY_S + 20 s later (about when UGRO's node comes back). The caller cleans up."""
        from tests.loopback import on_node

        frozen = on_node(tagged_pids(self.tag), self.cluster.nodes[1].name)
        failed_at = self.last_step()
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        away = AWAY_S + 20.0
        self.wait(lambda: False, away)
        n_away = len(self.seen)
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        t_cont = time.time()
        back = self.wait(lambda: [(t, s) for t, _, s in self.seen[n_away:] if t > t_cont], 120)
        self.row.update(detection_s=None, failed_at_step=failed_at, events_while_away=[e for _, _, e in self.events],
                        steps_while_away=sorted({s for _, _, s in self.seen[n_seen:n_away]}))  # fmt: skip
        if not back:
            self.row["outcome"] = f"no step printed within 120 s of SIGCONT ({away:g}s frozen)"
            return self.row
        first = back[0][1]
        self.row.update(back_s=round(back[0][0] - t_cont, 2), resumed_from_step=max(0, first - 5),
                        steps_lost=max(0, failed_at - (first - 5)))  # fmt: skip
        how = "went on where it stopped" if first > failed_at else f"printed step {first} (restarted)"
        self.row["outcome"] = (f"nothing noticed while frozen {away:g}s ({len(self.events)} restart events); "
                               f"after SIGCONT it {how}")  # fmt: skip
        return self.row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--only", choices=("ugro", "torchrun"), default=None)
    ap.add_argument("--out", default=str(RESULTS / "recovery.json"))
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    if any(s not in SCENARIOS for s in scenarios):
        ap.error(f"scenarios: {', '.join(SCENARIOS)}")
    with throwaway_database(keep=args.keep) as database_url:
        return run(args, scenarios, database_url)


def run(args: argparse.Namespace, scenarios: list[str], database_url: str) -> int:
    tmp = make_tmp("ugro-bench-recovery-")
    os.environ["UGRO_LOG_LEVEL"] = "error"
    setup_django(tmp, database_url)
    from django.conf import settings

    from cluster.config_yaml import import_cluster
    from cluster.links import pool
    from jobs import follow, recovery
    from tests.loopback import LoopbackCluster

    meta = machine_info()
    meta.update(train_args=TRAIN, inject_at_step=INJECT_AT, reconcile_every_s=RECONCILE_EVERY,
                ugro={**{k: settings.UGRO[k] for k in ("NODE_LOST_AFTER_S", "KILL_GRACE_S")},
                      "RETRY_BACKOFF_S": recovery.RETRY_BACKOFF_S, "CHECKPOINT_SCAN_S": follow.CHECKPOINT_SCAN_S,
                      "HANG_FACTOR": recovery.HANG_FACTOR})  # fmt: skip
    rows: list[dict] = []
    cluster = LoopbackCluster(tmp / "nodes", 3, subnet=SUBNET, first_octet=2)
    t0 = time.monotonic()
    try:
        cluster.start()
        for node in cluster.nodes:
            shutil.copytree(REPO / "train", node.workdir / "train", ignore=shutil.ignore_patterns("__pycache__"))
        import_cluster(cluster_yaml(cluster, 29631))
        for i, scenario in enumerate(scenarios):
            tools = [("ugro", lambda s=scenario: UgroRun(cluster, s).run()),
                     ("torchrun", lambda s=scenario, i=i: TorchrunRun(cluster, s, tmp, 29641 + i).run())]  # fmt: skip
            for tool, fn in tools:
                if args.only and tool != args.only:
                    continue
                try:
                    row = fn()
                except Exception as exc:  # a failed trial is a result, not the end of the benchmark
                    row = {"tool": tool, "scenario": scenario, "error": f"{type(exc).__name__}: {exc}"}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        pool.close_all()
        cluster.stop()
        kill_tagged("rec-", prefix=True)
        kill_tagged("bench-rec-tr-", prefix=True)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    out = Path(args.out)
    kept, runs = [], []
    if out.exists():
        old = json.loads(out.read_text())
        ran = {(r["scenario"], r["tool"]) for r in rows}
        kept = [r for r in old.get("trials", []) if (r["scenario"], r["tool"]) not in ran]
        runs = old.get("runs", [])
    write_json(out, {"runs": [*runs, meta], "trials": kept + rows})
    print(f"\n{'scenario':<10} {'tool':<26} {'detect s':>9} {'back s':>8} {'lost':>6}  outcome")
    for r in rows:

        def f(v):
            return "-" if v is None else f"{v}"

        print(f"{r['scenario']:<10} {r['tool']:<26} {f(r.get('detection_s')):>9} {f(r.get('back_s')):>8} "
              f"{f(r.get('steps_lost')):>6}  {r.get('outcome') or r.get('error', '')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
