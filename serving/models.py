"""Services: a trained checkpoint served by N replicas of an inference engine, behind one endpoint.

A replica holds its GPUs through jobs.Allocation (its `holder`), under the same one-allocation-per-GPU
constraint the scheduler uses: no training job lands on a replica's GPUs, and no replica on a job's.
Only serving/replicas.py changes a replica's state; the command writes the request (serving/requests.py).
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from cluster.models import Node
from cluster.names import validate_safe_name
from jobs.models import Checkpoint, Job


class Service(models.Model):
    """What the user asked for: this checkpoint, this engine, this many replicas of this many GPUs.

    RUNNING: the worker keeps `replicas` replicas up (places, starts, checks, restarts them), between
    min_replicas and max_replicas as the load asks (serving/scaling.py); SLEEPING: min_replicas 0 and no request
    for idle_after_s: no replica runs, no GPU is held; WAKING: a request came while it slept, a replica starts and
    the request is held until it answers (cold_start_timeout_s); STOPPING: the worker stops every replica and frees
    its GPUs; STOPPED: nothing is left of it. A rolling update (next_checkpoint) happens while RUNNING.
    """

    class State(models.TextChoices):
        RUNNING = "running", "running"
        SLEEPING = "sleeping", "sleeping"
        WAKING = "waking", "waking"
        STOPPING = "stopping", "stopping"
        STOPPED = "stopped", "stopped"

    class Engine(models.TextChoices):
        TRANSFORMERS = "transformers", "transformers serve"
        VLLM = "vllm", "vLLM"
        SGLANG = "sglang", "SGLang"
        CUSTOM = "custom", "custom command"

    AWAKE = (State.RUNNING, State.WAKING)
    AWAKE_OR_ASLEEP = (State.RUNNING, State.SLEEPING, State.WAKING)

    name = models.CharField(max_length=48, unique=True, validators=[validate_safe_name])
    state = models.CharField(max_length=10, choices=State.choices, default=State.RUNNING, db_index=True)
    job = models.ForeignKey(Job, on_delete=models.PROTECT, related_name="+")
    checkpoint = models.ForeignKey(Checkpoint, on_delete=models.PROTECT, related_name="+")
    engine = models.CharField(max_length=12, choices=Engine.choices, default=Engine.TRANSFORMERS)
    command_template = models.CharField(
        max_length=1000, blank=True, help_text="The engine's command; {model} {host} {port} {gpus} {name} {python}."
    )
    replicas = models.PositiveIntegerField(default=1, help_text="How many the worker keeps up now (awake).")
    min_replicas = models.PositiveIntegerField(default=1, help_text="0: it sleeps after idle_after_s.")
    max_replicas = models.PositiveIntegerField(default=1)
    target_outstanding = models.PositiveIntegerField(
        default=4, help_text="Requests in flight per replica above which another is added."
    )
    idle_after_s = models.PositiveIntegerField(null=True, blank=True, help_text="min_replicas 0: sleep after this.")
    cold_start_timeout_s = models.PositiveIntegerField(
        null=True, blank=True, help_text="How long a request waits for a waking service (null: the engine's)."
    )
    last_request_at = models.DateTimeField(null=True, blank=True, help_text="Written by the endpoint's flusher.")
    wake_at = models.DateTimeField(null=True, blank=True, help_text="When the current (or last) wake was asked.")
    last_cold_start_s = models.FloatField(null=True, blank=True, help_text="Its last wake: asked to first ready.")
    scaled_at = models.DateTimeField(null=True, blank=True, help_text="The last change of `replicas`.")
    quiet_since = models.DateTimeField(null=True, blank=True, help_text="Load below the scale-down line since.")
    next_checkpoint = models.ForeignKey(Checkpoint, null=True, blank=True, on_delete=models.PROTECT, related_name="+",
                                        help_text="A rolling update in progress: where it goes.")  # fmt: skip
    note = models.CharField(max_length=500, blank=True, help_text="Its last wake, scale or update, one line.")
    gpus_per_replica = models.PositiveIntegerField(default=1, help_text="GPUs of one node (0: a whole GPU-less node).")
    min_vram_mb = models.PositiveIntegerField(
        null=True, blank=True, help_text="Each of a replica's GPUs needs this much: its share of the weights."
    )
    max_restarts = models.PositiveIntegerField(default=3, help_text="Restarts of one replica before it is given up.")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="+")  # fmt: skip
    tender = models.CharField(max_length=100, blank=True, help_text="The worker tending it now.")
    tend_until = models.DateTimeField(null=True, blank=True, help_text="Its lease: another worker waits until then.")
    created_at = models.DateTimeField(default=timezone.now)
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Replica(models.Model):
    """One engine process of a service on one node, with the GPUs it holds and how it answers."""

    class State(models.TextChoices):
        PENDING = "pending", "pending"  # waiting for GPUs
        STARTING = "starting", "starting"  # started, not answering yet
        READY = "ready", "ready"  # answers its health check: takes requests
        UNHEALTHY = "unhealthy", "unhealthy"  # was ready, stopped answering: no requests, restarted if it lasts
        DRAINING = "draining", "draining"  # leaving (scaled down, updated, asleep): no new requests, then stopped
        FAILED = "failed", "failed"  # restarted max_restarts times: given up, GPUs freed
        STOPPED = "stopped", "stopped"

    HOLDING = (State.STARTING, State.READY, State.UNHEALTHY, State.DRAINING)

    service = models.ForeignKey(Service, on_delete=models.CASCADE, related_name="replica_set")
    index = models.PositiveIntegerField()
    checkpoint = models.ForeignKey(Checkpoint, null=True, blank=True, on_delete=models.PROTECT, related_name="+",
                                   help_text="What it serves (an update starts replicas of another).")  # fmt: skip
    state = models.CharField(max_length=10, choices=State.choices, default=State.PENDING)
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    gpu_indices = models.JSONField(default=list, blank=True)
    port = models.PositiveIntegerField(null=True, blank=True)
    tag = models.CharField(max_length=100, blank=True, help_text="UGRO_JOB of its processes; new for every start.")
    model_path = models.CharField(max_length=1000, blank=True, help_text="The checkpoint's path on its node.")
    restarts = models.PositiveIntegerField(default=0)
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    unhealthy_since = models.DateTimeField(null=True, blank=True)
    checked_at = models.DateTimeField(null=True, blank=True)
    note = models.CharField(max_length=500, blank=True, help_text="What happened last, one line.")
    draining_since = models.DateTimeField(null=True, blank=True)
    log_tag = models.CharField(max_length=100, blank=True, help_text="The start whose log is copied centrally.")
    log_offset = models.PositiveBigIntegerField(default=0, help_text="Bytes of that log copied so far.")
    # the endpoint's flusher (serving/stats.py): requests in flight at its last flush, and on average since the one
    # before (the autoscaler's load); one web process writes them (several would overwrite each other)
    outstanding = models.PositiveIntegerField(default=0)
    load = models.FloatField(default=0.0)
    load_at = models.DateTimeField(null=True, blank=True)
    # every web process adds its counts here (serving/stats.py): Prometheus' counters
    requests_total = models.PositiveBigIntegerField(default=0)
    errors_total = models.PositiveBigIntegerField(default=0)
    tokens_total = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["service", "index"]
        constraints = [models.UniqueConstraint(fields=["service", "index"], name="replica_index_unique")]

    def __str__(self) -> str:
        return f"{self.service.name} replica {self.index}"

    @property
    def holder(self) -> str:
        """Its name on jobs.Allocation rows."""
        return f"serve:{self.service.name}/{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.node.address}:{self.port}"

    def remote(self, suffix: str) -> str:
        """A file of its current start on its node: <workdir>/.ugro/serve/<tag>.<suffix>."""
        return f"{self.node.workdir.rstrip('/') or '/'}/.ugro/serve/{self.tag}.{suffix}"


class ReplicaTraffic(models.Model):
    """One web process's requests to one replica over a few seconds (serving/stats.py): what the services page,
    the API and /metrics add up over the last minute. Every web process writes its own rows, so several add up;
    the worker drops them after an hour."""

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="traffic")
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(db_index=True)
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0, help_text="Refused, reset, a 5xx, or cut off while answering.")
    tokens = models.PositiveIntegerField(default=0, help_text="Completion tokens: the usage field, else chunks.")
    latency = models.JSONField(default=dict, help_text="Answered requests by latency bucket (stats.bucket).")

    class Meta:
        ordering = ["ended_at"]
