"""Jobs and their ranks: the record of what ran where, and how it ended."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from cluster.models import Node
from cluster.names import validate_safe_name

DEFAULT_RESUME_TEMPLATE = "--resume-from {checkpoint}"


def _of_current(field: str) -> property:
    def get(job: Job):
        current = job.current
        if current is not None:
            return getattr(current, field)
        first = job.__dict__.get("_first_attempt", {})
        return first[field] if field in first else Attempt._meta.get_field(field).get_default()

    def put(job: Job, value) -> None:
        if not job._state.adding:
            raise AttributeError(f"{field} belongs to the job's current attempt: write job.current.{field}")
        job.__dict__.setdefault("_first_attempt", {})[field] = value

    return property(get, put, doc=f"The current attempt's {field}.")


class JobManager(models.Manager):
    def bulk_create(self, objs, *args, **kwargs):
        """Jobs made in bulk get their first attempts in bulk too (every job has a current attempt)."""
        with transaction.atomic(using=self.db):
            jobs = super().bulk_create(objs, *args, **kwargs)
            firsts = Attempt.objects.using(self.db).bulk_create(
                Attempt(job=job, **job.first_attempt_fields()) for job in jobs
            )
            for job, first in zip(jobs, firsts, strict=True):
                job.current = first
            super().bulk_update(jobs, ["current"])
        return jobs


class Job(models.Model):
    """One distributed training run: what to run (this row) and its attempts (Attempt rows: a resume or
    retry adds one; `current` is the one that runs now). Only jobs/lifecycle.py changes `state` and writes
    an attempt (docs/lifecycle.md):

    QUEUED -> STARTING -> RUNNING -> SUCCEEDED; STARTING | RUNNING -> FAILING -> FAILED;
    QUEUED -> CANCELLED; STARTING | RUNNING -> CANCELLING -> CANCELLED;
    FAILED | CANCELLED -> QUEUED as the next attempt (resume, retry: docs/recovery.md).
    FAILING and CANCELLING hold the nodes while the job's processes are stopped; the final states
    release every node in the same transaction that sets them.
    """

    class State(models.TextChoices):
        QUEUED = "queued", "queued"
        STARTING = "starting", "starting"
        RUNNING = "running", "running"
        CANCELLING = "cancelling", "cancelling"
        FAILING = "failing", "failing"
        SUCCEEDED = "succeeded", "succeeded"
        FAILED = "failed", "failed"
        CANCELLED = "cancelled", "cancelled"

    LIVE_STATES = (State.STARTING, State.RUNNING)
    STOPPING_STATES = (State.CANCELLING, State.FAILING)
    ENDED_STATES = (State.SUCCEEDED, State.FAILED, State.CANCELLED)
    # a job in these states needs what is placed for it on its nodes (its code, data, environment: never trimmed)
    NEEDING_STATES = (State.QUEUED, State.STARTING, State.RUNNING, State.CANCELLING, State.FAILING)

    name = models.CharField(max_length=64, unique=True, validators=[validate_safe_name])
    state = models.CharField(max_length=10, choices=State.choices, default=State.QUEUED, db_index=True)
    priority = models.IntegerField(default=0, help_text="Higher starts first; equal priorities start in order.")
    script = models.CharField(max_length=500)
    script_args = models.JSONField(default=list, help_text="The script's arguments, exactly as passed (argv).")
    params = models.JSONField(default=dict, help_text="What the user asked for: model, dataset, epochs, lr, extra.")
    requested_nodes = models.JSONField(default=list, blank=True, help_text="Node names asked for, if any.")
    requested_count = models.PositiveIntegerField(null=True, blank=True, help_text="A node count asked for.")
    nproc_per_node = models.PositiveIntegerField(
        null=True, blank=True, help_text="Blank: the GPUs the job holds on each node (1 on a node without GPUs)."
    )
    gpus = models.PositiveIntegerField(null=True, blank=True, help_text="GPUs in all, on any nodes (--gpus N).")
    gpus_per_node = models.PositiveIntegerField(
        null=True, blank=True, help_text="GPUs on each of its nodes; blank with a node count: whole nodes."
    )
    time_limit_s = models.PositiveIntegerField(
        null=True, blank=True, help_text="Stopped (TIMEOUT) this long after it started; blank: the cluster default."
    )
    min_vram_mb = models.PositiveIntegerField(null=True, blank=True, help_text="Each of its GPUs needs this much.")
    vram_source = models.CharField(max_length=200, blank=True, help_text="Where min_vram_mb came from.")
    sweep = models.ForeignKey("Sweep", null=True, blank=True, on_delete=models.CASCADE, related_name="trials")
    sweep_params = models.JSONField(default=dict, blank=True, help_text="This trial's values of the sweep's params.")
    after = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
        help_text="Starts only after this job succeeded (--after).",
    )  # fmt: skip
    sync_window_s = models.FloatField(default=30.0)
    state_changed_at = models.DateTimeField(null=True, blank=True, help_text="When the job entered its state.")
    created_at = models.DateTimeField(default=timezone.now)
    metrics_bytes = models.BigIntegerField(default=0, help_text="Committed size of metrics.jsonl.")
    resumed_from = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # Recovery (docs/recovery.md): how this job resumes.
    resume_template = models.CharField(
        max_length=500, default=DEFAULT_RESUME_TEMPLATE,
        help_text="The script's resume argument; {checkpoint} is the checkpoint's path on rank 0's node.",
    )  # fmt: skip
    checkpoint_glob = models.CharField(
        max_length=500, blank=True, help_text="Extra checkpoint paths to record, a glob relative to the workdir."
    )
    retry_on = models.JSONField(default=list, blank=True, help_text="Failure kinds that resume automatically.")
    max_attempts = models.PositiveIntegerField(null=True, blank=True, help_text="Blank: the cluster default.")
    min_nodes = models.PositiveIntegerField(null=True, blank=True, help_text="Fewest nodes a retry may run on.")
    batch_template = models.CharField(
        max_length=500, blank=True, help_text="e.g. --batch-size {batch} --grad-accum {accum}: an OOM retry halves "
        "batch and doubles accum.",
    )  # fmt: skip
    batch = models.JSONField(default=dict, blank=True, help_text='{"batch": B, "accum": A} for batch_template.')
    hang_after_s = models.FloatField(null=True, blank=True, help_text="Silence that makes it HUNG; blank: default.")
    keep = models.CharField(
        max_length=200, blank=True,
        help_text="Checkpoint retention: LATEST[,best:METRIC:K] (blank: the cluster default, else keep all).",
    )  # fmt: skip
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="jobs",
        help_text="Who launched it (blank: launched before jobs had owners, or by the system).",
    )
    current = models.OneToOneField(
        "Attempt", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
        help_text="The attempt that runs now, or ran last (made with the job; a resume or retry makes the next).",
    )  # fmt: skip

    objects = JobManager()

    # The current attempt's fields, read through the job (job.tag is job.current.tag). Written only on the
    # attempt (jobs/lifecycle.py), except as keywords of a new Job: its first attempt is made with them.
    tag = _of_current("tag")
    rdzv_endpoint = _of_current("rdzv_endpoint")
    launch_spread_s = _of_current("launch_spread_s")
    launcher = _of_current("launcher")
    follower = _of_current("follower")
    follower_until = _of_current("follower_until")
    held_gpus = _of_current("held_gpus")
    started_at = _of_current("started_at")
    running_at = _of_current("running_at")
    finished_at = _of_current("finished_at")
    failure_kind = _of_current("failure_kind")
    failure_reason = _of_current("failure_reason")
    failure_rank = _of_current("failure_rank")
    failure_node = _of_current("failure_node")
    failure_exit_code = _of_current("failure_exit_code")
    failure_signal = _of_current("failure_signal")
    failure_line = _of_current("failure_line")
    resume_checkpoint = _of_current("resume_checkpoint")
    resume_path = _of_current("resume_path")
    resume_step = _of_current("from_step")
    retry_at = _of_current("retry_at")
    wait_nodes = _of_current("wait_nodes")
    recovery_note = _of_current("recovery_note")
    attempt = _of_current("number")

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name

    def save(self, *args, **kwargs) -> None:
        """A new job is saved with its first attempt (made from the attempt keywords it was given)."""
        if not self._state.adding or self.current_id is not None:
            super().save(*args, **kwargs)
            return
        first = self.first_attempt_fields()
        with transaction.atomic(using=kwargs.get("using")):
            super().save(*args, **kwargs)
            db = self._state.db
            self.current = Attempt.objects.using(db).create(job=self, **first)
            Job.objects.using(db).filter(pk=self.pk).update(current=self.current)

    def first_attempt_fields(self) -> dict:
        """Attempt 1 of a new job: on what the job asked, with the attempt keywords the job was made with."""
        asked = {"requested_nodes": list(self.requested_nodes or []), "requested_count": self.requested_count,
                 "batch": dict(self.batch or {})}  # fmt: skip
        return {"number": 1, **asked, **self.__dict__.pop("_first_attempt", {})}

    @property
    def nodes_asked(self) -> list[str]:
        """The node names its current attempt asks for (the job's request, or what a retry chose)."""
        return list((self.current or self).requested_nodes or [])

    @property
    def count_asked(self) -> int | None:
        """The node count its current attempt asks for."""
        return (self.current or self).requested_count

    @property
    def ranks(self):
        """The current attempt's ranks (every attempt keeps its own: Attempt.ranks, Rank.job's all_ranks)."""
        if self.current_id is None:
            return Rank.objects.none()
        return self.current.ranks

    @property
    def earlier_attempts(self):
        return self.attempts.exclude(pk=self.current_id).order_by("number")

    @property
    def is_live(self) -> bool:
        return self.state in self.LIVE_STATES

    @property
    def is_stopping(self) -> bool:
        return self.state in self.STOPPING_STATES

    @property
    def is_ended(self) -> bool:
        return self.state in self.ENDED_STATES

    @property
    def job_dir(self) -> Path:
        return Path(settings.JOBS_DIR) / self.name

    @property
    def logs_dir(self) -> Path:
        return self.job_dir / "logs"

    def duration(self) -> float | None:
        if not self.started_at:
            return None
        end = self.finished_at or timezone.now()
        return (end - self.started_at).total_seconds()


class Rank(models.Model):
    """One node's part of a job: its torchrun process, log, offset followed and exit code."""

    class State(models.TextChoices):
        PENDING = "pending", "pending"
        RUNNING = "running", "running"
        EXITED = "exited", "exited"
        LOST = "lost", "lost"

    attempt = models.ForeignKey("Attempt", on_delete=models.CASCADE, related_name="ranks")
    job = models.ForeignKey(
        Job, on_delete=models.CASCADE, related_name="all_ranks", help_text="Its attempt's job (every attempt's ranks)."
    )
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="ranks")
    index = models.PositiveIntegerField(help_text="Node rank within the job (0 hosts the rendezvous).")
    state = models.CharField(max_length=10, choices=State.choices, default=State.PENDING)
    active = models.BooleanField(default=True, help_text="Part of a job that holds its GPUs; cleared when it ends.")
    gpu_indices = models.JSONField(
        default=list, blank=True, help_text="The node's GPUs this rank uses (CUDA_VISIBLE_DEVICES); empty: none."
    )
    batch_weight = models.FloatField(null=True, blank=True, help_text="Share of the global batch per local GPU.")
    pid = models.IntegerField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    remote_log = models.CharField(max_length=1000, blank=True)
    remote_exit = models.CharField(max_length=1000, blank=True)
    remote_error = models.CharField(max_length=1000, blank=True, help_text="torchrun's TORCHELASTIC_ERROR_FILE.")
    start_record = models.CharField(max_length=1000, blank=True, help_text="The agent's record of the start.")
    boot_id = models.CharField(max_length=64, blank=True, help_text="The node's boot id when the rank started.")
    lost_reason = models.TextField(blank=True)
    drained = models.BooleanField(default=False, help_text="All of the rank's output was copied.")
    log_offset = models.BigIntegerField(default=0, help_text="Bytes of the node's log already copied.")
    log_lines = models.BigIntegerField(default=0)
    last_contact = models.DateTimeField(null=True, blank=True)
    metric_step = models.BigIntegerField(
        null=True, blank=True,
        help_text="Step of the rank's last metric point: a new follower's inferred steps go on from it.",
    )  # fmt: skip

    class Meta:
        ordering = ["attempt", "index"]
        constraints = [
            models.UniqueConstraint(fields=["attempt", "index"], name="rank_index_unique"),
            models.UniqueConstraint(fields=["attempt", "node"], name="rank_node_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.job.name} rank {self.index} on {self.node.name}"

    def save(self, *args, **kwargs) -> None:
        """A rank given only its job belongs to the job's current attempt; one given its attempt, to its job."""
        if self.attempt_id is None and self.job_id is not None:
            db = kwargs.get("using") or self._state.db
            self.attempt_id = Job.objects.using(db).values_list("current", flat=True).get(pk=self.job_id)
        elif self.job_id is None and self.attempt_id is not None:
            self.job_id = self.attempt.job_id
        super().save(*args, **kwargs)

    def in_other_jobs_dir(self, path: str) -> bool:
        """Whether a path on this rank's node lies in another job's own directory, <workdir>/outputs/<that
        job>/: that job's files (discovery leaves them to it)."""
        base = f"{self.node.workdir.rstrip('/')}/outputs/"
        if not path.startswith(base):
            return False
        owner = path[len(base) :].split("/", 1)[0]
        return owner != self.job.name and Job.objects.filter(name=owner).exists()

    @property
    def local_log(self) -> Path:
        """Its central copy: in the job's logs while its attempt is the current one, then where they moved
        (jobs/logs.py archive_logs)."""
        if self.attempt_id == self.job.current_id:
            return self.job.logs_dir / f"rank_{self.index}.log"
        moved = Path(self.attempt.logs_dir) if self.attempt.logs_dir else None
        return (moved or self.job.logs_dir / f"attempt_{self.attempt.number}") / f"rank_{self.index}.log"

    @property
    def start_key(self) -> str:
        """The idempotency key of this rank's start: a retried start never starts a second torchrun."""
        return f"{self.attempt.tag}:{self.index}:{self.attempt.number}"

    def exit_text(self) -> str:
        if self.exit_code is None:
            return "-"
        if self.exit_code < 0:
            return f"killed by signal {-self.exit_code}"
        return str(self.exit_code)


class Allocation(models.Model):
    """A job's hold on one GPU of a node (gpu_index -1: the whole of a node without GPUs).

    One GPU, one job: the database refuses a second active allocation of the same GPU (and of the
    same GPU-less node), whoever writes it. Only jobs/lifecycle.py creates and releases a job's; a
    service replica's (no job, its `holder` named) only serving/placement.py.
    """

    WHOLE_NODE = -1

    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.CASCADE, related_name="allocations")
    holder = models.CharField(max_length=120, blank=True, help_text="What holds it when no job does (serve:NAME/i).")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="allocations")
    gpu_index = models.IntegerField(help_text="The GPU's device index on the node; -1: the whole GPU-less node.")
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["node", "gpu_index"]
        constraints = [
            models.UniqueConstraint(
                fields=["node", "gpu_index"], condition=models.Q(active=True), name="one_active_allocation_per_gpu"
            ),
            models.CheckConstraint(condition=models.Q(gpu_index__gte=-1), name="allocation_gpu_index_valid"),
            models.CheckConstraint(
                condition=models.Q(job__isnull=False) | ~models.Q(holder=""), name="allocation_has_holder"
            ),
        ]

    def __str__(self) -> str:
        where = "whole node" if self.gpu_index == self.WHOLE_NODE else f"GPU {self.gpu_index}"
        return f"{self.job.name if self.job_id else self.holder} on {self.node.name} {where}"


class Sweep(models.Model):
    """A hyperparameter search: one queued child job per trial, at most max_concurrent running."""

    name = models.CharField(max_length=48, unique=True, validators=[validate_safe_name])
    script = models.CharField(max_length=500)
    spec = models.JSONField(default=dict, help_text="grid / random parameter definitions, trials, seed.")
    base = models.JSONField(default=dict, help_text="The launch request each trial starts from.")
    max_concurrent = models.PositiveIntegerField(null=True, blank=True, help_text="Blank: no limit.")
    metric = models.CharField(max_length=100, default="loss")
    mode = models.CharField(max_length=3, choices=[("min", "min"), ("max", "max")], default="min")
    median_stop = models.BooleanField(
        default=False, help_text="Stop a running trial whose best metric is worse than the median of the others' "
        "at the same step (median stopping rule)."
    )  # fmt: skip
    median_min_steps = models.PositiveIntegerField(default=10, help_text="No trial is stopped before this step.")
    cancelled_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="sweeps"
    )

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name


class Checkpoint(models.Model):
    """A checkpoint a rank wrote on its node, as the follower recorded it (pages never ask nodes).

    A file (`checkpoint_step<N>.pt`, anything a job's glob matches) or a Hugging Face
    `checkpoint-<N>/` directory. Only a `ready` one is ever offered for a resume: complete (a
    directory holds trainer_state.json) and the same size in two listings (or its writer has ended).
    """

    class Kind(models.TextChoices):
        FILE = "file", "file"
        DIR = "dir", "directory"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="+")
    path = models.CharField(max_length=1000)
    size = models.BigIntegerField()
    mtime = models.FloatField(help_text="Modification time on the node (the node's clock).")
    recorded_at = models.DateTimeField(default=timezone.now)
    step = models.BigIntegerField(null=True, blank=True, help_text="From the name (checkpoint_step<N>, -<N>).")
    kind = models.CharField(max_length=4, choices=Kind.choices, default=Kind.FILE)
    ready = models.BooleanField(default=False, help_text="Complete and no longer changing: may be resumed from.")
    attempt = models.PositiveIntegerField(default=1, help_text="The attempt that was running when it appeared.")
    sha256 = models.CharField(max_length=64, blank=True, help_text="Set when it was copied to another node.")
    removed_at = models.DateTimeField(null=True, blank=True, help_text="When retention deleted it on every node.")
    keep_reason = models.CharField(max_length=200, blank=True, help_text="Why retention kept (or freed) it.")

    class Meta:
        ordering = ["job", "path"]
        constraints = [models.UniqueConstraint(fields=["job", "node", "path"], name="checkpoint_unique")]

    def __str__(self) -> str:
        return f"{self.node.name}:{self.path}"


class Attempt(models.Model):
    """One try of a job: where and when it ran, who follows it, how it failed, what it started from.

    Made with the job (attempt 1) and by each resume or retry (attempt N+1, lifecycle.requeue), never reset;
    the job's `current` is the newest. Its ranks are its own (Rank.attempt), so an earlier attempt's tag,
    nodes and processes stay readable after the next one starts.
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField(default=1)
    state = models.CharField(max_length=10, blank=True, help_text="How it ended (blank while it is the current one).")
    tag = models.CharField(max_length=100, blank=True, help_text="Unique per attempt; marks every process.")
    rdzv_endpoint = models.CharField(max_length=300, blank=True)
    launch_spread_s = models.FloatField(null=True, blank=True, help_text="First to last rank start.")
    launcher = models.CharField(max_length=100, blank=True, help_text="The process that started the ranks.")
    follower = models.CharField(max_length=100, blank=True)
    follower_until = models.DateTimeField(null=True, blank=True)
    held_gpus = models.PositiveIntegerField(default=0, help_text="GPUs (or whole GPU-less nodes) it was given.")
    started_at = models.DateTimeField(null=True, blank=True)
    running_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    failure_kind = models.CharField(max_length=16, blank=True, db_index=True)
    failure_reason = models.TextField(blank=True, help_text="One line: kind, rank, exit code and the decisive line.")
    failure_rank = models.IntegerField(null=True, blank=True, help_text="The first failing rank (node rank).")
    failure_node = models.CharField(max_length=64, blank=True)
    failure_exit_code = models.IntegerField(null=True, blank=True, help_text="The script's own exit code.")
    failure_signal = models.IntegerField(null=True, blank=True)
    failure_line = models.TextField(blank=True, help_text="The decisive line of the failing rank's output.")
    resume_checkpoint = models.ForeignKey(
        "Checkpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
        help_text="The checkpoint it starts from (blank: from scratch).",
    )  # fmt: skip
    resume_path = models.CharField(max_length=1000, blank=True, help_text="That checkpoint's path as rank 0 reads it.")
    from_step = models.BigIntegerField(null=True, blank=True, help_text="The step it started from.")
    # where and how it may run: the job's request for attempt 1, what a retry chose for a later one (fewer nodes,
    # a halved batch after an OOM); the job's own fields keep what was asked
    requested_nodes = models.JSONField(default=list, blank=True, help_text="Node names it may run on, if named.")
    requested_count = models.PositiveIntegerField(null=True, blank=True, help_text="The node count it runs on.")
    batch = models.JSONField(default=dict, blank=True, help_text='{"batch": B, "accum": A} for batch_template.')
    retry_at = models.DateTimeField(null=True, blank=True, help_text="When the next automatic attempt starts.")
    wait_nodes = models.JSONField(
        default=list, blank=True, help_text="Lost nodes it waits for, queued: it starts only once they answer again "
        "(a node-lost retry without --min-nodes; docs/recovery.md).",
    )  # fmt: skip
    recovery_note = models.TextField(blank=True, help_text="What recovery did or proposes, one line.")
    last_step = models.BigIntegerField(null=True, blank=True, help_text="The last metric step it reached (ended).")
    logs_dir = models.CharField(max_length=1000, blank=True, help_text="Where its central logs were moved (ended).")
    next_reason = models.CharField(max_length=300, blank=True, help_text="Why the next attempt was made.")
    energy = models.JSONField(
        default=dict, blank=True, help_text="Its GPUs' and hosts' energy meters so far, folded from health samples "
        "(jobs/energy.py; docs/power.md).",
    )  # fmt: skip
    scale_probe = models.JSONField(
        default=dict, blank=True, help_text="Its scale probe (--scale-probe): each node count's samples/s, the count "
        "chosen and why, the batch weights measured (jobs/scale_probe.py).",
    )  # fmt: skip

    class Meta:
        ordering = ["job", "number"]
        constraints = [models.UniqueConstraint(fields=["job", "number"], name="attempt_unique")]

    def __str__(self) -> str:
        return f"{self.job.name} attempt {self.number}"

    @property
    def nodes(self) -> list[str]:
        """Its node names in rank order."""
        return [r.node.name for r in self.ranks.select_related("node").order_by("index")]


# An attempt's own fields, those the job has none of (not its job nor its number): what changes with a try and is
# written on the attempt's row (lifecycle._move)
ATTEMPT_FIELDS = (
    frozenset(f.name for f in Attempt._meta.concrete_fields)
    - {f.name for f in Job._meta.concrete_fields}
    - {"job", "number"}
)


class JobCode(models.Model):
    """What a job runs: the directory synced to its nodes (docs/sync.md), and per node the code and
    environment each attempt found there (the script's sha256, Python, torch, CUDA, NCCL, driver, GPU,
    installed packages). Written at launch and by each attempt's pre-flight; read by results, the job
    page, the API and compare."""

    job = models.OneToOneField(Job, on_delete=models.CASCADE, related_name="code")
    sync_source = models.CharField(max_length=1000, blank=True, help_text="The directory synced ('' none).")
    sync_digest = models.CharField(max_length=64, blank=True, help_text="sha256 of the snapshot's manifest.")
    sync_files = models.PositiveIntegerField(default=0)
    sync_bytes = models.BigIntegerField(default=0)
    sync_s = models.FloatField(null=True, blank=True, help_text="The last attempt's copy to every node.")
    sync_sent_bytes = models.BigIntegerField(default=0, help_text="What that copy sent (unchanged files: none).")
    allow_mismatch = models.BooleanField(default=False, help_text="Start even if the script differs by node.")
    git = models.JSONField(default=dict, help_text="commit, branch, dirty, diff of the code's repository.")
    nodes = models.JSONField(default=dict, help_text="node -> versions and hashes, from the latest attempt.")
    packages = models.JSONField(default=dict, help_text="node -> installed packages (name==version).")
    attempt = models.PositiveIntegerField(default=0, help_text="The attempt `nodes` describes.")
    data = models.JSONField(
        default=list, blank=True,
        help_text="--data items: [{src, dest, node, digest, files, bytes}] (docs/data.md), staged at launch.",
    )  # fmt: skip
    transfer = models.JSONField(
        default=dict, blank=True,
        help_text="The last attempt's data delivery: node -> {bytes, total, rate, state, from}, and its totals.",
    )  # fmt: skip
    envs = models.JSONField(
        default=dict, blank=True,
        help_text="--packages: the lock read at launch {file, format, sha256, pins} and the last attempt's environment "
        "on each node {key, path, python, platform, kept, packages: [name, version, wheel sha256]} (docs/envs.md).",
    )  # fmt: skip

    def __str__(self) -> str:
        return f"code of {self.job_id}"


class NetCheck(models.Model):
    """One measurement of the network between some nodes (jobs/network.py): the collective a job on them uses, at
    gradient sizes, for the group and each pair, with the interface each node used. Made by `ugro netcheck` and by a
    multi-node launch's pre-flight (reused while recent); read by the topology page and a job's advice."""

    time = models.DateTimeField(db_index=True)
    nodes = models.JSONField(default=list, help_text="The nodes' names in rank order (rank 0 hosted the store).")
    node_set = models.CharField(
        max_length=2000, db_index=True, help_text="The names sorted and joined by commas: what a reuse looks up."
    )
    backend = models.CharField(max_length=10, help_text="nccl (every node has a GPU) or gloo.")
    interfaces = models.JSONField(
        default=dict, help_text="node -> {interface, address, source}: where its traffic went and why that one."
    )
    group = models.JSONField(
        default=dict, blank=True, help_text="{latency_us, sizes: [{bytes, seconds, iters, algbw, busbw}]} (bytes/s)."
    )
    pairs = models.JSONField(default=list, blank=True, help_text="[{a, b (names), latency_us, sizes: [...]}].")
    ok = models.BooleanField(default=True)
    error = models.CharField(max_length=1000, blank=True, help_text="Why the measurement gave no figures.")
    seconds = models.FloatField(default=0, help_text="How long it took, node set-up included.")
    job = models.ForeignKey(
        Job, null=True, blank=True, on_delete=models.SET_NULL, related_name="netchecks",
        help_text="The job whose pre-flight measured it; none for `ugro netcheck`.",
    )  # fmt: skip

    class Meta:
        ordering = ["-time"]

    def __str__(self) -> str:
        return f"netcheck of {', '.join(self.nodes)} at {self.time:%Y-%m-%d %H:%M:%S}"
