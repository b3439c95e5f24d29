"""Nodes and cluster-wide settings: what the user declares about their machines."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from . import links
from .links import Endpoint, fingerprint
from .names import validate_safe_name

PORT_VALIDATORS = [MinValueValidator(1), MaxValueValidator(65535)]
MAX_GPUS_PER_NODE = 64


class ClusterSettings(models.Model):
    """The one row of cluster-wide settings (the `cluster:`/`training:`/`paths:` parts of cluster.yaml)."""

    name = models.CharField(max_length=200, default="UGRO cluster")
    master_address = models.CharField(
        max_length=255, blank=True, help_text="Rendezvous address; blank means the first placed node's address."
    )
    rendezvous_port = models.PositiveIntegerField(default=29500, validators=PORT_VALIDATORS)
    default_script = models.CharField(
        max_length=500,
        default="train/train_production.py",
        help_text="Path of the training script on the nodes, relative to each node's working directory.",
    )
    script_args_template = models.JSONField(
        default=list,
        blank=True,
        help_text=(
            "Arguments for the script; each item may use {model} {dataset} {epochs} {lr} {job}. "
            "Empty means the train_production.py interface."
        ),
    )
    training = models.JSONField(default=dict, blank=True)
    paths = models.JSONField(default=dict, blank=True)
    script_roots = models.JSONField(
        default=list,
        blank=True,
        help_text=(
            "Directories on the nodes that a launch's script must be inside (cluster.yaml: paths.script_roots); "
            "{workdir} is each node's working directory, {scripts} is paths.scripts. Empty means both of those."
        ),
    )
    # The scheduler (jobs/placement.py): time limits, backfill, fair share and quotas.
    default_time_limit_s = models.PositiveIntegerField(
        default=24 * 3600, help_text="A job's time limit when it names none (seconds); past it the job is stopped."
    )
    max_time_limit_s = models.PositiveIntegerField(
        default=7 * 24 * 3600, help_text="The longest time limit a job may ask for (seconds)."
    )
    reservations = models.PositiveSmallIntegerField(
        default=1,
        help_text="How many of the first waiting jobs hold a reservation that later jobs may not delay "
        "(1: Slurm's EASY backfill; 0: no backfill guarantee).",
    )
    fair_share_half_life_h = models.FloatField(
        default=24.0, help_text="Past GPU use counts half as much after this many hours (fair share)."
    )
    quota_max_gpus = models.PositiveIntegerField(
        default=0, help_text="Most GPUs one user's jobs may hold at once (0: no limit)."
    )
    quota_max_queued = models.PositiveIntegerField(
        default=0, help_text="Most jobs one user may have waiting in the queue (0: no limit)."
    )
    # Energy (docs/power.md): what a kWh costs, to price each job's energy; blank: no cost shown.
    price_per_kwh = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0)], help_text="cluster.yaml power.price_per_kwh."
    )
    currency = models.CharField(max_length=8, blank=True, help_text="A label for the price, e.g. EUR.")

    class Meta:
        verbose_name = verbose_name_plural = "cluster settings"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def load(cls) -> ClusterSettings:
        obj, _ = cls.objects.get_or_create(pk=1)
        return obj


def detect_torchrun(repo: Path) -> str:
    """The torchrun this machine offers a local node: the repo's node env (`bin/setup --node-env`) when it exists,
    else torchrun on PATH, else the bare name (looked up again when a rank starts)."""
    local_env = repo / ".venv-node" / "bin" / "torchrun"
    return str(local_env) if local_env.exists() else (shutil.which("torchrun") or "torchrun")


class Node(models.Model):
    """One machine of the cluster, reached over SSH (or run locally), with its GPUs and training env."""

    class Role(models.TextChoices):
        MASTER = "master", "master"
        WORKER = "worker", "worker"

    class Transport(models.TextChoices):
        SSH = "ssh", "SSH"
        LOCAL = "local", "local (this machine, no SSH)"

    class Status(models.TextChoices):
        UNKNOWN = "unknown", "unknown"
        HEALTHY = "healthy", "healthy"
        DEGRADED = "degraded", "degraded"
        DOWN = "down", "down"
        ASLEEP = "asleep", "asleep"  # put to sleep when idle (cluster/power.py): not probed, no alert
        WAKING = "waking", "waking"  # a wake was sent; awake when it answers, DOWN past its wake_timeout

    # Statuses in which nothing is asked of the node (it would not answer): loops and pages leave it alone.
    NOT_ANSWERING = (Status.DOWN, Status.ASLEEP, Status.WAKING)
    RESTING = (Status.ASLEEP, Status.WAKING)  # by its power: block, not a failure: `health` exits 0

    name = models.CharField(max_length=64, unique=True, validators=[validate_safe_name])
    hostname = models.CharField(max_length=255, blank=True)
    address = models.CharField(max_length=255, help_text="IP or DNS name the controller and other nodes use.")
    ssh_port = models.PositiveIntegerField(default=22, validators=PORT_VALIDATORS)
    user = models.CharField(max_length=64, blank=True)
    key_path = models.CharField(max_length=500, blank=True, help_text="Private key; blank uses your SSH agent/keys.")
    transport = models.CharField(max_length=8, choices=Transport.choices, default=Transport.SSH)
    role = models.CharField(max_length=8, choices=Role.choices, default=Role.WORKER)
    order = models.IntegerField(
        default=0,
        validators=[MinValueValidator(-1_000_000), MaxValueValidator(1_000_000)],
        help_text="Placement order (the YAML's rank); masters come first.",
    )
    gpu_count = models.PositiveIntegerField(default=1, validators=[MaxValueValidator(MAX_GPUS_PER_NODE)])
    gpu_model = models.CharField(max_length=100, blank=True)
    gpu_vram_gb = models.FloatField(default=0, validators=[MinValueValidator(0), MaxValueValidator(100_000)])
    torchrun_command = models.CharField(
        max_length=500,
        default="torchrun",
        help_text="Starts torchrun in this node's training env, e.g. /opt/venv/bin/torchrun or "
        "'pixi run -e cuda torchrun'. Split like a shell would, never run through one.",
    )
    torchrun_auto = models.CharField(
        max_length=500,
        blank=True,
        help_text="The torchrun command UGRO chose itself for this local node (the demo node). While the torchrun "
        "command is still this one, each launch chooses again (the repo's .venv-node once `bin/setup --node-env` "
        "made it); a torchrun command set by hand is kept.",
    )
    agent_python = models.CharField(
        max_length=255, default="/usr/bin/python3", help_text="Any python >= 3.8 on the node, for UGRO's agent."
    )
    workdir = models.CharField(max_length=500, default="~", help_text="Where ranks start; scripts are relative to it.")
    workdir_id = models.CharField(
        max_length=64,
        blank=True,
        help_text="The id the last probe read in <workdir>/.ugro/workdir-id (written there once, by the first node "
        "to look): nodes with the same id share their working directory (a shared filesystem such as NFS).",
    )
    cache_limit = models.BigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Bytes its store (<workdir>/.ugro/objects) may hold before the least recently used is trimmed "
        "(cluster.yaml cache_limit: 50GB); blank: the cluster's paths.cache_limit, else 50 GB.",
    )
    env = models.JSONField(default=dict, blank=True, help_text="Extra environment for ranks on this node.")
    power = models.JSONField(
        default=dict,
        blank=True,
        help_text="How it sleeps when idle and wakes when the queue needs it (cluster.yaml power:, cluster/power.py): "
        "sleep, wake (wol with mac, broadcast, port; or command with wake_command), idle_after_s, wake_timeout_s.",
    )
    power_since = models.DateTimeField(null=True, blank=True, help_text="When it went to sleep, or the wake was sent.")
    idle_since = models.DateTimeField(
        null=True, blank=True, help_text="Since when it has held no job, service or reservation (jobs/power.py)."
    )
    enabled = models.BooleanField(default=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.UNKNOWN)
    status_reason = models.CharField(max_length=500, blank=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    health_score = models.PositiveSmallIntegerField(null=True, blank=True, help_text="0-100 from the last probe.")
    health_checks = models.JSONField(
        default=list, blank=True, help_text="Failing checks of the last probe: [{name, severity, detail}]."
    )
    gpu_reader = models.CharField(
        max_length=500,
        default="auto",
        blank=True,
        help_text="How the probe reads GPUs: auto (NVML, else nvidia-smi), nvml, nvidia-smi, or fixture:<path> "
        "(a JSON file on the node, for tests).",
    )
    breaker = models.JSONField(default=dict, blank=True, help_text="Circuit breaker state of the health monitor.")
    last_poll_at = models.DateTimeField(null=True, blank=True, help_text="Last probe attempt, good or not.")
    poll_lease_until = models.DateTimeField(
        null=True, blank=True, help_text="A poll is probing this node until then (overlapping polls skip it)."
    )
    host_key = models.TextField(
        blank=True,
        help_text="The node's pinned SSH host key ('type base64'); a different key is refused. "
        "Recorded on first contact (or from known_hosts); `manage.py trust NODE` replaces it.",
    )
    host_key_source = models.CharField(max_length=20, blank=True, help_text="first use, known_hosts or trust")
    host_key_pinned_at = models.DateTimeField(null=True, blank=True)
    probed = models.JSONField(
        default=dict,
        blank=True,
        help_text="What `ugro node add` / `ugro node probe` found on the machine (cluster/provision.py): GPUs, CPUs, "
        "RAM, disk, its Python environments with their torch/CUDA/NCCL, and the route the controller takes to it.",
    )

    class Meta:
        ordering = ["order", "name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        try:
            argv = shlex.split(self.torchrun_command)
        except ValueError as exc:
            raise ValidationError({"torchrun_command": f"cannot split: {exc}"}) from None
        if not argv:
            raise ValidationError({"torchrun_command": "must not be empty"})
        if not isinstance(self.env, dict) or not all(isinstance(k, str) for k in self.env):
            raise ValidationError({"env": "must be a mapping of names to values"})
        if self.power:
            from .power import PowerError, parse_power, power_block  # cluster.power imports this module

            try:
                # admin edits the stored form (idle_after_s ...): read back as cluster.yaml's block, checked alike
                block = power_block(self.power) if "idle_after_s" in self.power else self.power
                self.power = parse_power(block, self.address, self.transport)
            except PowerError as exc:
                raise ValidationError({"power": f"{exc.key}: {exc}" if exc.key else str(exc)}) from None
            except KeyError as exc:
                raise ValidationError({"power": f"{exc.args[0]} is missing"}) from None

    def placement_key(self) -> tuple[bool, int, str]:
        """Order in which nodes take ranks: masters first (rank 0 hosts the rendezvous), then order, name."""
        return (self.role != self.Role.MASTER, self.order, self.name)

    @property
    def torchrun_argv(self) -> list[str]:
        return shlex.split(self.torchrun_now)

    @property
    def follows_setup(self) -> bool:
        """Whether this node's torchrun is UGRO's own choice for this machine (the demo node's), nobody's since."""
        local = self.transport == self.Transport.LOCAL
        return local and bool(self.torchrun_auto) and self.torchrun_auto == self.torchrun_command

    @property
    def torchrun_now(self) -> str:
        """The torchrun command a launch runs: the one set, or where UGRO chose it (follows_setup) the one it would
        choose now, so that the node env `bin/setup --node-env` makes is used without a restart."""
        return detect_torchrun(Path(settings.BASE_DIR)) if self.follows_setup else self.torchrun_command

    @property
    def gpu_label(self) -> str:
        """`1× NVIDIA H200 140 GB`: the model and memory the probe read (cluster.gpus.gpu_text); prefetch
        `gpus` when labelling many nodes."""
        from .gpus import gpu_text  # cluster.gpus imports this module

        return gpu_text(self, self.gpus.all() if self.pk else [])

    def shares_workdir_with(self) -> list[str]:
        """The other enabled nodes that see this node's working directory (the same workdir_id), by name."""
        if not self.workdir_id:
            return []
        same = Node.objects.filter(enabled=True, workdir_id=self.workdir_id).exclude(pk=self.pk)
        return list(same.order_by("order", "name").values_list("name", flat=True))

    @property
    def host_key_fingerprint(self) -> str:
        """SHA256 fingerprint of the pinned host key, as OpenSSH prints it ('' when none is pinned)."""
        return fingerprint(self.host_key) if self.host_key else ""

    def endpoint(self) -> Endpoint:
        return Endpoint(
            name=self.name,
            address=self.address,
            port=self.ssh_port,
            user=self.user,
            key_path=self.key_path,
            transport=self.transport,
            python=self.agent_python,
            host_key=self.host_key,
            known_hosts=settings.UGRO["KNOWN_HOSTS"],
        )

    def link(self):
        """The warm link to this node's agent (created on first use)."""
        return links.pool.get(self.endpoint(), links.CONNECT_TIMEOUT_S)

    def reach(self) -> dict:
        """A hello over the warm link (connecting if needed) within the connect timeout.

        The health poll and pre-flight start with it, so a node gone silent on a warm link fails as
        fast as one that refuses connections, not after a longer request's own timeout.
        """
        return self.link().request("hello", timeout=links.CONNECT_TIMEOUT_S)


class GPU(models.Model):
    """One GPU of a node: the unit the scheduler allocates (jobs.Allocation holds it for a job).

    Rows follow the node's gpu_count (cluster.gpus.sync_gpus); the health monitor fills in the model
    and memory it reads. A node with no GPU has no rows and is allocated whole.
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField(help_text="The device index (what CUDA_VISIBLE_DEVICES names).")
    model = models.CharField(max_length=100, blank=True)
    vram_mb = models.FloatField(default=0, help_text="Total memory; 0 when not known.")
    uuid = models.CharField(max_length=100, blank=True)

    class Meta:
        ordering = ["node", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_index_unique")]

    def __str__(self) -> str:
        return f"{self.node.name}:{self.index}"

    @property
    def vram_gb(self) -> float:
        return self.vram_mb / 1024


class HealthSample(models.Model):
    """One probe of one node (raw, kept 24 h) or a 1-minute aggregate of them (kept 30 days)."""

    class Kind(models.TextChoices):
        RAW = "raw", "raw"
        MINUTE = "minute", "1-minute aggregate"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="samples")
    time = models.DateTimeField(db_index=True)
    kind = models.CharField(max_length=6, choices=Kind.choices, default=Kind.RAW)
    ok = models.BooleanField(default=True, help_text="False when the probe failed (the node was not reached).")
    error = models.CharField(max_length=500, blank=True)
    score = models.FloatField(null=True, blank=True)
    status = models.CharField(max_length=10, blank=True)
    rtt_ms = models.FloatField(null=True, blank=True)
    cpu_percent = models.FloatField(null=True, blank=True)
    ram_percent = models.FloatField(null=True, blank=True)
    disk_percent = models.FloatField(null=True, blank=True)
    disk_free_gb = models.FloatField(null=True, blank=True)
    load1 = models.FloatField(null=True, blank=True)
    gpu_count = models.PositiveSmallIntegerField(null=True, blank=True)
    gpu_util_percent = models.FloatField(null=True, blank=True, help_text="Mean over the node's GPUs.")
    gpu_mem_used_mb = models.FloatField(null=True, blank=True, help_text="Sum over the node's GPUs.")
    gpu_mem_total_mb = models.FloatField(null=True, blank=True)
    gpu_temp_c = models.FloatField(null=True, blank=True, help_text="Hottest GPU.")
    gpu_power_w = models.FloatField(null=True, blank=True, help_text="Sum over the node's GPUs.")
    gpus = models.JSONField(default=list, blank=True, help_text="Per-GPU readings (raw samples only).")
    rapl = models.JSONField(
        null=True, blank=True, help_text="CPU package energy counters read from RAPL ([{zone, energy_uj, max_uj}]; "
        "raw samples only; blank: not readable on the node).",
    )  # fmt: skip
    samples = models.PositiveIntegerField(default=1, help_text="Raw samples behind an aggregate.")

    class Meta:
        ordering = ["-time"]
        indexes = [models.Index(fields=["node", "kind", "-time"], name="sample_node_kind_time")]

    def __str__(self) -> str:
        return f"{self.node.name} at {self.time:%Y-%m-%d %H:%M:%S} ({self.kind})"


class Alert(models.Model):
    """A condition worth a human's attention; at most one open alert per node and condition key."""

    class Severity(models.TextChoices):
        INFO = "info", "info"
        WARNING = "warning", "warning"
        CRITICAL = "critical", "critical"

    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.CASCADE, related_name="alerts")
    key = models.CharField(max_length=100, help_text='The condition, e.g. "down", "ram", "gpu_temp:0".')
    severity = models.CharField(max_length=8, choices=Severity.choices)
    message = models.CharField(max_length=1000)
    job_name = models.CharField(max_length=64, blank=True)
    opened_at = models.DateTimeField(db_index=True)
    updated_at = models.DateTimeField()
    resolved_at = models.DateTimeField(null=True, blank=True, help_text="INFO alerts are resolved when made.")

    class Meta:
        ordering = ["-opened_at"]
        constraints = [
            # No floods: the database refuses a second open alert for the same condition of a node.
            models.UniqueConstraint(
                fields=["node", "key"], condition=models.Q(resolved_at__isnull=True), name="one_open_alert_per_key"
            ),
        ]

    def __str__(self) -> str:
        where = self.node.name if self.node_id else (self.job_name or "cluster")
        return f"[{self.severity}] {where}: {self.message}"

    @property
    def is_open(self) -> bool:
        return self.resolved_at is None


class AlertSettings(models.Model):
    """The one row of alert delivery settings, editable in admin (the environment adds to it)."""

    webhook_url = models.URLField(
        max_length=1000, blank=True, help_text="JSON POST per alert (Slack incoming webhook, ntfy, ...)."
    )
    emails = models.TextField(blank=True, help_text="Addresses to mail alerts to, one per line or comma separated.")
    min_severity = models.CharField(
        max_length=8,
        choices=Alert.Severity.choices,
        default=Alert.Severity.INFO,
        help_text="Notify from this level up.",
    )

    class Meta:
        verbose_name = verbose_name_plural = "alert settings"

    def __str__(self) -> str:
        return "alert settings"

    @classmethod
    def load(cls) -> AlertSettings:
        obj, _ = cls.objects.get_or_create(pk=1)
        return obj

    def email_list(self) -> list[str]:
        return [e.strip() for e in self.emails.replace(",", "\n").splitlines() if e.strip()]
