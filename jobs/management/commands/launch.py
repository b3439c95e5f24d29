from __future__ import annotations

import os
import sys
import time

from django.core.management.base import CommandError

from accounts import actions, policy
from accounts.commands import UserCommand
from jobs.launch import LaunchError, LaunchRequest
from jobs.lifecycle import wait_final
from jobs.logs import job_settled, rank_lines
from jobs.models import Job
from jobs.report import probe_record
from jobs.scale_probe import summary_lines as probe_lines
from jobs.scheduler import hand_to_worker
from jobs.snapshot import queue
from jobs.spec import LAUNCH, MAX_FILE_BYTES, SpecError, add_arguments, read_text, sync_path, to_yaml, with_typed
from ugro_site.celery import NO_WORKER, NoWorker, worker_alive


class Command(UserCommand):
    action = "launch"
    help = "Launch a training job on the cluster's nodes (all at once) and follow it."

    def add_arguments(self, parser):
        parser.add_argument(
            "--file", "-f", metavar="FILE", help="a job file (YAML: these options by name, docs/api.md); typed ones win"
        )
        add_arguments(parser, LAUNCH)  # every launch option, from the launch spec
        parser.add_argument("--detach", action="store_true", help="return once the ranks are started")

    def handle(self, **o):
        typed = {opt.field: o[opt.field] for opt in LAUNCH if opt.field in o}
        sync = o.get("sync", "")
        if o["file"]:
            values, sync = self._read_file(o["file"], typed, sync)
        else:
            values = typed
        if not values.get("name"):
            raise CommandError("--name is required (or a job file with -f that names the job)")
        try:
            req = LaunchRequest.from_fields(values, sync=sync)
        except LaunchError as exc:
            raise CommandError(str(exc)) from None
        if o["file"] and values.get("dry_run"):
            self.stdout.write(to_yaml(values, LAUNCH, sync), ending="")
        if values.get("dry_run"):
            try:
                rows = actions.preview(self.user, req)
            except (LaunchError, policy.Refused) as exc:
                raise CommandError(str(exc)) from None
            for row in rows:
                self.stdout.write(f"# {row}" if o["file"] else row)  # with -f, the whole output is a job file
            return
        try:
            if not worker_alive():
                actions.preview(self.user, req)  # bad input is named first; then the missing worker
                raise NoWorker(NO_WORKER)  # before anything is recorded: nothing is left behind
            job = actions.launch(self.user, req, self.source)
        except (LaunchError, policy.Refused, NoWorker) as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"job {job.name} queued (id {job.pk})")
        job = hand_to_worker(job)
        if job.is_stopping:
            job = wait_final(job)  # a failed start: the worker is tearing it down
        if o["detach"]:
            return self._report_detached(job)
        watcher = Watcher(job, self.stdout)
        try:
            job = watcher.run()
        except KeyboardInterrupt:
            self.stdout.write(
                f"\nleft job {job.name} running. Follow it: ugro logs {job.name} --follow; "
                f"cancel it: ugro cancel {job.name}"
            )
            return
        self._finish(job)

    def _read_file(self, path: str, typed: dict, sync: str) -> tuple[dict, str]:
        """The job file's values under the typed ones, and the directory to sync (the file's relative to it)."""
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read(MAX_FILE_BYTES + 1)
            values, from_file = read_text(text, LAUNCH, f"job file {path}")
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"cannot read job file {path}: {getattr(exc, 'strerror', None) or exc}") from None
        except SpecError as exc:
            raise CommandError(str(exc)) from None
        base = os.path.dirname(os.path.abspath(path))
        return with_typed(values, typed), sync or sync_path(from_file, base)

    def _report_detached(self, job: Job) -> None:
        if job.state in (Job.State.FAILED, Job.State.FAILING):
            raise CommandError(f"job {job.name} failed: {job.failure_reason}")
        where = ", ".join(f"rank {r.index} on {r.node.name}" for r in job.ranks.select_related("node"))
        self.stdout.write(f"job {job.name} {job.state}" + (f": {where}" if where else ""))
        for line in probe_lines(probe_record(job)):
            self.stdout.write(line)

    def _finish(self, job: Job) -> None:
        spread = f", rank start spread {job.launch_spread_s * 1000:.0f} ms" if job.launch_spread_s else ""
        self.stdout.write(f"job {job.name} {job.state} after {job.duration() or 0:.1f}s{spread}")
        if job.state != Job.State.SUCCEEDED:
            raise CommandError(f"job {job.name} {job.state}: {job.failure_reason or '-'}")


class Watcher:
    """Shows a job's progress in the terminal: its states and its ranks' lines as the worker's follower
    copies them. It only reads; the job goes on without it."""

    WAIT_POLL_S = 2.0  # how often a queued job's reason is asked again (a whole queue plan per ask)

    def __init__(self, job: Job, out) -> None:
        self.job, self.out = job, out
        self.offsets: dict[int, int] = {}
        self.why, self.why_at = "", -self.WAIT_POLL_S
        self.probe_shown: list[str] = []

    def run(self) -> Job:
        job, state, t0 = self.job, None, time.monotonic()
        while True:
            job.refresh_from_db()
            if job.state != state:
                state = job.state
                ranks = ", ".join(f"{r.index}:{r.node.name}" for r in job.ranks.select_related("node"))
                self.out.write(
                    f"[{time.monotonic() - t0:6.1f}s] {job.name} {state}"
                    + (f" (ranks {ranks})" if ranks and state == Job.State.RUNNING else "")
                )
            if state == Job.State.QUEUED and time.monotonic() - self.why_at >= self.WAIT_POLL_S:
                self.why_at = time.monotonic()
                why = waiting_reason(job)
                if why and why != self.why:
                    self.why = why
                    self.out.write(f"[{time.monotonic() - t0:6.1f}s] {job.name} waits {why}")
            self._print_probe(job)
            settled = job_settled(job)
            self._print_new_lines(job)
            if settled:
                job.refresh_from_db()
                return job
            time.sleep(0.3)

    def _print_probe(self, job: Job) -> None:
        """The scale probe's table as it grows (jobs/scale_probe.py), each new state of it once."""
        lines = probe_lines(probe_record(job))
        if lines and lines != self.probe_shown:
            self.probe_shown = lines
            for line in lines:
                self.out.write(line)

    def _print_new_lines(self, job: Job) -> None:
        for rank in job.ranks.order_by("index"):
            start = self.offsets.get(rank.index, 0)
            for end, line in rank_lines(rank, start):
                self.out.write(line.prefixed())
                self.offsets[rank.index] = end
        sys.stdout.flush()


def waiting_reason(job: Job) -> str:
    """Why a queued job waits, as `queue` says it: "(reason): detail"; empty when it starts at the next pass
    or has left the queue."""
    entry = next((e for e in queue() if e.job.pk == job.pk), None)
    if entry is None or entry.decision.start or not (entry.decision.reason or entry.decision.detail):
        return ""
    reason, detail = entry.decision.reason, entry.decision.detail
    return f"({reason})" + (f": {detail}" if detail else "") if reason else f": {detail}"
