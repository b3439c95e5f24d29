"""Job pages (board, detail, launch form), their POST actions and the logs JSON endpoint."""

from __future__ import annotations

import json
import re
import shlex
from datetime import timedelta
from urllib.parse import urlencode

from django import forms
from django.contrib import messages
from django.db.models import Count, Prefetch
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from accounts import actions, policy
from accounts.audit import web_source
from accounts.policy import Refused
from cluster.history import history
from cluster.models import GPU, Node
from metrics.final import final_loss, format_value
from metrics.models import LAST_FIRST, FinalMetric, JobMetrics, MetricPoint
from metrics.series import metric_names

from . import energy, lifecycle, network, recovery, report, retention
from .batches import parse_weights
from .launch import LaunchError, LaunchRequest, build_job
from .limits import parse_duration, parse_size_mb
from .logs import job_lines
from .models import Job, Rank, Sweep
from .scheduler import request_schedule
from .snapshot import Snapshot, queue
from .spec import (
    ATTEMPTS_MAX,
    BATCH_MAX,
    EPOCHS_MAX,
    GPUS_MAX,
    HANG_MAX_S,
    LR_MAX,
    LR_MIN,
    NODES_MAX,
    NPROC_MAX,
    PRIORITY_MAX,
    PRIORITY_MIN,
)
from .sweeps import trial_rows

LANES = (
    ("queued", "Queued", (Job.State.QUEUED,)),
    ("running", "Running", (*Job.LIVE_STATES, *Job.STOPPING_STATES)),
    ("done", "Done", Job.ENDED_STATES),
)
DONE_LIMIT = 50
CHART_METRICS = ("loss", "lr", "tokens_per_sec", "grad_norm")
MAX_TAIL = 5000
FIRST_BUCKETS = 600  # per panel (about half the page's width: two panels a row)
SWEEP_CHART_MAX = 50


def human_duration(seconds: float | None) -> str:
    return report.human_duration(seconds, empty="", sep=" ")


def _with_ranks(qs):
    ranks = Rank.objects.select_related("node").order_by("index")
    return qs.select_related("current").prefetch_related(Prefetch("current__ranks", queryset=ranks))


@require_GET
def board(request: HttpRequest) -> HttpResponse:
    """Queued -> running -> done lanes, filtered by state and name."""
    state = request.GET.get("state", "")
    query = request.GET.get("q", "").strip()
    jobs = Job.objects.all()
    if state in Job.State.values:
        jobs = jobs.filter(state=state)
    if query:
        jobs = jobs.filter(name__icontains=query)
    lanes = []
    for key, title, states in LANES:
        lane = _with_ranks(jobs.filter(state__in=states))
        if key == "done":
            lane = lane.order_by("-current__finished_at", "-created_at")[:DONE_LIMIT]
        elif key == "queued":
            lane = lane.order_by("-priority", "created_at")
        lane = list(lane)
        for job in lane:
            job.duration_text = human_duration(job.duration())
        lanes.append({"key": key, "title": title, "jobs": lane})
    return render(
        request,
        "jobs/board.html",
        {"lanes": lanes, "state": state, "q": query, "states": Job.State.choices, "nav": "jobs"},
    )


@require_GET
def queue_page(request: HttpRequest) -> HttpResponse:
    """Waiting jobs in start order (position, reason, estimated start) and which job holds which GPU."""
    snap = Snapshot()
    entries = queue(snap)
    gpus = []
    holding = {h[0] for h in snap.holders.values()}
    running = {j.pk: j for j in Job.objects.select_related("current").filter(pk__in=holding)}
    models = {(g.node_id, g.index): g for g in GPU.objects.all()}
    for n in snap.nodes:
        for slot in n.slots:
            holder = snap.holders.get((n.id, slot.index))
            gpus.append({"node": n.name, "index": slot.index, "gpu": models.get((n.id, slot.index)),
                         "job": running.get(holder[0]) if holder else None, "usable": n.usable})  # fmt: skip
    for e in entries:
        e.asks = report.asks_text(e.job)
    return render(request, "jobs/queue.html", {"entries": entries, "gpus": gpus, "nav": "queue"})


def final_metrics(job: Job, names: list[str]) -> tuple[list[int], list[dict]]:
    """The last value of each metric on each rank (the 'results' of a run): (ranks, one row per metric)."""
    rows, ranks = [], set()
    for name in names:
        last_by_rank: dict[int, MetricPoint] = {}
        for point in MetricPoint.objects.filter(job=job, name=name, superseded=False).order_by(LAST_FIRST, "-id")[:64]:
            last_by_rank.setdefault(point.rank, point)
        ranks.update(last_by_rank)
        rows.append({"name": name, "last": last_by_rank})
    order = sorted(ranks)
    for row in rows:
        last = row.pop("last")
        row["step"] = max((p.step for p in last.values() if p.step is not None), default=None)
        row["values"] = [format_value(last[r].value) if r in last else "—" for r in order]
    return order, rows


def summary_metrics(job: Job) -> tuple[list[int], list[dict]]:
    """The run's final metrics (the end-of-training summary it printed): (ranks, one row per name)."""
    by_name: dict[str, dict[int, float]] = {}
    for m in FinalMetric.objects.filter(job=job).order_by("name", "rank"):
        by_name.setdefault(m.name, {})[m.rank] = m.value
    order = sorted({rank for values in by_name.values() for rank in values})
    rows = [
        {"name": name, "values": [format_value(values[r]) if r in values else "—" for r in order]}
        for name, values in by_name.items()
    ]
    return order, rows


@require_GET
def detail(request: HttpRequest, pk: int) -> HttpResponse:
    job = get_object_or_404(_with_ranks(Job.objects.all()), pk=pk)
    names = metric_names(job.pk)
    prog = report.progress(job, names)
    elapsed = ((job.finished_at or timezone.now()) - job.running_at).total_seconds() if job.running_at else None
    chart_names = [n for n in CHART_METRICS if n in names] + [n for n in names if n not in CHART_METRICS]
    # Every panel's series in one answer, named in the page's head so that the browser fetches it while it
    # loads the scripts (static/js/job.js asks for this exact URL first).
    query = [("buckets", FIRST_BUCKETS), *[("name", name) for name in chart_names]]
    query += [("ranks", "first")] if request.GET.get("ranks") != "all" else []
    query += [("time", 1)] if request.GET.get("x", "step") != "step" else []
    panels_url = f"{reverse('api-job-panels', args=[job.pk])}?{urlencode(query)}" if chart_names else ""
    context = {
        "job": job,
        "ranks": list(job.ranks.all()),
        "metric_names": chart_names,
        "panels_url": panels_url,
        "progress": prog,
        "elapsed": human_duration(elapsed) or "—",
        "eta": human_duration(prog["eta"]) if prog and prog["eta"] is not None else "",
        "nav": "jobs",
    }
    marks = report.attempt_marks(job)
    ckpts = report.checkpoints(job)
    for c in ckpts:
        c.size_text = f"{c.size / 1e9:.2f} GB" if c.size >= 1e9 else f"{c.size / 1e6:.1f} MB"
        c.age = report.age(c.mtime)
    context.update(
        checkpoints=ckpts,
        ready_checkpoints=[c for c in ckpts if c.ready and c.step is not None and c.removed_at is None],
        resumable=job.state in lifecycle.RESUMABLE_STATES and policy.allowed(request.user, "resume", job),
        attempts=list(job.earlier_attempts),
        attempt_marks=marks,
        attempt_marks_json=json.dumps(marks),
        stragglers=recovery.stragglers(job) if job.state == Job.State.RUNNING else [],
        waiting=report.waiting_text(job) if job.state == Job.State.QUEUED and job.wait_nodes else "",
        code=report.code_record(job),
        retention_text=retention.summary_text(job),
        energy=energy.job_energy(job) if job.started_at else None,  # so far, while it runs (docs/power.md)
        scale_probe=report.probe_record(job),
        network_advice=network.advice(job),  # how much of a step is communication, and whether fewer nodes win
    )
    if job.is_ended:
        context["final_ranks"], context["final"] = final_metrics(job, names)
        context["summary_ranks"], context["summary"] = summary_metrics(job)
        context["config_path"] = job.job_dir / "config.json"
        context["final_loss"] = final_loss(job.pk)
    return render(request, "jobs/detail.html", context)


@require_GET
def sweeps(request: HttpRequest) -> HttpResponse:
    """Every sweep with its trial counts by state."""
    rows = []
    for sweep in Sweep.objects.annotate(n=Count("trials")).order_by("-created_at")[:200]:
        rows.append({"sweep": sweep, "n": sweep.n})
    return render(request, "jobs/sweeps.html", {"rows": rows, "nav": "jobs"})


@require_GET
def sweep_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """A sweep's trials as a sortable table (params, state, final and best metric) and their curves."""
    sweep = get_object_or_404(Sweep, pk=pk)
    rows = trial_rows(sweep)
    names = sorted({k for r in rows for k in r.params})
    used = energy.job_energies([r.job for r in rows])
    for r in rows:
        r.cells = [r.params.get(k, "") for k in names]
        r.final_text = format_value(r.final) if r.final is not None else "—"
        r.best_text = format_value(r.best) if r.best is not None else "—"
        r.energy = used[r.job.pk]  # energy per trial (docs/power.md)
    return render(
        request,
        "jobs/sweep.html",
        {
            "sweep": sweep,
            "rows": rows,
            "param_names": names,
            "best": next((r for r in rows if r.is_best), None),
            "live": any(not r.job.is_ended for r in rows),
            "chart_rows": rows[:SWEEP_CHART_MAX],
            "nav": "jobs",
        },
    )


@require_POST
def sweep_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    """Cancel every trial of the sweep not yet ended (returns at once; a worker stops running ones)."""
    sweep = get_object_or_404(Sweep, pk=pk)
    try:
        stopping = actions.cancel_sweep_as(request.user, sweep, web_source(request))
    except Refused as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"sweep {sweep.name} cancelled ({len(stopping)} running trials being stopped)")
    return redirect("sweep-detail", sweep.pk)


@require_POST
def cancel(request: HttpRequest, pk: int) -> HttpResponse:
    job = get_object_or_404(Job, pk=pk)
    try:
        # returns at once: a worker (or the reconciler) stops the processes
        job = actions.cancel(request.user, job, web_source(request))
    except ValueError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"job {job.name} {job.state}")
    return redirect(_next_url(request, reverse("job-detail", args=[job.pk])))


def relaunch_name(name: str) -> str:
    """`<base>-r<N>` with the first N not taken, where base drops an existing -r<N> suffix."""
    base = re.sub(r"-r\d+$", "", name)
    taken = set(Job.objects.filter(name__startswith=f"{base}-r").values_list("name", flat=True))
    n = 1
    while f"{base}-r{n}" in taken:
        n += 1
    return f"{base}-r{n}"


def relaunch_request(job: Job) -> LaunchRequest:
    params = job.params or {}
    metric_settings = JobMetrics.objects.filter(job=job).first()
    return LaunchRequest(
        name=relaunch_name(job.name),
        nodes=list(job.requested_nodes or []),
        count=job.requested_count,
        script=job.script,
        model=str(params.get("model") or ""),
        dataset=str(params.get("dataset") or ""),
        epochs=params.get("epochs"),
        lr=params.get("lr"),
        nproc_per_node=job.nproc_per_node,
        gpus=job.gpus,
        gpus_per_node=job.gpus_per_node,
        time_limit_s=job.time_limit_s,
        min_vram_mb=job.min_vram_mb if job.vram_source == "asked" else None,
        batch_per_gpu=params.get("batch_per_gpu"),
        batch_weights=params["batch_weights"] if isinstance(params.get("batch_weights"), dict) else {},
        batch_weights_auto=params.get("batch_weights") == "auto",
        scale_probe=f"{params['scale_probe_s']}s" if params.get("scale_probe_s") else "",
        extra_args=[str(a) for a in params.get("extra") or []],
        priority=job.priority,
        metrics_pattern=metric_settings.pattern if metric_settings else "",
        metrics_files=list(metric_settings.files) if metric_settings else [],
        retry=",".join(recovery.retry_names(job.retry_on or [])),
        max_attempts=job.max_attempts,
        min_nodes=job.min_nodes,
        resume_template=job.resume_template,
        checkpoint_glob=job.checkpoint_glob,
        keep=job.keep,
        batch_template=job.batch_template,
        batch=(job.batch or {}).get("batch"),
        grad_accum=(job.batch or {}).get("accum"),
        hang_after_s=job.hang_after_s,
    )


@require_POST
def resume(request: HttpRequest, pk: int) -> HttpResponse:
    """The next attempt of a failed or cancelled job, from the chosen checkpoint (latest by default)."""
    job = get_object_or_404(Job, pk=pk)
    wanted = request.POST.get("from", "latest")[:40] or "latest"
    try:
        job = actions.resume(request.user, job, wanted, None, web_source(request))
    except (recovery.RecoveryError, Refused) as exc:
        messages.error(request, f"resume of {job.name} refused: {exc}")
    else:
        request_schedule()
        messages.success(request, f"job {job.name} queued as attempt {job.attempt}")
    return redirect("job-detail", job.pk)


@require_POST
def relaunch(request: HttpRequest, pk: int) -> HttpResponse:
    """A new job with the same parameters under a new name."""
    job = get_object_or_404(Job, pk=pk)
    try:
        new = actions.launch(request.user, relaunch_request(job), web_source(request))
    except (LaunchError, Refused) as exc:
        messages.error(request, f"relaunch of {job.name} refused: {exc}")
        return redirect(_next_url(request, reverse("job-detail", args=[job.pk])))
    request_schedule()
    messages.success(request, f"job {new.name} queued (relaunch of {job.name})", extra_tags="queued")
    return redirect("job-detail", new.pk)


def _next_url(request: HttpRequest, default: str) -> str:
    target = request.POST.get("next", "")
    # Only our own paths: never an open redirect.
    return target if target.startswith("/") and not target.startswith("//") else default


class LaunchForm(forms.Form):
    """The CLI's `launch` options; create_job() does the validation both share."""

    name = forms.CharField(max_length=64, help_text="letters, digits, . _ -")
    nodes = forms.MultipleChoiceField(
        required=False, widget=forms.CheckboxSelectMultiple, help_text="none ticked: use the node count"
    )
    count = forms.IntegerField(
        required=False, min_value=1, max_value=NODES_MAX, label="Node count", help_text="blank: all enabled nodes"
    )
    gpus = forms.IntegerField(
        required=False, min_value=1, max_value=GPUS_MAX, label="GPUs",
        help_text="GPUs in all, on any nodes (instead of nodes); blank: whole nodes",
    )  # fmt: skip
    time_limit = forms.CharField(
        required=False, max_length=20, label="Time limit", help_text="e.g. 90m, 2h, 1d; blank: the cluster's default"
    )
    min_vram = forms.CharField(
        required=False, max_length=20, label="Min VRAM per GPU", help_text="e.g. 10G; blank: learned from earlier runs"
    )
    script = forms.CharField(required=False, max_length=500, help_text="blank: the cluster's default script")
    model = forms.CharField(required=False, max_length=200, help_text="blank: the cluster's default model")
    dataset = forms.CharField(required=False, max_length=200, help_text="blank: the cluster's default dataset")
    epochs = forms.IntegerField(
        required=False, min_value=1, max_value=EPOCHS_MAX, help_text="blank: not passed to the script"
    )
    lr = forms.FloatField(
        required=False, min_value=LR_MIN, max_value=LR_MAX, label="Learning rate",
        help_text="blank: not passed to the script",
    )  # fmt: skip
    nproc_per_node = forms.IntegerField(
        required=False, min_value=1, max_value=NPROC_MAX, label="Processes per node", help_text="blank: GPU count"
    )
    priority = forms.IntegerField(
        required=False, initial=0, min_value=PRIORITY_MIN, max_value=PRIORITY_MAX, help_text="higher starts first"
    )
    extra_args = forms.CharField(
        required=False,
        max_length=8000,
        label="Extra script arguments",
        help_text="split like a shell would, e.g. --max-steps 200 --log-every 5",
    )
    metrics_pattern = forms.CharField(
        required=False,
        max_length=500,
        label="Metrics pattern",
        help_text="a regular expression: the lines it matches give their key=value / key: value pairs",
    )
    metrics_files = forms.CharField(
        required=False,
        max_length=8000,
        widget=forms.Textarea(attrs={"rows": 2}),
        label="Metrics files",
        help_text="one per line: a metrics.csv, a TensorBoard event file or a directory with them, on the nodes",
    )
    gpus_per_node = forms.IntegerField(
        required=False, min_value=1, max_value=NPROC_MAX, label="GPUs per node", help_text="with a node count"
    )
    data = forms.CharField(
        required=False,
        max_length=8000,
        widget=forms.Textarea(attrs={"rows": 2}),
        label="Data",
        help_text="one per line, SRC[:DEST]: a directory or file on the controller, or NODE:PATH; at {job_dir}/DEST "
        "on every node",
    )
    packages = forms.CharField(
        required=False, max_length=1000, label="Packages",
        help_text="a lock file on the controller (requirements.txt, uv.lock, pylock.toml): its environment on every "
        "node",
    )  # fmt: skip
    after = forms.CharField(required=False, max_length=64, help_text="start only after this job succeeded")
    batch_per_gpu = forms.IntegerField(
        required=False, min_value=1, max_value=BATCH_MAX, label="Batch per GPU", help_text="fills {local_batch}"
    )
    batch_weights = forms.CharField(
        required=False, max_length=2000, label="Batch weights", help_text="uneven GPUs: NODE=WEIGHT,... or auto"
    )
    scale_probe = forms.CharField(
        required=False,
        max_length=20,
        label="Scale probe",
        help_text="a duration per node count (60s): run on the node count measured fastest; off: none",
    )
    retry = forms.CharField(
        required=False, max_length=200, label="Retry on", help_text="failure kinds resumed automatically: node-lost,oom"
    )
    max_attempts = forms.IntegerField(required=False, min_value=1, max_value=ATTEMPTS_MAX, label="Max attempts")
    min_nodes = forms.IntegerField(
        required=False, min_value=1, max_value=NODES_MAX, label="Min nodes", help_text="a node-lost retry may run on"
    )
    resume_template = forms.CharField(
        required=False, max_length=500, label="Resume argument", help_text="blank: --resume-from {checkpoint}"
    )
    checkpoint_glob = forms.CharField(required=False, max_length=500, label="Checkpoint glob")
    keep = forms.CharField(
        required=False, max_length=200, label="Keep checkpoints",
        help_text="LATEST[,best:METRIC:K], e.g. 2,best:eval_loss:1 (blank: the cluster's, else all)",
    )  # fmt: skip
    batch_template = forms.CharField(
        required=False, max_length=500, label="Batch arguments",
        help_text="e.g. --batch-size {batch} --grad-accum {accum}",
    )  # fmt: skip
    batch = forms.IntegerField(required=False, min_value=1, max_value=BATCH_MAX, label="Batch per rank")
    grad_accum = forms.IntegerField(required=False, min_value=1, max_value=BATCH_MAX, label="Gradient accumulation")
    hang_after_s = forms.FloatField(
        required=False, min_value=1, max_value=HANG_MAX_S, label="Hung after (s)",
        help_text="seconds without a metric line",
    )  # fmt: skip
    allow_mismatch = forms.BooleanField(
        required=False, label="Allow a script that differs between nodes",
        help_text="pre-flight refuses by default (docs/sync.md)",
    )  # fmt: skip

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["nodes"].choices = [
            (n.name, f"{n.name} ({n.role}, {n.gpu_label})")
            for n in Node.objects.filter(enabled=True).prefetch_related("gpus")
        ]

    def clean_time_limit(self) -> int | None:
        text = (self.cleaned_data["time_limit"] or "").strip()
        try:
            return parse_duration(text) if text else None
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean_min_vram(self) -> int | None:
        text = (self.cleaned_data["min_vram"] or "").strip()
        try:
            return parse_size_mb(text) if text else None
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean_batch_weights(self) -> str:
        text = (self.cleaned_data["batch_weights"] or "").strip()
        if text and text != "auto":
            try:
                parse_weights(text)
            except ValueError as exc:
                raise forms.ValidationError(str(exc)) from None
        return text

    def clean_extra_args(self) -> list[str]:
        try:
            return shlex.split(self.cleaned_data["extra_args"] or "")
        except ValueError as exc:
            raise forms.ValidationError(f"cannot split the arguments: {exc}") from None

    def launch_request(self) -> LaunchRequest:
        """The request the form describes; with field errors, the request its valid fields describe."""
        d = self.cleaned_data
        nodes = list(d.get("nodes") or [])
        weights = d.get("batch_weights") or ""
        return LaunchRequest(
            name=(d.get("name") or "").strip(),
            nodes=nodes,
            count=None if nodes or d.get("gpus") else d.get("count"),
            gpus=d.get("gpus"),
            time_limit_s=d.get("time_limit"),
            min_vram_mb=d.get("min_vram"),
            script=(d.get("script") or "").strip(),
            model=(d.get("model") or "").strip(),
            dataset=(d.get("dataset") or "").strip(),
            epochs=d.get("epochs"),
            lr=d.get("lr"),
            nproc_per_node=d.get("nproc_per_node"),
            extra_args=d.get("extra_args") or [],
            priority=d.get("priority") or 0,
            metrics_pattern=d.get("metrics_pattern") or "",
            metrics_files=[line.strip() for line in (d.get("metrics_files") or "").splitlines() if line.strip()],
            data=[line.strip() for line in (d.get("data") or "").splitlines() if line.strip()],
            packages=(d.get("packages") or "").strip(),
            gpus_per_node=d.get("gpus_per_node"),
            after=(d.get("after") or "").strip(),
            batch_per_gpu=d.get("batch_per_gpu"),
            batch_weights=parse_weights(weights) if weights and weights != "auto" else {},
            batch_weights_auto=weights == "auto",
            scale_probe=(d.get("scale_probe") or "").strip(),
            retry=(d.get("retry") or "").strip(),
            max_attempts=d.get("max_attempts"),
            min_nodes=d.get("min_nodes"),
            resume_template=(d.get("resume_template") or "").strip(),
            checkpoint_glob=(d.get("checkpoint_glob") or "").strip(),
            keep=(d.get("keep") or "").strip(),
            batch_template=(d.get("batch_template") or "").strip(),
            batch=d.get("batch"),
            grad_accum=d.get("grad_accum"),
            hang_after_s=d.get("hang_after_s"),
            allow_mismatch=bool(d.get("allow_mismatch")),
        )

    def add_launch_problems(self, exc: LaunchError) -> None:
        """Each problem beside its field (a field that already has an error keeps just that one)."""
        for field_name, message in exc.problems:
            if field_name in self.fields:
                if field_name not in self.errors:
                    self.add_error(field_name, message)
            else:
                self.add_error(None, message)


def launch(request: HttpRequest) -> HttpResponse:
    """The launch form; its "Show commands" button shows what each rank would run (a dry run)."""
    form = LaunchForm(request.POST or None)
    commands: list[str] = []
    if request.method == "POST" and form.is_valid():
        try:
            if "dry_run" in request.POST:
                commands = actions.preview(request.user, form.launch_request())
            else:
                job = actions.launch(request.user, form.launch_request(), web_source(request))
                request_schedule()
                messages.success(request, f"job {job.name} queued", extra_tags="queued")
                return redirect("job-detail", job.pk)
        except LaunchError as exc:
            form.add_launch_problems(exc)
        except Refused as exc:
            form.add_error(None, str(exc))
    elif request.method == "POST":
        # The form's own errors and the launch checks of the fields that passed, all at once.
        try:
            build_job(form.launch_request())
        except LaunchError as exc:
            form.add_launch_problems(exc)
    return render(request, "jobs/launch.html", {"form": form, "commands": commands, "nav": "launch"})


@require_GET
def api_checkpoints(request: HttpRequest, pk: int) -> JsonResponse:
    """The checkpoints the follower recorded for a job (no node is asked during the request)."""
    job = get_object_or_404(Job, pk=pk)
    found = report.checkpoints(job)
    return JsonResponse(
        {
            "job": job.pk,
            "checkpoints": [[c.node.name, c.path, c.size] for c in found],
            "details": [
                {
                    "node": c.node.name,
                    "path": c.path,
                    "size": c.size,
                    "step": c.step,
                    "mtime": c.mtime,
                    "kind": c.kind,
                    "ready": c.ready,
                    "attempt": c.attempt,
                }
                for c in found
            ],  # fmt: skip
            "offered": sorted({c.step for c in found if c.ready and c.step is not None}, reverse=True),
        }
    )


@require_GET
def api_system(request: HttpRequest, pk: int) -> JsonResponse:
    """GPU, CPU and RAM of the job's nodes over its run (its GPUs only when it ran a set number per node)."""
    job = get_object_or_404(Job, pk=pk)
    start = job.running_at or job.started_at
    ranks = list(job.ranks.select_related("node"))
    if start is None or not ranks:
        return JsonResponse({"job": job.pk, "metrics": []})
    until = max(job.finished_at or timezone.now(), start + timedelta(minutes=1))
    # the GPUs it held: its power curve is theirs, as its energy is
    gpus = {r.node_id: set(r.gpu_indices) for r in ranks if r.gpu_indices} or (
        {r.node_id: set(range(job.nproc_per_node)) for r in ranks} if job.nproc_per_node else None
    )
    data = history([r.node for r in ranks], start, until, buckets=400, gpus=gpus)
    return JsonResponse({"job": job.pk, **data, "energy": energy.job_energy(job).to_dict()})


@require_GET
def api_logs(request: HttpRequest, pk: int) -> JsonResponse:
    """The last `tail` committed log lines of one rank (`rank=`) or of all ranks merged."""
    job = get_object_or_404(Job, pk=pk)
    try:
        rank = int(request.GET["rank"]) if request.GET.get("rank", "") != "" else None
        tail = min(MAX_TAIL, max(1, int(request.GET.get("tail", 500))))
    except ValueError:
        return JsonResponse({"error": "rank and tail must be integers"}, status=400)
    ranks = list(job.ranks.order_by("index"))
    lines = job_lines(job, rank_index=rank, tail=tail, ranks=ranks)
    return JsonResponse(
        {
            "job": job.pk,
            "lines": [[ln.time, ln.rank, ln.text] for ln in lines],
            # how far each rank's log was read: live events ending at or before it are already here
            "offsets": {str(r.index): r.log_offset for r in ranks},
        }
    )


__all__ = ["board", "detail", "cancel", "resume", "relaunch", "launch", "api_logs"]
