"""A run's final loss, defined once: the last loss that rank 0 logged (every page and command shows this)."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Min

from metrics.models import MetricPoint

LOSS = "loss"


@dataclass(frozen=True)
class FinalLoss:
    """The last loss logged by rank 0 (else by the lowest rank that logged one), its step and the lowest loss."""

    rank: int
    step: int
    value: float
    best: float

    @property
    def text(self) -> str:
        return format_value(self.value)


def format_value(value: float) -> str:
    """How a metric value is printed everywhere (the training script prints final_loss the same way)."""
    return f"{value:.6g}"


def final_loss(job_id: int) -> FinalLoss | None:
    """The job's final loss; None when it logged no loss."""
    points = MetricPoint.objects.filter(job_id=job_id, name=LOSS)
    rank = points.aggregate(first=Min("rank"))["first"] if not points.filter(rank=0).exists() else 0
    if rank is None:
        return None
    mine = points.filter(rank=rank)
    last = mine.order_by("-step", "-id").values_list("step", "value").first()
    best = points.aggregate(best=Min("value"))["best"]
    return FinalLoss(rank=rank, step=last[0], value=last[1], best=best)
