"""A run's final value of a metric, defined once: the last value rank 0 logged (else the lowest rank that
logged it). The final loss is this for "loss"; every page and command shows it the same way."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Max, Min

from metrics.models import LAST_FIRST, MetricPoint

LOSS = "loss"


@dataclass(frozen=True)
class FinalValue:
    """The last value of a metric logged by rank 0 (else the lowest rank), its step, and the extremes."""

    name: str
    rank: int
    step: int
    value: float
    lowest: float | None = None  # None unless asked for (a scan of every point of the metric)
    highest: float | None = None

    @property
    def text(self) -> str:
        return format_value(self.value)

    @property
    def best(self) -> float:
        """The lowest for losses and errors, the highest for anything else (accuracy, BLEU, reward...)."""
        return self.lowest if lower_is_better(self.name) else self.highest


def lower_is_better(name: str) -> bool:
    leaf = name.rsplit("/", 1)[-1].lower()
    return any(word in leaf for word in ("loss", "error", "err", "perplexity", "ppl", "wer", "cer", "mse", "mae"))


def format_value(value: float) -> str:
    """How a metric value is printed everywhere (the training script prints final_loss the same way)."""
    return f"{value:.6g}"


def final_value(job_id: int, name: str, *, extremes: bool = False) -> FinalValue | None:
    """The job's final value of ``name`` (with its lowest and highest values when ``extremes``); None when
    it logged none."""
    points = MetricPoint.objects.filter(job_id=job_id, name=name, superseded=False)  # a resume's curve
    rank = 0 if points.filter(rank=0).exists() else points.aggregate(first=Min("rank"))["first"]
    if rank is None:
        return None
    step, value = points.filter(rank=rank).order_by(LAST_FIRST, "-id").values_list("step", "value").first()
    found = points.aggregate(lowest=Min("value"), highest=Max("value")) if extremes else {}
    return FinalValue(name=name, rank=rank, step=step, value=value, **found)


def final_loss(job_id: int) -> FinalValue | None:
    """The job's final loss: the last loss logged by rank 0."""
    return final_value(job_id, LOSS)
