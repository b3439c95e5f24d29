from __future__ import annotations

import sys
import time

from django.conf import settings
from django.core.management.base import CommandError

from accounts import actions, policy
from accounts.commands import UserCommand
from jobs import reconcile
from jobs.batches import parse_weights
from jobs.launch import LaunchError, LaunchRequest
from jobs.limits import parse_duration, parse_size_mb
from jobs.logs import rank_lines
from jobs.models import Job
from jobs.scheduler import request_schedule, schedule
from jobs.watch import JobWatch
from ugro_site.celery import worker_alive


class Command(UserCommand):
    action = "launch"
    help = "Launch a training job on the cluster's nodes (all at once) and follow it."

    def add_arguments(self, parser):
        parser.add_argument("--name", required=True, help="job name (letters, digits, . _ -)")
        group = parser.add_mutually_exclusive_group()
        group.add_argument("--nodes", type=int, help="how many nodes (default: all enabled)")
        group.add_argument("--node", action="append", default=[], help="a node to use (repeatable)")
        parser.add_argument("--script", default="", help="training script on the nodes")
        parser.add_argument("--model", default="")
        parser.add_argument("--dataset", default="")
        parser.add_argument("--epochs", type=int)
        parser.add_argument("--lr", type=float)
        parser.add_argument("--gpus", type=int, help="GPUs in all, on any nodes (instead of --nodes/--node)")
        parser.add_argument(
            "--gpus-per-node", type=int, dest="gpus_per_node",
            help="with --nodes K or --node: GPUs on each node (default: the whole node)",
        )  # fmt: skip
        parser.add_argument(
            "--time-limit", default="", dest="time_limit",
            help="stop the job (TIMEOUT, SIGTERM then SIGKILL) this long after it starts: 90m, 2h, 1d, H:MM:SS "
            "(default: the cluster's)",
        )  # fmt: skip
        parser.add_argument(
            "--min-vram", default="", dest="min_vram",
            help="memory each GPU needs, e.g. 10G (default: learned from earlier runs of the script, if any)",
        )  # fmt: skip
        parser.add_argument(
            "--batch-per-gpu", type=int, dest="batch_per_gpu",
            help="the even split's batch per GPU: fills {local_batch} (default: training.batch_size_per_gpu)",
        )  # fmt: skip
        parser.add_argument(
            "--batch-weights", default="", dest="batch_weights",
            help="uneven GPUs: NODE=WEIGHT,... relative speeds, or auto (learned from earlier runs of the "
            "script alone on each node); each rank gets its share of the global batch "
            "(UGRO_LOCAL_BATCH, UGRO_BATCH_WEIGHT, {local_batch})",
        )  # fmt: skip
        parser.add_argument("--after", default="", help="start only after this job succeeded (a dependency)")
        parser.add_argument("--nproc-per-node", type=int, dest="nproc_per_node")
        parser.add_argument("--priority", type=int, default=0, help="0-100, higher starts first")
        parser.add_argument("--detach", action="store_true", help="return once the ranks are started")
        parser.add_argument(
            "--dry-run",
            action="store_true",
            dest="dry_run",
            help="print each rank's exact command line and environment; create and start nothing",
        )
        parser.add_argument(
            "--metrics-pattern",
            default="",
            dest="metrics_pattern",
            help="regex: the script's lines it matches give their key=value / key: value pairs as metrics",
        )
        parser.add_argument(
            "--metrics-file", action="append", default=[], dest="metrics_files",
            help="a metrics.csv or TensorBoard event file, or a directory with them, on the nodes "
            "(relative to the workdir; {job} is the job name; repeatable)",
        )  # fmt: skip
        rec = parser.add_argument_group("recovery (docs/recovery.md)")
        rec.add_argument(
            "--retry", default="",
            help="failure kinds resumed automatically: node-lost,rendezvous,oom,script-error,hang,nccl,killed,"
            "timeout,unknown",
        )  # fmt: skip
        rec.add_argument("--max-attempts", type=int, dest="max_attempts", help="most attempts in all")
        rec.add_argument("--min-nodes", type=int, dest="min_nodes", help="a node-lost retry may run on this few")
        rec.add_argument(
            "--resume-template", default="", dest="resume_template",
            help="the script's resume argument (default: --resume-from {checkpoint}; "
            "HF: --resume_from_checkpoint {checkpoint})",
        )  # fmt: skip
        rec.add_argument(
            "--checkpoint-glob", default="", dest="checkpoint_glob",
            help="more checkpoints to record: a glob relative to the workdir ({job}: the name)",
        )  # fmt: skip
        rec.add_argument(
            "--batch-template", default="", dest="batch_template",
            help="e.g. '--batch-size {batch} --grad-accum {accum}': an OOM retry halves the batch",
        )  # fmt: skip
        rec.add_argument("--batch", type=int, help="per-rank batch for --batch-template")
        rec.add_argument("--grad-accum", type=int, dest="grad_accum", help="accumulation for --batch-template")
        rec.add_argument(
            "--hang-after", type=float, dest="hang_after_s",
            help="seconds without a metric line that make the job HUNG (default 60, or 5x its interval)",
        )  # fmt: skip
        code = parser.add_argument_group("code on every node (docs/sync.md)")
        code.add_argument(
            "--sync", default="", metavar="DIR",
            help="copy DIR to every node before the ranks start, and start them there (none: not even the "
            "cluster's default)",
        )  # fmt: skip
        code.add_argument("--allow-mismatch", action="store_true", dest="allow_mismatch",
                          help="start even if the script's sha256 differs between nodes")  # fmt: skip
        parser.add_argument("extra", nargs="*", help="after --: extra arguments for the script")

    def handle(self, **o):
        try:
            limit = parse_duration(o["time_limit"]) if o["time_limit"] else None
            vram = parse_size_mb(o["min_vram"]) if o["min_vram"] else None
            auto = o["batch_weights"].strip() == "auto"
            weights = parse_weights(o["batch_weights"]) if o["batch_weights"] and not auto else {}
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        req = LaunchRequest(
            name=o["name"], nodes=o["node"], count=o["nodes"], script=o["script"], model=o["model"],
            dataset=o["dataset"], epochs=o["epochs"], lr=o["lr"], nproc_per_node=o["nproc_per_node"],
            extra_args=o["extra"], priority=o["priority"], metrics_pattern=o["metrics_pattern"],
            metrics_files=o["metrics_files"], gpus=o["gpus"], gpus_per_node=o["gpus_per_node"],
            time_limit_s=limit, min_vram_mb=vram, batch_per_gpu=o["batch_per_gpu"], batch_weights=weights,
            batch_weights_auto=auto, after=o["after"], retry=o["retry"], max_attempts=o["max_attempts"],
            min_nodes=o["min_nodes"], resume_template=o["resume_template"], checkpoint_glob=o["checkpoint_glob"],
            batch_template=o["batch_template"], batch=o["batch"], grad_accum=o["grad_accum"],
            hang_after_s=o["hang_after_s"], sync=o["sync"], allow_mismatch=o["allow_mismatch"],
        )  # fmt: skip
        if o["dry_run"]:
            try:
                rows = actions.preview(self.user, req)
            except (LaunchError, policy.Refused) as exc:
                raise CommandError(str(exc)) from None
            for row in rows:
                self.stdout.write(row)
            return
        try:
            job = actions.launch(self.user, req, self.source)
        except (LaunchError, policy.Refused) as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"job {job.name} queued (id {job.pk})")
        job = start(job)
        if job.is_stopping:
            job = wait_final(job)  # a failed launch's teardown may run on a thread of this process
        if o["detach"]:
            return self._report_detached(job)
        watcher = Watcher(job, self.stdout)
        try:
            job = watcher.run()
        except KeyboardInterrupt:
            watcher.stop.set()
            self.stdout.write(
                f"\nleft job {job.name} running. Follow it: ugro logs {job.name} --follow; "
                f"cancel it: ugro cancel {job.name}"
            )
            return
        self._finish(job)

    def _report_detached(self, job: Job) -> None:
        if job.state in (Job.State.FAILED, Job.State.FAILING):
            raise CommandError(f"job {job.name} failed: {job.failure_reason}")
        where = ", ".join(f"rank {r.index} on {r.node.name}" for r in job.ranks.select_related("node"))
        self.stdout.write(f"job {job.name} {job.state}" + (f": {where}" if where else ""))
        if not worker_alive():
            # nothing else would follow it (or start it once nodes free up) until a worker runs
            self.stdout.write(f"no UGRO worker is running: `ugro logs {job.name} --follow` follows it, "
                              "bin/start runs the worker")  # fmt: skip

    def _finish(self, job: Job) -> None:
        spread = f", rank start spread {job.launch_spread_s * 1000:.0f} ms" if job.launch_spread_s else ""
        self.stdout.write(f"job {job.name} {job.state} after {job.duration() or 0:.1f}s{spread}")
        if job.state != Job.State.SUCCEEDED:
            raise CommandError(f"job {job.name} {job.state}: {job.failure_reason or '-'}")


def wait_final(job: Job) -> Job:
    """Wait (bounded: the kill grace and a margin) for a stopping job to reach its final state."""
    deadline = time.monotonic() + settings.UGRO["KILL_GRACE_S"] + reconcile.STOPPING_RETRY_S
    while job.is_stopping and time.monotonic() < deadline:
        time.sleep(0.1)
        job.refresh_from_db()
    return job


def start(job: Job, handover_s: float = 5.0) -> Job:
    """Hand the start to a live worker (warm links to the nodes); launch here if none takes it.

    Here, only this job is scheduled: a command never starts other people's queued jobs.
    """
    if worker_alive():
        request_schedule()  # runs now: a command's connection is in autocommit
        deadline = time.monotonic() + handover_s
        while time.monotonic() < deadline:
            job.refresh_from_db()
            if job.state != Job.State.QUEUED:
                break
            time.sleep(0.02)
        # the worker is launching it: wait (bounded) until the ranks are up or it failed
        deadline = time.monotonic() + job.sync_window_s + 60
        while job.state == Job.State.STARTING and time.monotonic() < deadline:
            time.sleep(0.05)
            job.refresh_from_db()
    if job.state == Job.State.QUEUED:
        schedule(only=[job.pk])
        job.refresh_from_db()
    return job


class Watcher:
    """Shows a job's progress in the terminal while following it (so no worker is needed)."""

    def __init__(self, job: Job, out) -> None:
        self.job, self.out = job, out
        self.offsets: dict[int, int] = {}
        self.watch = JobWatch(job, "cli")

    @property
    def stop(self):
        return self.watch.stop

    def run(self) -> Job:
        job, state, t0 = self.job, None, time.monotonic()
        self.watch.start()
        try:
            while True:
                job.refresh_from_db()
                if job.state == Job.State.QUEUED:
                    schedule(only=[job.pk])
                    job.refresh_from_db()
                if job.state != state:
                    state = job.state
                    ranks = ", ".join(f"{r.index}:{r.node.name}" for r in job.ranks.select_related("node"))
                    self.out.write(
                        f"[{time.monotonic() - t0:6.1f}s] {job.name} {state}"
                        + (f" (ranks {ranks})" if ranks and state == Job.State.RUNNING else "")
                    )
                self._print_new_lines(job)
                if self.watch.settled():
                    job.refresh_from_db()
                    self._print_new_lines(job)
                    return job
                time.sleep(0.3)
        finally:
            self.watch.close()

    def _print_new_lines(self, job: Job) -> None:
        for rank in job.ranks.order_by("index"):
            start = self.offsets.get(rank.index, 0)
            for end, line in rank_lines(rank, start):
                self.out.write(line.prefixed())
                self.offsets[rank.index] = end
        sys.stdout.flush()
