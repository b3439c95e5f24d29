"""What the API accepts (launch) and returns (jobs, nodes, logs), with bounds on every number."""

from __future__ import annotations

from rest_framework import serializers

from accounts.policy import PRIORITY_MAX, PRIORITY_MIN
from cluster.names import SAFE_NAME
from jobs.launch import LaunchError, LaunchRequest
from jobs.limits import parse_duration, parse_size_mb
from jobs.spec import (
    ATTEMPTS_MAX,
    BATCH_MAX,
    EPOCHS_MAX,
    GPUS_MAX,
    HANG_MAX_S,
    LR_MAX,
    LR_MIN,
    NODES_MAX,
    NPROC_MAX,
)  # fmt: skip
from jobs.sweeps import SweepRequest


class LaunchSerializer(serializers.Serializer):
    """The CLI's `launch` options. jobs.launch.create_job does the checks every surface shares."""

    name = serializers.RegexField(SAFE_NAME, max_length=64, error_messages={"invalid": "job name: use letters, "
                                  "digits, '.', '_' or '-', starting with a letter or digit (1-64)"})  # fmt: skip
    nodes = serializers.ListField(child=serializers.CharField(max_length=64), required=False, default=list,
                                  max_length=NODES_MAX, help_text="node names; empty: `count` nodes")  # fmt: skip
    count = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=NODES_MAX,
                                     help_text="how many nodes (default: all enabled)")  # fmt: skip
    script = serializers.CharField(required=False, allow_blank=True, default="", max_length=500)
    model = serializers.CharField(required=False, allow_blank=True, default="", max_length=200)
    dataset = serializers.CharField(required=False, allow_blank=True, default="", max_length=200)
    epochs = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=EPOCHS_MAX)
    lr = serializers.FloatField(required=False, allow_null=True, min_value=LR_MIN, max_value=LR_MAX)
    nproc_per_node = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=NPROC_MAX)
    priority = serializers.IntegerField(required=False, default=0, min_value=PRIORITY_MIN, max_value=PRIORITY_MAX)
    extra_args = serializers.ListField(child=serializers.CharField(max_length=4096, allow_blank=True,
                                       trim_whitespace=False), required=False, default=list, max_length=500,
                                       help_text="extra arguments for the script, as argv items")  # fmt: skip
    metrics_pattern = serializers.CharField(required=False, allow_blank=True, default="", max_length=500)
    metrics_files = serializers.ListField(child=serializers.CharField(max_length=1000), required=False,
                                          default=list, max_length=50)  # fmt: skip
    data = serializers.ListField(child=serializers.CharField(max_length=1000), required=False, default=list,
                                 max_length=50, help_text="SRC[:DEST]: a controller path or NODE:PATH (docs/data.md)")
    packages = serializers.CharField(required=False, allow_blank=True, default="", max_length=1000,
                                     help_text="a lock file on the controller: its environment on every node "
                                     "(docs/envs.md)")  # fmt: skip
    dry_run = serializers.BooleanField(
        required=False, default=False, help_text="return each rank's exact command; create and start nothing"
    )
    gpus = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=GPUS_MAX,
                                    help_text="GPUs in all, on any nodes (instead of nodes/count)")  # fmt: skip
    gpus_per_node = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=NPROC_MAX)
    time_limit = serializers.CharField(required=False, allow_blank=True, default="", max_length=20,
                                       help_text="e.g. 90m, 2h, 1d (default: the cluster's)")  # fmt: skip
    min_vram = serializers.CharField(required=False, allow_blank=True, default="", max_length=20,
                                     help_text="memory each GPU needs, e.g. 10G")  # fmt: skip
    after = serializers.CharField(required=False, allow_blank=True, default="", max_length=64,
                                  help_text="start only after this job succeeded")  # fmt: skip
    batch_per_gpu = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=BATCH_MAX,
        help_text="the even split's batch per GPU: fills {local_batch}",
    )  # fmt: skip
    batch_weights = serializers.CharField(
        required=False, allow_blank=True, default="", max_length=2000,
        help_text="uneven GPUs: NODE=WEIGHT,... or auto (docs/uneven-gpus.md)",
    )  # fmt: skip
    scale_probe = serializers.CharField(
        required=False, allow_blank=True, default="", max_length=20,
        help_text="a duration per node count (60s): the job's scaling measured before it runs, or off "
        "(docs/scaling.md)",
    )  # fmt: skip
    retry = serializers.CharField(required=False, allow_blank=True, default="", max_length=200,
                                  help_text="failure kinds resumed automatically, e.g. node-lost,oom")  # fmt: skip
    max_attempts = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=ATTEMPTS_MAX)
    min_nodes = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=NODES_MAX)
    resume_template = serializers.CharField(required=False, allow_blank=True, default="", max_length=500,
                                            help_text="the script's resume argument, with {checkpoint}")  # fmt: skip
    checkpoint_glob = serializers.CharField(required=False, allow_blank=True, default="", max_length=500)
    keep = serializers.CharField(required=False, allow_blank=True, default="", max_length=200,
                                 help_text="checkpoints kept: LATEST[,best:METRIC:K] (docs/recovery.md)")  # fmt: skip
    batch_template = serializers.CharField(required=False, allow_blank=True, default="", max_length=500,
                                           help_text="e.g. --batch-size {batch} --grad-accum {accum}")  # fmt: skip
    batch = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=BATCH_MAX)
    grad_accum = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=BATCH_MAX)
    hang_after_s = serializers.FloatField(required=False, allow_null=True, min_value=1, max_value=HANG_MAX_S,
                                          help_text="seconds without a metric line that make the job HUNG")  # fmt: skip
    sync_upload = serializers.RegexField(
        r"^[0-9a-f]{64}$", required=False, allow_blank=True, default="",
        help_text="the digest POST /api/v1/sync gave for an uploaded directory: the ranks start in its copy",
    )  # fmt: skip
    allow_mismatch = serializers.BooleanField(required=False, default=False,
                                              help_text="start even if the script differs between nodes")  # fmt: skip

    def validate(self, data):
        if data.get("nodes") and data.get("count") is not None:
            raise serializers.ValidationError("give nodes or count, not both")
        try:
            LaunchRequest.from_fields(data)  # a time limit, VRAM size or batch weights it cannot read
        except LaunchError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return data

    def launch_request(self) -> LaunchRequest:
        return LaunchRequest.from_fields(self.validated_data)


class RankSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    node = serializers.CharField()
    state = serializers.CharField()
    exit_code = serializers.IntegerField(allow_null=True)
    log_lines = serializers.IntegerField()
    log_offset = serializers.IntegerField()


class JobSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    state = serializers.CharField()
    owner = serializers.CharField(allow_null=True)
    priority = serializers.IntegerField()
    attempt = serializers.IntegerField()
    nodes = serializers.ListField(child=serializers.CharField())
    progress = serializers.FloatField(allow_null=True, help_text="percent done, when the script's output tells")
    step = serializers.IntegerField(allow_null=True, help_text="the last step seen (in lists: live jobs only)")
    max_steps = serializers.IntegerField(allow_null=True, help_text="the steps in all, when the script tells")
    created_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    age_s = serializers.FloatField(help_text="seconds since it was created")
    duration_s = serializers.FloatField(allow_null=True)
    failure_kind = serializers.CharField(allow_blank=True)
    failure_reason = serializers.CharField(allow_blank=True)
    energy = serializers.JSONField(
        help_text="its GPUs' energy (and hosts' CPU, where RAPL is readable) and cost, in all and per attempt; wh "
        "null: not measured (docs/power.md)"
    )


class QueueEntrySerializer(JobSerializer):
    position = serializers.IntegerField()
    starts_now = serializers.BooleanField(help_text="it fits now: the next scheduling pass starts it")
    reason = serializers.CharField(allow_null=True, help_text="priority, resources, reservation, quota, dependency")
    detail = serializers.CharField(allow_blank=True)
    estimated_start = serializers.DateTimeField(allow_null=True)
    gpus = serializers.CharField(allow_null=True, help_text="where it starts (or is estimated to): node:gpu,...")


class JobDetailSerializer(JobSerializer):
    script = serializers.CharField()
    script_args = serializers.ListField(child=serializers.CharField())
    rdzv_endpoint = serializers.CharField(allow_blank=True)
    launch_spread_s = serializers.FloatField(allow_null=True)
    ranks = RankSerializer(many=True)
    lines = serializers.ListField(child=serializers.CharField(), help_text="what `ugro status NAME` prints")
    code = serializers.JSONField(allow_null=True, help_text="synced directory, git, per-node versions (docs/sync.md)")
    retention = serializers.JSONField(allow_null=True, help_text="what --keep kept and freed (docs/recovery.md)")
    scale_probe = serializers.JSONField(
        allow_null=True, help_text="--scale-probe: each node count's samples/s, the count chosen and why, the batch "
        "weights it measured (docs/scaling.md)",
    )  # fmt: skip
    network_advice = serializers.CharField(
        allow_null=True, help_text="a multi-node job: how much of a step is communication and whether fewer nodes "
        "would be faster, with the numbers (docs/scaling.md)",
    )  # fmt: skip


class LogsSerializer(serializers.Serializer):
    job = serializers.CharField()
    state = serializers.CharField()
    settled = serializers.BooleanField(help_text="the job ended and every rank's output was copied: no more lines")
    lines = serializers.ListField(child=serializers.ListField(), help_text="[arrival time, rank, text]")
    offsets = serializers.DictField(child=serializers.IntegerField(),
                                    help_text="rank -> byte offset read up to; pass back as `since`")  # fmt: skip
    more = serializers.BooleanField(help_text="more committed lines are waiting: ask again at once")


class NodeSerializer(serializers.Serializer):
    name = serializers.CharField()
    address = serializers.CharField()
    role = serializers.CharField()
    gpu = serializers.CharField()
    enabled = serializers.BooleanField()
    status = serializers.CharField()
    score = serializers.IntegerField(allow_null=True)
    reason = serializers.CharField(allow_blank=True)
    checks = serializers.ListField(child=serializers.DictField())
    last_seen = serializers.DateTimeField(allow_null=True)
    job = serializers.CharField(allow_null=True)


class LinesSerializer(serializers.Serializer):
    lines = serializers.ListField(child=serializers.CharField())


class ResultsSerializer(JobDetailSerializer):
    """`ugro results`: the job as `ugro status NAME` shows it (the same fields, the same values) and its results."""

    lines = serializers.ListField(child=serializers.CharField(), help_text="what `ugro results NAME` prints")
    job = serializers.CharField(help_text="its name (as `name`)")
    exit_codes = serializers.DictField(child=serializers.IntegerField(allow_null=True))
    final_metrics = serializers.ListField(child=serializers.DictField())
    checkpoints = serializers.ListField(child=serializers.DictField())
    config = serializers.CharField(allow_null=True)
    logs = serializers.DictField(child=serializers.CharField())


class AuditSerializer(serializers.Serializer):
    time = serializers.DateTimeField()
    username = serializers.CharField()
    action = serializers.CharField()
    target = serializers.CharField()
    source = serializers.CharField()
    outcome = serializers.CharField()
    argv = serializers.ListField(child=serializers.CharField())


class MeSerializer(serializers.Serializer):
    username = serializers.CharField()
    role = serializers.CharField()
    scope = serializers.CharField(allow_null=True)


class ControllerSerializer(serializers.Serializer):
    worker_alive = serializers.BooleanField()
    scheduler_alive = serializers.BooleanField()
    problem = serializers.CharField(help_text="One line for people when something is missing, else empty.")
    version = serializers.CharField(help_text="The server's UGRO version (`ugro --version` compares its own).")


class SweepSerializer(serializers.Serializer):
    """The `sweep` command's options (jobs/sweeps.py checks the search space and each trial's launch)."""

    name = serializers.RegexField(SAFE_NAME, max_length=48, error_messages={"invalid": "sweep name: use letters, "
                                  "digits, '.', '_' or '-', starting with a letter or digit"})  # fmt: skip
    script = serializers.CharField(required=False, allow_blank=True, default="", max_length=500)
    grid = serializers.ListField(child=serializers.CharField(max_length=2000), required=False, default=list,
                                 max_length=20, help_text="NAME=V1,V2,...")  # fmt: skip
    random = serializers.ListField(child=serializers.CharField(max_length=2000), required=False, default=list,
                                   max_length=20, help_text="NAME=uniform(a,b) | loguniform(a,b) | ...")  # fmt: skip
    trials = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=1000)
    seed = serializers.IntegerField(required=False, default=0, min_value=0, max_value=2**31 - 1)
    max_concurrent = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=1000)
    metric = serializers.CharField(required=False, default="loss", max_length=100)
    mode = serializers.ChoiceField(choices=["min", "max"], required=False, default="min")
    median_stop = serializers.BooleanField(required=False, default=False)
    median_min_steps = serializers.IntegerField(required=False, default=10, min_value=0, max_value=10**12)
    gpus = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=65536)
    nodes = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=NODES_MAX)
    gpus_per_node = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=64)
    time_limit = serializers.CharField(required=False, allow_blank=True, default="", max_length=20)
    min_vram = serializers.CharField(required=False, allow_blank=True, default="", max_length=20)
    priority = serializers.IntegerField(required=False, default=0, min_value=PRIORITY_MIN, max_value=PRIORITY_MAX)
    extra_args = serializers.ListField(
        child=serializers.CharField(max_length=4096, allow_blank=True, trim_whitespace=False),
        required=False, default=list, max_length=500,
    )  # fmt: skip

    def validate(self, data):
        try:
            data["time_limit_s"] = parse_duration(data["time_limit"]) if data.get("time_limit") else None
            data["min_vram_mb"] = parse_size_mb(data["min_vram"]) if data.get("min_vram") else None
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return data

    def sweep_request(self) -> SweepRequest:
        d = self.validated_data
        base = LaunchRequest(
            name="", script=d["script"].strip(), count=d.get("nodes"), gpus=d.get("gpus"),
            gpus_per_node=d.get("gpus_per_node"), time_limit_s=d.get("time_limit_s"),
            min_vram_mb=d.get("min_vram_mb"), priority=d["priority"], extra_args=list(d["extra_args"]),
        )  # fmt: skip
        return SweepRequest(
            name=d["name"], base=base, grid=list(d["grid"]), random=list(d["random"]), trials=d.get("trials"),
            max_concurrent=d.get("max_concurrent"), seed=d["seed"], metric=d["metric"], mode=d["mode"],
            median_stop=d["median_stop"], median_min_steps=d["median_min_steps"],
        )  # fmt: skip
