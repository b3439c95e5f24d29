"""Training metric points parsed from what ranks print."""

from __future__ import annotations

from django.db import models

from jobs.models import Job


class MetricPoint(models.Model):
    """One value of one named metric at one step, as printed by one rank."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metric_points")
    rank = models.IntegerField(help_text="Node rank whose log carried the line (the line's own 'rank' wins).")
    step = models.BigIntegerField()
    name = models.CharField(max_length=100)
    value = models.FloatField()
    time = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["job", "name", "step"], name="metric_job_name_step")]

    def __str__(self) -> str:
        return f"{self.job_id}/{self.rank} {self.name}@{self.step}={self.value}"
