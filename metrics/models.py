"""Training metric points parsed from what ranks print."""

from __future__ import annotations

from django.db import models

from jobs.models import Job

# A series' points newest step first; points with no step (placed by time) after them, the latest first
# when a series has only those (add "-id")
LAST_FIRST = models.F("step").desc(nulls_last=True)


class MetricPoint(models.Model):
    """One value of one named metric at one step, as printed by one rank."""

    # indexed by (job, id) below: the rollup's catch_up and the charts read a job's points past its mark.
    # No foreign key constraint in the database: its check, a lookup of the job's row per point, is a large
    # share of the cost of PostgreSQL's COPY of points. Every writer first updates the job's row
    # (the follower's renew()), so it writes nothing for a job already deleted; deleting a job still deletes
    # its points (Django's CASCADE, which never needed the constraint). Left possible: points a follower
    # commits while the job's deletion is under way stay behind, under an id no job has again (never read).
    job = models.ForeignKey(
        Job, on_delete=models.CASCADE, related_name="metric_points", db_index=False, db_constraint=False
    )
    rank = models.IntegerField(help_text="Node rank whose log carried the line (the line's own 'rank' wins).")
    step = models.BigIntegerField(
        null=True, help_text="The framework's step; none when only the time is known (a Lightning bar's value)."
    )
    name = models.CharField(max_length=100)
    value = models.FloatField()
    time = models.DateTimeField()
    # db defaults too: points are also written by COPY and plain INSERTs that name only their own columns
    attempt = models.PositiveIntegerField(default=1, db_default=1, help_text="The job's attempt that printed it.")
    superseded = models.BooleanField(
        default=False, db_default=False,
        help_text="A later attempt resumed from an earlier step: this point is off the curve.",
    )  # fmt: skip

    class Meta:
        indexes = [
            models.Index(fields=["job", "name", "step"], name="metric_job_name_step"),
            # replaces the foreign key's own index (job alone), so COPY still maintains three indexes
            models.Index(fields=["job", "id"], name="metric_job_id"),
        ]

    def __str__(self) -> str:
        return f"{self.job_id}/{self.rank} {self.name}@{self.step}={self.value}"


class JobMetrics(models.Model):
    """How one job's metrics are read beyond the known line shapes, and how far its training bar got."""

    job = models.OneToOneField(Job, on_delete=models.CASCADE, primary_key=True, related_name="metric_settings")
    pattern = models.CharField(
        max_length=500, blank=True, help_text="Regex: lines it matches give their key=value / key: value pairs."
    )
    files = models.JSONField(
        default=list, blank=True, help_text="Metric files or directories on the nodes (relative to the workdir)."
    )
    total_steps = models.BigIntegerField(null=True, blank=True, help_text="The training bar's total (its M).")
    step = models.BigIntegerField(null=True, blank=True, help_text="The last step the training bar showed.")

    def __str__(self) -> str:
        return f"metrics of {self.job_id}"


class FinalMetric(models.Model):
    """One value of a run's end-of-training summary (e.g. the Trainer's train_runtime, train_loss), per rank."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="final_metrics")
    rank = models.IntegerField()
    name = models.CharField(max_length=100)
    value = models.FloatField()
    step = models.BigIntegerField(help_text="The last step known when the summary was printed.")
    time = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "rank", "name"], name="final_metric_unique")]

    def __str__(self) -> str:
        return f"{self.job_id}/{self.rank} final {self.name}={self.value}"


class MetricFile(models.Model):
    """A metric file a framework writes on a node (Lightning's metrics.csv, a TensorBoard event file),
    followed from a byte offset like a rank's log."""

    class Kind(models.TextChoices):
        CSV = "csv", "csv"
        TFEVENTS = "tfevents", "TensorBoard events"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metric_files")
    rank = models.IntegerField(help_text="Node rank of the node the file is on.")
    path = models.CharField(max_length=1000)
    kind = models.CharField(max_length=10, choices=Kind.choices)
    offset = models.BigIntegerField(default=0, help_text="Bytes of the file already taken.")
    header = models.TextField(blank=True, help_text="CSV: the header line the rows were read with.")
    records = models.BigIntegerField(default=0, help_text="CSV rows or events already taken.")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "rank", "path"], name="metric_file_unique")]

    def __str__(self) -> str:
        return f"{self.job_id}/{self.rank} {self.path}"


class MetricRollup(models.Model):
    """One bucket of 2**level steps of one metric of one rank: what a chart needs of the points in it.

    Kept at ingestion (metrics/rollup.py) for every level in rollup.LEVELS, so a chart of any length asks
    the coarsest level that still has enough buckets and reads a few thousand rows, not every point.
    Superseded points are not in it (a resume rebuilds the buckets past the step it resumed from). It holds
    exactly the job's points up to its RollupMark; the points past the mark are folded in by the next
    rollup.catch_up() (the charts fold them in themselves meanwhile).
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metric_rollups")
    name = models.CharField(max_length=100)
    level = models.PositiveSmallIntegerField(help_text="Bucket b holds steps [b * 2**level, (b + 1) * 2**level).")
    rank = models.IntegerField()
    bucket = models.BigIntegerField()
    n = models.BigIntegerField(help_text="Points in the bucket.")
    v_min = models.FloatField()
    v_max = models.FloatField()
    v_sum = models.FloatField()
    first_step = models.BigIntegerField()
    last_step = models.BigIntegerField()
    last_value = models.FloatField(help_text="The value at last_step (of the point stored last, on a tie).")
    t_min = models.DateTimeField()
    t_max = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["job", "name", "level", "rank", "bucket"], name="metric_rollup_unique")
        ]

    def __str__(self) -> str:
        return f"{self.job_id}/{self.rank} {self.name} 2^{self.level} #{self.bucket}"


class RollupMark(models.Model):
    """How far the job's rollup goes: every point of the job with id <= upto is folded into MetricRollup
    (or superseded), none past it.

    The follower stores points with COPY in its lease's transaction and folds them later, in a
    transaction of its own (metrics/rollup.py catch_up), so the fold does not hold the job's row lock.
    A job with no mark has no rollup yet: all its points are past the mark.
    """

    job = models.OneToOneField(Job, on_delete=models.CASCADE, primary_key=True, related_name="rollup_mark")
    upto = models.BigIntegerField(default=0, help_text="The id of the last MetricPoint folded into the rollup.")

    def __str__(self) -> str:
        return f"rollup of {self.job_id} up to point {self.upto}"
