"""How a job is launched: validate the request, place it on free GPUs, start every rank at once.

create_job() records a QUEUED job; the scheduler (jobs/scheduler.py) claims its GPUs under the
database's one-active-allocation-per-GPU constraint; launch() connects to every node, starts each
rank detached through the node agent, all concurrently, and fails the job (stopping whatever
started) if they are not all up within the sync window.
"""

from __future__ import annotations

import json
import logging
import math
import posixpath
import shlex
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import transaction

from cluster import links
from cluster.fanout import node_request, on_each
from cluster.models import GPU, ClusterSettings, Node
from cluster.names import check_name
from metrics.files import check_paths
from metrics.models import JobMetrics
from metrics.parsing import compile_pattern

from . import cache, checkpoints, data, lifecycle, locks, network, retention, scale_probe, spec, sync
from . import envs as environments
from .batches import parse_weights, split_batch
from .failure import Failure, FailureKind
from .follow import follower_id
from .limits import learned_speeds, learned_vram, parse_duration, parse_size_mb
from .models import DEFAULT_RESUME_TEMPLATE, Job, JobCode, Rank
from .preflight import PreflightReport, check_nodes, named_nodes, refuse_missing_pythons, run_preflight, script_path
from .recovery import check_batch_template, parse_retry
from .snapshot import Snapshot
from .spec import EPOCHS_MAX, LR_MAX, NODES_MAX, NPROC_MAX, PRIORITY_MAX, PRIORITY_MIN
from .stop import stop_processes

log = logging.getLogger(__name__)

# The train_production.py interface; a cluster can name another script and template. An item whose
# value was neither given nor configured is left out (with its option): nothing is passed silently.
DEFAULT_ARGS_TEMPLATE = [
    "--model-name", "{model}", "--dataset-name", "{dataset}", "--num-epochs", "{epochs}",
    "--learning-rate", "{lr}",
]  # fmt: skip
MAX_ARG_LEN = 4096
# a job's ranks must all have started within this (connect, sync, spawn on every node) or the launch fails
SYNC_WINDOW_S = 30.0


class LaunchError(ValueError):
    """The launch request is invalid; nothing was created or started.

    ``problems`` holds every problem found, each as (launch form field or "" for the whole request, message);
    the text is all their messages on one line.
    """

    def __init__(self, message: str = "", problems: list[tuple[str, str]] | None = None) -> None:
        self.problems = problems if problems is not None else [("", message)]
        super().__init__("; ".join(text for _, text in self.problems))


@dataclass
class LaunchRequest:
    """What the user asked for, from the CLI or the launch form."""

    name: str
    nodes: list[str] = field(default_factory=list)
    count: int | None = None
    script: str = ""
    model: str = ""
    dataset: str = ""
    epochs: int | None = None
    lr: float | None = None
    nproc_per_node: int | None = None
    extra_args: list[str] = field(default_factory=list)
    priority: int = 0
    metrics_pattern: str = ""  # a regex: the lines it matches give their key=value / key: value pairs
    metrics_files: list[str] = field(default_factory=list)  # metric files or directories on the nodes
    owner: Any = None  # the user who launches it (None: the system)
    gpus: int | None = None  # GPUs in all, on any nodes
    gpus_per_node: int | None = None  # with count or nodes: GPUs on each node (None: whole nodes)
    time_limit_s: int | None = None  # None: the cluster's default
    min_vram_mb: int | None = None  # each GPU needs this much; None: learned from earlier runs, if any
    sweep: Any = None
    sweep_params: dict = field(default_factory=dict)
    resumed_from: Any = None  # the previous attempt (for the VRAM it needed)
    batch_per_gpu: int | None = None  # the even split's batch per GPU: {local_batch}, UGRO_LOCAL_BATCH
    batch_weights: dict[str, float] = field(default_factory=dict)  # node -> relative GPU speed (uneven split)
    batch_weights_auto: bool = False  # weights from the scale probe, else from earlier solo runs on each node
    scale_probe: str = ""  # a duration per node count ("60s"), "off", or "" for the cluster's (jobs/scale_probe.py)
    after: str = ""  # the name of a job this one starts after (once it succeeded)
    # recovery (docs/recovery.md)
    retry: str = ""  # failure kinds retried automatically, e.g. "node-lost,oom"
    max_attempts: int | None = None
    min_nodes: int | None = None
    resume_template: str = ""  # blank: --resume-from {checkpoint}
    checkpoint_glob: str = ""
    batch_template: str = ""  # e.g. --batch-size {batch} --grad-accum {accum}
    batch: int | None = None
    grad_accum: int | None = None
    hang_after_s: float | None = None
    keep: str = ""  # checkpoint retention, LATEST[,best:METRIC:K] (jobs/retention.py); blank: the cluster's
    sync: str = ""  # a directory on the controller copied to every node; the ranks start in the copy
    sync_upload: str = ""  # the digest of a directory a client uploaded (POST /api/v1/sync/...)
    data: list[str] = field(default_factory=list)  # SRC[:DEST] items put in the job's directory on every node
    packages: str = ""  # a lock file on the controller: the environment built on every node (docs/envs.md)
    allow_mismatch: bool = False  # start even if the script's sha256 differs between nodes

    @classmethod
    def from_fields(cls, values: dict[str, Any], **more: Any) -> LaunchRequest:
        """The request the launch spec's fields describe (jobs/spec.py: the API's names and types), each one
        not given at its default; LaunchError naming a time limit, VRAM size or batch weights it cannot read."""
        d = {**spec.defaults(spec.LAUNCH), **{k: v for k, v in values.items() if k in spec.FIELDS}}
        weights = (d.pop("batch_weights") or "").strip()
        problems: list[tuple[str, str]] = []
        parsed: dict[str, Any] = {}
        for name, target, parse in (
            ("time_limit", "time_limit_s", parse_duration), ("min_vram", "min_vram_mb", parse_size_mb),
            ("batch_weights", "batch_weights", parse_weights),
        ):  # fmt: skip
            text = weights if name == "batch_weights" else (d.pop(name) or "").strip()
            try:
                parsed[target] = parse(text) if text and text != "auto" else ({} if name == "batch_weights" else None)
            except ValueError as exc:
                problems.append((name, str(exc)))
        if problems:
            raise LaunchError(problems=problems)
        for name in ("script", "model", "dataset", "after", "scale_probe"):
            d[name] = (d[name] or "").strip()
        d.pop("dry_run", None)
        return cls(**d, **parsed, batch_weights_auto=weights == "auto", **more)


def _check_arg(value: str, what: str) -> str:
    # Values travel as argv items (never through a shell), but a NUL cannot be in argv at all.
    if "\x00" in value:
        raise LaunchError(f"{what} contains a NUL byte")
    if len(value) > MAX_ARG_LEN:
        raise LaunchError(f"{what} is longer than {MAX_ARG_LEN} characters")
    return value


def _int_in(value: Any, low: int, high: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        shown = str(value) if len(str(value)) <= 20 else str(value)[:20] + "..."
        raise LaunchError(f"{what} must be a whole number from {low} to {high}, not {shown}")


def _number_problems(req: LaunchRequest) -> list[tuple[str, str]]:
    """Every number of a request within its bounds (a huge one would overflow a column: a 500): the
    problems found, each as (launch form field, message)."""
    problems: list[tuple[str, str]] = []

    def check(field_name: str, value: Any, low: int, high: int, what: str) -> None:
        try:
            _int_in(value, low, high, what)
        except LaunchError as exc:
            problems.append((field_name, str(exc)))

    check("priority", req.priority, PRIORITY_MIN, PRIORITY_MAX, "priority")
    if req.count is not None:
        check("count", req.count, 1, NODES_MAX, "the node count")
    if req.epochs is not None:
        check("epochs", req.epochs, 1, EPOCHS_MAX, "epochs")
    if req.nproc_per_node is not None:
        check("nproc_per_node", req.nproc_per_node, 1, NPROC_MAX, "nproc-per-node")
    if req.lr is not None:
        lr = req.lr
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or not 0 < lr <= LR_MAX:
            message = f"learning rate must be a number above 0 and at most {LR_MAX:g}, not {str(lr)[:20]}"
            problems.append(("lr", message))
    if len(req.nodes) > NODES_MAX:
        problems.append(("nodes", f"at most {NODES_MAX} nodes may be named"))
    if len(req.extra_args) > 1000:
        problems.append(("extra_args", "at most 1000 extra arguments"))
    return problems


def check_script(script: str) -> str:
    """The script as given, refused when it could be read as an option or climbs out of a directory."""
    script = script.strip()
    if not script:
        raise LaunchError("no training script given and the cluster has no default script")
    if script.startswith("-"):
        raise LaunchError(f"script {script[:80]!r} starts with '-': it would be read as an option, not a file")
    if ".." in script.split("/"):
        raise LaunchError(f"script {script[:80]!r} contains '..'; give a path inside an allowed script root")
    if any(ord(c) < 32 for c in script):
        raise LaunchError("script contains a control character")
    return posixpath.normpath(script)


def script_roots(node: Node, cs: ClusterSettings) -> list[str]:
    """Where scripts may live on `node`: ClusterSettings.script_roots ({workdir} is the node's working
    directory, {scripts} the cluster's paths.scripts), by default the scripts directory and the workdir."""
    scripts_dir = str((cs.paths or {}).get("scripts") or "")
    configured = [str(r) for r in (cs.script_roots or []) if str(r).strip()] or ["{scripts}", "{workdir}"]
    roots = []
    for root in configured:
        if "{scripts}" in root and not scripts_dir:
            continue
        roots.append(posixpath.normpath(root.replace("{workdir}", node.workdir).replace("{scripts}", scripts_dir)))
    return roots


def _under(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")


def _check_script_roots(script: str, nodes: list[Node], cs: ClusterSettings) -> None:
    for node in nodes:
        path = posixpath.normpath(script_path(node, script))
        roots = script_roots(node, cs)
        if not any(_under(path, root) for root in roots):
            raise LaunchError(
                f"script {path} on {node.name} is outside the allowed script roots ({', '.join(roots) or 'none'})"
            )


def render_args(template: list[str], values: dict[str, str | None]) -> list[str]:
    """Fill {model} {dataset} {epochs} {lr} {job} into each template item; other braces stay literal.

    A value of None (neither given nor configured) leaves its item out, and the option just before it
    when that is a bare flag (["--lr", "{lr}"] both go; so does "--lr={lr}").
    """
    out: list[str] = []
    flag_index: int | None = None  # where the last bare option without a placeholder went
    for item in template:
        unset = [key for key, value in values.items() if value is None and "{" + key + "}" in item]
        if unset:
            if flag_index is not None and flag_index == len(out) - 1:
                out.pop()
            flag_index = None
            continue
        filled = item
        for key, value in values.items():
            if value is not None:
                filled = filled.replace("{" + key + "}", value)
        flag_index = len(out) if item.startswith("-") and filled == item else None
        out.append(filled)
    return out


def create_job(req: LaunchRequest) -> Job:
    """Validate a request and record it as a QUEUED job; raises LaunchError with a one-line reason."""
    job, pattern, files = build_job(req)
    code = _snapshot_code(job, req)
    with transaction.atomic():
        # A job that never ran because its checks refused it leaves its name free for the fixed launch.
        _never_ran(req.name).delete()
        job.save()
        code.job = job
        code.save()
        if pattern or files:
            JobMetrics.objects.create(job=job, pattern=pattern, files=files)
    return job


def _snapshot_code(job: Job, req: LaunchRequest) -> JobCode:
    """The job's code record; with a directory to sync, its files taken into the controller's store now
    (the job runs them as they are at launch, however long it queues). LaunchError in one line."""
    planned = getattr(job, "packages_planned", None)
    code = JobCode(allow_mismatch=req.allow_mismatch, data=getattr(job, "data_planned", []),
                   envs={"lock": planned} if planned else {})  # fmt: skip
    if not job.sync_planned:
        return code
    kind, value = job.sync_planned
    try:
        if kind == "dir":
            manifest, git = sync.snapshot(value)
            listing, digest, code.sync_source, code.git = manifest.as_dict(), manifest.digest, value, git
        else:
            listing, digest = sync.load_manifest(value), value
            code.sync_source, code.git = sync.upload_source(value), sync.upload_git(value)
    except ValueError as exc:
        raise LaunchError(problems=[("sync", str(exc))]) from None
    if job.script not in {f["path"] for f in listing["files"]}:
        where = code.sync_source or "the uploaded directory"
        raise LaunchError(problems=[("script", f"script {job.script} is not in {where} (or .gitignore leaves it out)")])
    code.sync_digest = digest
    code.sync_files = len(listing["files"])
    code.sync_bytes = sum(f["size"] for f in listing["files"])
    return code


def _never_ran(name: str):
    return Job.objects.filter(
        name=name, state=Job.State.FAILED, current__running_at__isnull=True, current__number=1,
        current__failure_kind__in=[FailureKind.PREFLIGHT.value, FailureKind.NODE_LOST.value],
    )  # fmt: skip


def build_job(req: LaunchRequest) -> tuple[Job, str, list[str]]:
    """The unsaved job a request makes, with its metrics pattern and files; raises LaunchError naming every
    problem of the request at once (a form shows each beside its field)."""
    problems: list[tuple[str, str]] = []

    def check(field_name: str, fn, *args):
        try:
            return fn(*args)
        except ValueError as exc:  # LaunchError is one too
            problems.append((field_name, str(exc)))
            return None

    try:
        check_name(req.name, "job name")
    except ValueError as exc:
        problems.append(("name", str(exc)))
    else:
        if Job.objects.filter(name=req.name).exists() and not _never_ran(req.name).exists():
            problems.append(("name", f"a job named {req.name!r} already exists; choose another name"))
    cs = ClusterSettings.load()
    training = cs.training or {}
    # only what the user gave, else what the cluster configured; nothing else reaches the script
    model = req.model or str(training.get("default_model") or "") or None
    dataset = req.dataset or str(training.get("default_dataset") or "") or None
    for value, what in ((model, "model"), (dataset, "dataset")):
        if value is not None:
            check(what, _check_arg, value, what)
    problems.extend(_number_problems(req))
    script = check("script", lambda given: check_script(_check_arg(given, "script")), req.script or cs.default_script)
    extra = [check("extra_args", _check_arg, a, "extra argument") for a in req.extra_args]
    pattern = req.metrics_pattern.strip()
    if pattern:
        check("metrics_pattern", compile_pattern, pattern)
    files = check("metrics_files", check_paths, req.metrics_files)

    enabled = list(Node.objects.filter(enabled=True))
    enabled_names = {n.name for n in enabled}
    if req.nodes:
        for name in req.nodes:
            if name not in enabled_names:
                known = Node.objects.filter(name=name).exists()
                problems.append(("nodes", f"node {name!r} is {'disabled' if known else 'not in the cluster'}"))
        if len(set(req.nodes)) != len(req.nodes):
            problems.append(("nodes", "a node is named twice"))
    count = req.count
    if not req.nodes and count is None and req.gpus is None:
        count = 1 if req.gpus_per_node else len(enabled)
    if not enabled:
        problems.append(("", "the cluster has no enabled nodes; import cluster.yaml or add nodes in admin"))
    elif count is not None and count > len(enabled):
        problems.append(("count", f"asked for {count} nodes but the cluster has {len(enabled)} enabled"))
    synced = check("sync", _check_sync, req, cs, script) if (req.sync or req.sync_upload or _default_sync(cs)) else None
    if enabled and script is not None and not synced:
        # Any of these may run it: the script must be under an allowed root on each of them.
        runners = [n for n in enabled if n.name in req.nodes] if req.nodes else enabled
        check("script", _check_script_roots, script, runners, cs)
    data_items = check("data", _check_data, req, cs)
    lock = check("packages", environments.check, req.packages, cs)
    vram, vram_source = None, ""
    if enabled and not any(f in ("nodes", "count") for f, _ in problems):
        vram, vram_source = check("gpus", _check_gpus, req, enabled, count, script or cs.default_script) or (None, "")
    limit = check("time_limit", _check_time_limit, req, cs)
    check("", _check_queue_quota, req, cs)
    after = check("after", _find_after, req.after) if req.after else None
    per_gpu = req.batch_per_gpu or training.get("batch_size_per_gpu")
    keep = check("keep", retention.resolve, req.keep, training)  # the cluster's default is taken now, once
    check("batch_weights", _check_batches, req, per_gpu)
    probe_s = check("scale_probe", scale_probe.seconds_for, req.scale_probe, training)
    if problems:
        raise LaunchError(problems=problems)

    recovery = _recovery_fields(req, count or len(req.nodes))
    values = {
        "model": model,
        "dataset": dataset,
        "epochs": str(req.epochs) if req.epochs is not None else None,
        "lr": repr(req.lr) if req.lr is not None else None,
        "job": req.name,
    }
    args = render_args(cs.script_args_template or DEFAULT_ARGS_TEMPLATE, values) + extra
    job = Job(
        name=req.name,
        script=script,
        script_args=args,
        params={"model": req.model or None, "dataset": req.dataset or None, "epochs": req.epochs, "lr": req.lr,
                "extra": extra, **_batch_params(per_gpu, "auto" if req.batch_weights_auto else req.batch_weights),
                **({"scale_probe_s": probe_s} if probe_s else {})},
        requested_nodes=list(req.nodes),
        requested_count=None if req.nodes or req.gpus else count,
        nproc_per_node=req.nproc_per_node,
        gpus=req.gpus,
        gpus_per_node=req.gpus_per_node,
        time_limit_s=limit,
        min_vram_mb=vram,
        vram_source=vram_source,
        priority=req.priority,
        sync_window_s=SYNC_WINDOW_S,
        owner=req.owner,
        sweep=req.sweep,
        sweep_params=req.sweep_params,
        resumed_from=req.resumed_from,
        after=after,
        **recovery,
        keep=keep or "",
    )  # fmt: skip
    job.sync_planned = synced  # (source directory or upload digest): the ranks start in the job's copy
    job.data_planned = [item.as_dict() for item in data_items or []]
    job.packages_planned = lock.as_dict() if lock else None
    return job, pattern, files


def _check_data(req: LaunchRequest, cs: ClusterSettings) -> list[data.Item]:
    """The job's --data items and the cluster's training.data, each checked (jobs/data.py); LaunchError in one
    line."""
    names = set(Node.objects.values_list("name", flat=True))
    try:
        items = [data.parse(v, names) for v in [*data.cluster_items(cs), *req.data]]
        return data.check(items, cs)
    except data.DataError as exc:
        raise LaunchError(str(exc)) from None


def _default_sync(cs: ClusterSettings) -> str:
    """The cluster's default directory to sync (cluster.yaml training.sync), '' when none."""
    return str((cs.training or {}).get("sync") or "")


def _check_sync(req: LaunchRequest, cs: ClusterSettings, script: str | None) -> tuple[str, str] | None:
    """("dir", real path) or ("upload", digest) of the code to sync; None for none (`--sync none`)."""
    if req.sync_upload:
        if req.sync:
            raise LaunchError("give --sync or an uploaded directory, not both")
        manifest = sync.load_manifest(sync.check_digest(req.sync_upload))
        if sync.missing_objects(manifest):
            raise LaunchError(f"the uploaded directory {req.sync_upload[:12]} is not complete; upload it again")
        chosen = ("upload", req.sync_upload)
    else:
        wanted = req.sync or _default_sync(cs)
        if wanted == "none":
            return None
        chosen = ("dir", sync.check_source(wanted, cs))
    if script and (posixpath.isabs(script) or script.startswith("~")):
        raise LaunchError(f"with --sync the script is a path inside the synced directory, not {script}")
    return chosen


def _recovery_fields(req: LaunchRequest, nodes: int) -> dict[str, Any]:
    """The job's recovery settings from a request; LaunchError with a one-line reason."""
    from_template = req.resume_template.strip() or DEFAULT_RESUME_TEMPLATE
    if "{checkpoint}" not in from_template:
        raise LaunchError("--resume-template must contain {checkpoint}")
    for text, what in ((from_template, "resume template"), (req.batch_template, "batch template"),
                       (req.checkpoint_glob, "checkpoint glob")):  # fmt: skip
        _check_arg(text, what)
    glob = req.checkpoint_glob.strip()
    if glob.startswith("/") or ".." in glob.split("/"):
        raise LaunchError("--checkpoint-glob must be relative to the node's workdir, without '..'")
    if req.max_attempts is not None and not 1 <= req.max_attempts <= 100:
        raise LaunchError("--max-attempts must be between 1 and 100")
    for value, what in ((req.batch, "--batch"), (req.grad_accum, "--grad-accum")):
        if value is not None:
            _int_in(value, 1, 1_000_000, what)
    if req.min_nodes is not None and not 1 <= req.min_nodes <= max(1, nodes):
        raise LaunchError(f"--min-nodes must be between 1 and the job's {nodes} nodes")
    if req.hang_after_s is not None and not (math.isfinite(req.hang_after_s) and req.hang_after_s > 0):
        raise LaunchError("--hang-after must be a positive number of seconds")
    try:
        retry_on = parse_retry(req.retry) if req.retry else []
        batch = check_batch_template(req.batch_template.strip(), req.batch, req.grad_accum)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    return {
        "retry_on": retry_on, "max_attempts": req.max_attempts, "min_nodes": req.min_nodes,
        "resume_template": from_template, "checkpoint_glob": glob, "batch_template": req.batch_template.strip(),
        "batch": batch, "hang_after_s": req.hang_after_s,
    }  # fmt: skip


def _batch_params(per_gpu: Any, weights: dict[str, float] | str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(per_gpu, int) and per_gpu >= 1:
        out["batch_per_gpu"] = per_gpu
    if weights:
        out["batch_weights"] = weights if isinstance(weights, str) else dict(weights)
    return out


def assign_batches(job: Job, ranks: list[Rank], measured: dict[str, float] | None = None) -> None:
    """Each rank's local batch (per GPU) and weight, set on the rank objects (rank_env and rank_command
    read them): in proportion to its node's batch weight when the job has weights, else even. measured: the
    weights its scale probe measured (--batch-weights auto)."""
    per_gpu = (job.params or {}).get("batch_per_gpu")
    weights = (job.params or {}).get("batch_weights") or {}
    if weights == "auto" and measured and per_gpu:
        weights = measured
    elif weights == "auto":  # learned when placed: the nodes are known only now
        weights = learned_speeds(job.script, [r.node for r in ranks]) if per_gpu else {}
        if not weights:
            weights = {r.node.name: 1.0 for r in ranks}  # nothing learned yet: an even split, said so
    for r in ranks:
        r.local_batch = per_gpu
    if not per_gpu:
        return
    counts = [job.nproc_per_node or len(r.gpu_indices) or 1 for r in ranks]
    local = split_batch(per_gpu, [float(weights.get(r.node.name, 1.0)) for r in ranks], counts)
    for r, b in zip(ranks, local, strict=True):
        r.local_batch = b
        r.batch_weight = b / per_gpu if weights else None


def _check_gpus(req: LaunchRequest, enabled: list[Node], count: int | None, script: str) -> tuple[int | None, str]:
    """Validate what the request asks of the cluster's GPUs; (min VRAM MiB, where it came from).

    A request no GPU (or node) of the cluster could ever satisfy is refused here, naming what the
    cluster has; one that only has to wait is accepted.
    """
    if req.gpus is not None and (req.nodes or req.count is not None or req.gpus_per_node is not None):
        raise LaunchError("--gpus N asks for GPUs on any nodes: use it alone, or --nodes K --gpus-per-node M")
    if req.gpus is not None and req.gpus < 1:
        raise LaunchError("--gpus must be at least 1")
    if req.gpus_per_node is not None and req.gpus_per_node < 1:
        raise LaunchError("--gpus-per-node must be at least 1")
    vram, source = req.min_vram_mb, "asked" if req.min_vram_mb else ""
    if vram is not None and vram < 1:
        raise LaunchError("--min-vram must be at least 1M")
    if vram is None:
        learned = learned_vram(script, req.resumed_from)
        if learned:
            vram, source = learned
    gpus = list(GPU.objects.filter(node__in=enabled).select_related("node"))
    wants_gpus = req.gpus is not None or req.gpus_per_node is not None
    if (wants_gpus or req.min_vram_mb) and not gpus:
        raise LaunchError("the cluster has no GPUs (every enabled node has gpu_count 0)")
    if vram and gpus:
        largest = max(gpus, key=lambda g: g.vram_mb)
        if largest.vram_mb < vram:
            if source == "asked":
                raise LaunchError(
                    f"no GPU has {vram / 1024:.1f} GB; the largest is {largest.node.name} GPU {largest.index} "
                    f"({largest.model or 'GPU'}, {largest.vram_mb / 1024:.1f} GB)"
                )
            vram, source = None, ""  # a learned need no card has now (cards changed): do not block on it
    fit = [g for g in gpus if not vram or g.vram_mb >= vram]
    per_node: dict[str, int] = {}
    for g in fit:
        per_node[g.node.name] = per_node.get(g.node.name, 0) + 1
    vram_text = f" with {vram / 1024:.1f} GB or more" if vram else ""
    if req.gpus is not None and req.gpus > len(fit):
        raise LaunchError(f"asked for {req.gpus} GPUs but the cluster has {len(fit)}{vram_text}")
    if req.gpus_per_node is not None:
        pool = req.nodes or list(per_node)
        short = [name for name in pool if per_node.get(name, 0) < req.gpus_per_node]
        if req.nodes and short:
            raise LaunchError(f"node {short[0]} has {per_node.get(short[0], 0)} GPUs{vram_text}, "
                              f"fewer than --gpus-per-node {req.gpus_per_node}")  # fmt: skip
        if not req.nodes and sum(1 for n in per_node.values() if n >= req.gpus_per_node) < (count or 1):
            raise LaunchError(f"asked for {count} nodes with {req.gpus_per_node} GPUs{vram_text} each; the "
                              f"cluster has {sum(1 for n in per_node.values() if n >= req.gpus_per_node)}")  # fmt: skip
    return vram, source


def _find_after(name: str) -> Job:
    after = Job.objects.filter(name=name).first()
    if after is None:
        raise LaunchError(f"--after {name[:64]!r}: no such job")
    if after.state in (Job.State.FAILED, Job.State.CANCELLED):
        raise LaunchError(f"--after {after.name}: that job {after.state}; this one would never start")
    return after


def _check_batches(req: LaunchRequest, per_gpu: Any) -> None:
    if req.batch_per_gpu is not None and req.batch_per_gpu < 1:
        raise LaunchError("--batch-per-gpu must be at least 1")
    if req.batch_weights_auto and req.batch_weights:
        raise LaunchError("--batch-weights is either auto or NODE=WEIGHT,...")
    if not (req.batch_weights or req.batch_weights_auto):
        return
    if not isinstance(per_gpu, int) or per_gpu < 1:
        raise LaunchError("--batch-weights needs --batch-per-gpu (or training.batch_size_per_gpu in cluster.yaml)")
    unknown = sorted(set(req.batch_weights) - set(Node.objects.values_list("name", flat=True)))
    if unknown:
        raise LaunchError(f"batch weight for {unknown[0]!r}: no such node")
    if any(not math.isfinite(w) or w <= 0 for w in req.batch_weights.values()):
        raise LaunchError("batch weights must be positive numbers")


def _check_time_limit(req: LaunchRequest, cs: ClusterSettings) -> int | None:
    if req.time_limit_s is None:
        return None
    if req.time_limit_s < 1:
        raise LaunchError("--time-limit must be at least 1s")
    if req.time_limit_s > cs.max_time_limit_s:
        raise LaunchError(f"--time-limit may be at most {cs.max_time_limit_s // 3600}h on this cluster")
    return req.time_limit_s


def _check_queue_quota(req: LaunchRequest, cs: ClusterSettings) -> None:
    if not cs.quota_max_queued:
        return
    owner_id = getattr(req.owner, "pk", None)
    waiting = Job.objects.filter(state=Job.State.QUEUED, owner_id=owner_id).count()
    if waiting >= cs.quota_max_queued:
        who = getattr(req.owner, "username", None) or "system"
        raise LaunchError(f"{who} already has {waiting} queued jobs (quota {cs.quota_max_queued}); "
                          "wait for some to start or cancel one")  # fmt: skip


def dry_run(req: LaunchRequest) -> list[str]:
    """What launching the request would run, rank by rank, without creating or starting anything:
    the exact argv (shell-quoted for reading) and environment of each rank; raises LaunchError."""
    job, pattern, files = build_job(req)
    snap = Snapshot()
    job.pk, job.created_at = -1, snap.now_dt
    after, job.after = job.after, None  # placed as if what it waits for had succeeded
    decision = next(d for d in snap.plan(extra=[job]) if d.job == -1)
    if not decision.placement:
        raise LaunchError(f"this job could not be placed: {decision.detail}")
    chosen = sorted(
        ((snap.node_rows[node_id], gpus) for node_id, gpus in decision.placement), key=lambda ng: ng[0].placement_key()
    )
    job.tag = f"{job.name}-{uuid.uuid4().hex[:8]}"
    cs = ClusterSettings.load()
    job.rdzv_endpoint = f"{chosen[0][0].address}:{rendezvous_port(cs, ranks_gpus=chosen[0][1])}"
    ranks = [
        Rank(job=job, node=node, index=i, gpu_indices=gpus or list(range(node.gpu_count)))
        for i, (node, gpus) in enumerate(chosen)
    ]
    assign_batches(job, ranks)
    out = [f"dry run of job {job.name}: nothing was created or started"]
    if after is not None:
        out.append(f"  (it starts only after job {after.name} succeeds; placed here as if it had)")
    if not decision.start:
        out.append(f"  (it would wait: {decision.reason}, {decision.detail}; these GPUs are its estimate)")
    for rank in ranks:
        gpus = f", GPUs {','.join(map(str, rank.gpu_indices))}" if rank.gpu_indices else ""
        where = sync.start_dir(job, rank.node)
        out.append(f"rank {rank.index} on {rank.node.name} ({rank.node.address}{gpus}), in {where}:")
        out.append("  " + shlex.join(rank_command(job, rank, len(ranks), job.rdzv_endpoint)))
        env = rank_env(job, rank)
        env["UGRO_JOB_ID"] = "<id>"  # given when the job is queued
        out.append("  environment: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())))
    out.append(f"--rdzv-id and UGRO_JOB are new for every attempt ({job.tag} here).")
    if pattern:
        out.append(f"metrics pattern: {pattern}")
    for path in files:
        out.append(f"metrics file: {path}")
    return out


def rendezvous_port(cs: ClusterSettings, ranks_gpus: list[int]) -> int:
    """The rendezvous port of a job whose rank 0 holds these GPUs of its node: the cluster's port plus
    the first of them. Jobs sharing a node hold different GPUs (the database sees to it), so their
    rendezvous stores never meet on one port."""
    return cs.rendezvous_port + (min(ranks_gpus) if ranks_gpus else 0)


def rank_command(job: Job, rank: Rank, nnodes: int, rdzv_endpoint: str) -> list[str]:
    """The argv that starts torchrun for this rank (never joined into a shell string).

    The script item is the very path pre-flight checked (script_path); the node agent expands its
    `~` and makes it absolute the same way its `stat` did, so what was checked is what runs.
    """
    argv, _ = rank_command_and_script_index(job, rank, nnodes, rdzv_endpoint)
    return argv


def rank_command_and_script_index(
    job: Job, rank: Rank, nnodes: int, rdzv_endpoint: str, base: str | None = None
) -> tuple[list[str], int]:
    """The rank's torchrun argv and the index of the script in it; base: where its ranks start on the node
    (sync.start_dir, read when not given)."""
    node = rank.node
    nproc = job.nproc_per_node or len(rank.gpu_indices) or 1
    join_timeout = settings.UGRO["JOIN_TIMEOUT_S"]
    prefix = [
        *node.torchrun_argv,
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={job.tag}",
        f"--rdzv-conf=join_timeout={join_timeout}",
        f"--local-addr={node.address}",
        "--max-restarts=0",
    ]
    args = _with_places(_with_local_batch(job.script_args, getattr(rank, "local_batch", None)), job, node)
    # the batch and resume arguments after the user's: argparse keeps the last value
    extra = [*checkpoints.batch_args(job), *checkpoints.resume_args(job)]
    base = sync.start_dir(job, node) if base is None else base
    return [*prefix, script_path(node, job.script, base), *args, *extra], len(prefix)


def _with_local_batch(args: list[str], local_batch: int | None) -> list[str]:
    """The script's arguments with {local_batch} filled in (left as written when the job has none)."""
    if local_batch is None:
        return list(args)
    return [a.replace("{local_batch}", str(local_batch)) for a in args]


def job_dir_on(job: Job, node) -> str:
    """The job's own directory on a node (UGRO_JOB_DIR, {job_dir} in its arguments): <workdir>/outputs/<job>,
    the same for every attempt, where UGRO looks for its checkpoints first."""
    return checkpoints.output_dir(job, node)


def _with_places(args: list[str], job: Job, node) -> list[str]:
    """{job} and {job_dir} filled in every argument, those after `--` too (a script opts into the convention
    with e.g. `-- --output_dir {job_dir}`)."""
    job_dir = job_dir_on(job, node)
    return [a.replace("{job_dir}", job_dir).replace("{job}", job.name) for a in args]


def rank_env(job: Job, rank: Rank) -> dict[str, str]:
    env = {str(k): str(v) for k, v in (rank.node.env or {}).items()}
    env.update({
        "UGRO_JOB": job.tag,  # every process of the job carries this: cancel finds them by it
        "UGRO_NODE": rank.node.name,
        "UGRO_JOB_NAME": job.name,
        "UGRO_JOB_ID": str(job.pk),
        "UGRO_NODE_RANK": str(rank.index),
        "UGRO_JOB_DIR": job_dir_on(job, rank.node),
        "PYTHONUNBUFFERED": "1",
        # torchrun writes the failing worker's error (exit code, traceback) here, as it documents
        "TORCHELASTIC_ERROR_FILE": rank.remote_error,
    })  # fmt: skip
    if rank.batch_weight is not None and getattr(rank, "local_batch", None):  # an uneven split
        env["UGRO_LOCAL_BATCH"] = str(rank.local_batch)
        env["UGRO_BATCH_WEIGHT"] = f"{rank.batch_weight:.6g}"
    # the interface pre-flight chose for a multi-node job (jobs/network.py), unless the node's env names one
    env.update(network.socket_env(rank.node, getattr(rank.node, "socket_choice", None)))
    if rank.gpu_indices:  # the GPUs it holds, and no other (a node without GPUs keeps its own setting)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in rank.gpu_indices)
    return env


def write_job_config(job: Job, ranks: list[Rank]) -> None:
    job.logs_dir.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "job": job.name,
        "id": job.pk,
        "tag": job.tag,
        "script": job.script,
        "script_args": job.script_args,
        "params": job.params,
        "rdzv_endpoint": job.rdzv_endpoint,
        "attempt": job.attempt,
        "resume_from": job.resume_path or None,
        "created_at": job.created_at.isoformat(),
        "started_at": job.started_at.isoformat() if job.started_at else None,
        "ranks": [
            {
                "index": r.index,
                "node": r.node.name,
                "address": r.node.address,
                "command": rank_command(job, r, len(ranks), job.rdzv_endpoint),
                "remote_log": r.remote_log,
            }
            for r in ranks
        ],
    }
    tmp = job.job_dir / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2))
    tmp.replace(job.job_dir / "config.json")


def launch(job: Job) -> Job:
    """Start every rank of a STARTING job concurrently; the job ends RUNNING, FAILING or FAILED.

    Nothing started (unreachable node, pre-flight): FAILED at once, nodes freed. A rank that did not
    start, or a start past the sync window: FAILING, and the teardown stops whatever did start.
    Cancelled meanwhile: nothing more is started, and the teardown waits for this launch to let go of the
    job (locks.LAUNCH), so that what it did start is there to be stopped.
    """
    with locks.held(locks.LAUNCH, job.pk, wait=True):
        return _launch(job)


def _still_starting(job: Job) -> bool:
    """Whether the job is still STARTING (not cancelled or timed out since it was claimed)."""
    return Job.objects.filter(pk=job.pk, state=Job.State.STARTING).exists()


def _prepare(job: Job, ranks: list[Rank]) -> dict[int, str] | None:
    """Each node made ready before its rank starts, in order: the job's code, its --data, its environment
    (--packages), pre-flight, a checkpoint a resume needs. The ranks' start directories by node; None when a step
    failed (the job then failed as PREFLIGHT, nothing started)."""
    if sync.job_sync_digest(job):
        try:  # every node gets the job's code before anything else runs there
            pushed = sync.push(job, [r.node for r in ranks])
        except ValueError as exc:
            lifecycle.fail_unstarted(job, FailureKind.PREFLIGHT, f"{exc}. Nothing was started.")
            return None
        log.info("job %s: code synced to %d nodes in %.2fs (%d bytes sent)", job.name, pushed.nodes,
                 pushed.seconds, pushed.sent_bytes)  # fmt: skip
    try:  # and its data (--data), node to node, before pre-flight
        delivered = data.deliver(job, [r.node for r in ranks])
    except ValueError as exc:
        lifecycle.fail_unstarted(job, FailureKind.PREFLIGHT, f"{exc}. Nothing was started.")
        return None
    if delivered is not None and any(n["bytes"] for n in delivered.nodes.values()):
        cache.trim([r.node for r in ranks])  # stores that grew, back under their limits (never this job's data)
    if delivered is not None:
        log.info("job %s: data on %d nodes in %.2fs (%d bytes from the controller, %d node to node)", job.name,
                 len(ranks), delivered.seconds, delivered.controller_bytes, delivered.peer_bytes)  # fmt: skip
    try:  # and its environment (--packages), built where it is not there yet; the ranks start with its torchrun
        built = environments.prepare(job, [r.node for r in ranks])
    except ValueError as exc:
        lifecycle.fail_unstarted(job, FailureKind.PREFLIGHT, f"{exc}. Nothing was started.")
        return None
    if built is not None:
        for r in ranks:  # this launch's nodes only (never saved): pre-flight checks that torchrun, the ranks run it
            r.node.torchrun_command, r.node.torchrun_auto = f"{built[r.node.pk]}/bin/torchrun", ""
    bases = {r.node_id: sync.start_dir(job, r.node) for r in ranks}
    problems = run_preflight(job, ranks, bases)
    if not problems:  # a multi-node job's interfaces chosen and reached, its network measured (or a recent one reused)
        problems = network.for_launch(job, ranks)
    if problems:
        lifecycle.fail_unstarted(
            job, FailureKind.PREFLIGHT, "pre-flight failed: " + "; ".join(problems) + ". Nothing was started."
        )
        return None
    ckpt = job.resume_checkpoint
    if ckpt is not None:
        try:  # on every node of this attempt (the HF Trainer reads it on every rank)
            checkpoints.ensure_on(ckpt, [r.node for r in ranks])
        except ValueError as exc:
            lifecycle.fail_unstarted(job, FailureKind.PREFLIGHT, f"{exc}. Nothing was started.")
            return None
    return bases


def _probe_scaling(job: Job, ranks: list[Rank], bases: dict[int, str]) -> tuple[list[Rank], dict] | None:
    """With --scale-probe, the job's first steps on 1..N of its nodes (jobs/scale_probe.py): the ranks it then runs
    on (the first K; the others freed) and the batch weights measured for --batch-weights auto ({}: none).
    The ranks as they are without a probe, or when it cannot run (its one line is recorded); None when the job
    left STARTING meanwhile."""
    params = job.params or {}
    seconds = params.get("scale_probe_s")
    if not seconds:
        return ranks, {}
    if len(ranks) < 2:
        scale_probe.skipped(job, "scale probe did not run: the job has one node; runs as asked")
        return ranks, {}
    per_gpu = params.get("batch_per_gpu")

    def build(rank: Rank, count: int, rdzv_id: str, scratch: str) -> scale_probe.ProbeStart:
        rank.local_batch, rank.batch_weight = per_gpu, None  # the probe runs the even split
        argv, index = rank_command_and_script_index(job, rank, count, job.rdzv_endpoint, bases[rank.node_id])
        real_dir = job_dir_on(job, rank.node)
        argv = [f"--rdzv-id={rdzv_id}" if a == f"--rdzv-id={job.tag}" else a for a in argv[:index]] + [
            a.replace(real_dir, scratch) for a in argv[index:]
        ]  # its outputs go to a scratch directory, never the job's
        env = {**rank_env(job, rank), "UGRO_JOB_DIR": scratch, "UGRO_SCALE_PROBE": str(count)}
        workers = job.nproc_per_node or len(rank.gpu_indices) or 1
        return scale_probe.ProbeStart(argv, index, env, bases[rank.node_id], workers, per_gpu)

    probe = scale_probe.run_probe(job, ranks, seconds, build, forced=bool(job.nodes_asked),
                                  floor=job.min_nodes or 1)  # fmt: skip
    if probe is None:
        return None
    kept = ranks[: probe["chosen"]]
    if len(kept) < len(ranks) and not lifecycle.shrink_starting(job, kept):
        return None
    weights = {}
    if params.get("batch_weights") == "auto" and per_gpu:
        weights = scale_probe.weights_from(probe["rows"], [r.node.name for r in kept])
        if weights:
            probe["weights"] = weights
            scale_probe.record(job, probe)
    return kept, weights


def _launch(job: Job) -> Job:
    ranks = list(job.ranks.select_related("node", "job").order_by("index"))
    assign_batches(job, ranks)
    Rank.objects.bulk_update(ranks, ["batch_weight"])
    window = job.sync_window_s
    cs = ClusterSettings.load()
    job.current.rdzv_endpoint = f"{ranks[0].node.address}:{rendezvous_port(cs, ranks[0].gpu_indices)}"
    job.current.launcher = follower_id()
    job.current.save(update_fields=["rdzv_endpoint", "launcher"])
    write_job_config(job, ranks)

    # Connect (or reuse warm links) to every node at once; an unreachable node fails fast.
    reached = on_each(ranks, lambda r: node_request(r.node, "hello", timeout=links.CONNECT_TIMEOUT_S))
    down = [f"node {r.node.name}: {err}" for r, _, err in reached if err]
    refused = refuse_missing_pythons(job, [(r.node, err) for r, _, err in reached if err])
    if refused:  # nodes that answer nothing because their python is not there: to set up, not lost
        lifecycle.fail_unstarted(job, FailureKind.PREFLIGHT, "pre-flight failed: " + "; ".join(refused) + ". "
                                 "Nothing was started.")  # fmt: skip
        return job
    if down:
        first = next(r.node.name for r, _, err in reached if err)
        lifecycle.fail_unstarted(
            job, FailureKind.NODE_LOST, "cannot reach " + "; ".join(down) + ". Nothing was started.", node=first
        )
        return job
    boot_ids = {r.pk: (hello or {}).get("boot_id") or "" for r, hello, _ in reached}

    if not _still_starting(job):
        return job
    with lifecycle.StillStarting(job):  # minutes for tens of GB, or a CUDA torch to build: the launch lives
        bases = _prepare(job, ranks)
        placed = _probe_scaling(job, ranks, bases) if bases is not None else None
    if bases is None or placed is None:
        return job
    if placed[0] is not ranks or placed[1]:
        ranks = placed[0]
        assign_batches(job, ranks, placed[1])
        Rank.objects.bulk_update(ranks, ["batch_weight"])
        write_job_config(job, ranks)
    # Every rank's command and environment built here, not in the start threads: the database reads they need
    # (the job's code, its checkpoint) would open a connection per thread (16 nodes: 16 connections at once).
    commands = {r.pk: rank_command_and_script_index(job, r, len(ranks), job.rdzv_endpoint, bases[r.node_id])
                for r in ranks}  # fmt: skip
    envs = {r.pk: rank_env(job, r) for r in ranks}
    if not _still_starting(job):  # stopped meanwhile: its teardown waits for this launch, and finds nothing
        return job
    t0 = time.monotonic()  # the sync window is for starting ranks; checks before it do not count

    def start(rank: Rank) -> float:
        left = max(1.0, window - (time.monotonic() - t0))
        argv, script_index = commands[rank.pk]
        result = node_request(
            rank.node, "start", timeout=left, argv=argv, script_index=script_index,
            env=envs[rank.pk], cwd=bases[rank.node_id], log=rank.remote_log, exit_file=rank.remote_exit,
            key=rank.start_key, record=rank.start_record, mkdirs=[job_dir_on(job, rank.node)],
        )  # fmt: skip
        rank.pid = result["pid"]
        return time.monotonic()

    started = on_each(ranks, start)
    ok_times = [t for _, t, err in started if err is None]
    spread = (max(ok_times) - min(ok_times)) if ok_times else None
    up = [lifecycle.Started(r, r.pid, boot_ids.get(r.pk, "")) for r, _, err in started if err is None]
    errors = [(r, err) for r, _, err in started if err]
    elapsed = time.monotonic() - t0
    if not errors and elapsed <= window:
        if not lifecycle.ranks_started(job, up, spread):
            # Cancelled or timed out meanwhile: whoever moved it stops the job; make sure of it here too.
            stop_processes(job, ranks)
        return job
    lifecycle.ranks_started_partly(job, up, spread)
    if errors:
        r, err = errors[0]
        failure = Failure(kind=FailureKind.UNKNOWN, rank=r.index, node=r.node.name, exit_code=None, signal=None,
                          line=f"rank {r.index} on {r.node.name} did not start: {err}")  # fmt: skip
    else:
        failure = Failure(kind=FailureKind.TIMEOUT, rank=None, node=None, exit_code=None, signal=None,
                          line=f"ranks took {elapsed:.1f}s to start (sync window {window:g}s)")  # fmt: skip
    lifecycle.fail(job, failure)
    return job


@dataclass
class PreflightRun:
    """The pre-flight checks run on demand (the `preflight` command and its API endpoint)."""

    nodes: list[Node]
    rendezvous: str
    report: PreflightReport


def preflight_nodes(names: list[str], script: str = "") -> PreflightRun:
    """Run the launch's pre-flight checks on the named (default: every enabled) nodes, rank 0 (the
    rendezvous host) a master when there is one, as at launch. LaunchError in one line for an unknown
    node, no node or a bad script."""
    cs = ClusterSettings.load()
    try:
        chosen = named_nodes(names)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if not chosen:
        raise LaunchError("no enabled nodes; import cluster.yaml or add nodes in admin")
    host = chosen[0].address
    report = check_nodes(chosen, check_script(script or cs.default_script), host, cs.rendezvous_port)
    return PreflightRun(chosen, f"{host}:{cs.rendezvous_port}", report)
