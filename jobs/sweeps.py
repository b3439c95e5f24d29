"""Sweeps: one parent and one queued child job per trial (grid or random search), at most K running.

    ugro sweep NAME --script train.py --grid lr=1e-4,3e-4 --grid batch-size=8,16 --max-concurrent 2
    ugro sweep NAME --random lr=loguniform(1e-5,1e-2) --random batch-size=choice(8,16,32) --trials 20

A parameter named like a launch field (lr, epochs, model, dataset) fills that field; any other reaches
the script as `--NAME VALUE`. The scheduler keeps at most max_concurrent trials of a sweep running
(the others wait with reason "quota"); cancelling the sweep cancels every trial not yet ended.
With --median-stop the reconciler stops a running trial that does worse than the median of the others
at the same step (median_stop).
"""

from __future__ import annotations

import itertools
import math
import random
import re
import statistics
from dataclasses import dataclass, replace
from typing import Any

from django.db import transaction
from django.db.models import Max, Min, QuerySet
from django.utils import timezone

from cluster.names import check_name
from metrics.models import MetricPoint

from . import lifecycle
from .launch import LaunchError, LaunchRequest, create_job
from .models import Job, Sweep

MAX_TRIALS = 500
LAUNCH_FIELDS = {"lr": float, "epochs": int, "model": str, "dataset": str}
_PARAM = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
_RANDOM = re.compile(r"(uniform|loguniform|int|choice)\((.*)\)")


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise LaunchError(f"{what}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise LaunchError(f"{what}: {text!r} is not a finite number")
    return value


def _value(text: str) -> Any:
    """A grid value as the user wrote it: an int, a float, else the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def _split(item: str, option: str) -> tuple[str, str]:
    name, sep, rest = item.partition("=")
    name = name.strip()
    if not sep or not rest.strip():
        raise LaunchError(f"{option} {item!r}: write NAME=VALUES")
    if not _PARAM.fullmatch(name):
        raise LaunchError(f"{option} {item!r}: a parameter name is letters, digits, '_' or '-'")
    return name, rest.strip()


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """--grid lr=1e-4,3e-4 --grid batch=8,16 -> {"lr": [0.0001, 0.0003], "batch": [8, 16]}."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        name, rest = _split(item, "--grid")
        values = [_value(v.strip()) for v in rest.split(",") if v.strip()]
        if name in grid:
            raise LaunchError(f"--grid {name} is given twice")
        grid[name] = values
    return grid


def parse_random(items: list[str]) -> dict[str, list]:
    """--random lr=loguniform(1e-5,1e-2) -> {"lr": ["loguniform", 1e-05, 0.01]}; uniform, int and choice too."""
    spec: dict[str, list] = {}
    for item in items:
        name, rest = _split(item, "--random")
        m = _RANDOM.fullmatch(rest.replace(" ", ""))
        if not m:
            raise LaunchError(f"--random {item!r}: use uniform(a,b), loguniform(a,b), int(a,b) or choice(x,y,...)")
        kind, args = m.group(1), [a for a in m.group(2).split(",") if a]
        if kind == "choice":
            if not args:
                raise LaunchError(f"--random {item!r}: choice needs at least one value")
            spec[name] = ["choice", *[_value(a) for a in args]]
            continue
        if len(args) != 2:
            raise LaunchError(f"--random {item!r}: {kind} takes two bounds")
        low, high = (_number(a, f"--random {name}") for a in args)
        if not low < high:
            raise LaunchError(f"--random {item!r}: the lower bound must be below the upper")
        if kind == "loguniform" and low <= 0:
            raise LaunchError(f"--random {item!r}: loguniform bounds must be positive")
        if kind == "int" and (low != int(low) or high != int(high)):
            raise LaunchError(f"--random {item!r}: int bounds must be whole numbers")
        spec[name] = [kind, low, high]
    return spec


def trials(grid: dict[str, list[Any]], rand: dict[str, list], count: int | None, seed: int) -> list[dict[str, Any]]:
    """The parameter sets: the grid's full product, each repeated with `count` random draws (or, with
    only random parameters, `count` draws); seeded, so a sweep is reproducible."""
    rng = random.Random(seed)
    points = [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())] if grid else [{}]
    if rand:
        draws = count or 1
        out = []
        for point in points:
            for _ in range(draws):
                out.append({**point, **{name: _draw(rng, spec) for name, spec in rand.items()}})
        return out
    if count is not None and grid:
        raise LaunchError("--trials is for --random parameters; a grid runs every combination once")
    return points


def _draw(rng: random.Random, spec: list) -> Any:
    kind, *args = spec
    if kind == "choice":
        return rng.choice(args)
    low, high = args
    if kind == "uniform":
        return float(f"{rng.uniform(low, high):.6g}")
    if kind == "loguniform":
        return float(f"{math.exp(rng.uniform(math.log(low), math.log(high))):.6g}")
    return rng.randint(int(low), int(high))


@dataclass
class SweepRequest:
    name: str
    base: LaunchRequest  # what every trial shares (its name is ignored)
    grid: list[str]
    random: list[str]
    trials: int | None = None
    max_concurrent: int | None = None
    seed: int = 0
    metric: str = "loss"
    mode: str = "min"
    median_stop: bool = False
    median_min_steps: int = 10


def trial_request(base: LaunchRequest, name: str, params: dict[str, Any]) -> LaunchRequest:
    """A trial's launch request: launch fields from the params, every other param as --NAME VALUE."""
    fields: dict[str, Any] = {}
    extra = list(base.extra_args)
    for key, value in params.items():
        if key in LAUNCH_FIELDS:
            try:
                fields[key] = LAUNCH_FIELDS[key](value)
            except (TypeError, ValueError):
                raise LaunchError(f"sweep parameter {key}={value!r} is not a valid {key}") from None
        else:
            extra += [f"--{key}", str(value)]
    return replace(base, name=name, extra_args=extra, sweep_params=params, **fields)


def create_sweep(req: SweepRequest) -> Sweep:
    """Validate everything, then record the sweep and all its trials as queued jobs in one transaction
    (all or nothing); raises LaunchError with a one-line reason."""
    try:
        check_name(req.name, "sweep name")
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if len(req.name) > 48:
        raise LaunchError("a sweep name is at most 48 characters (its trials add -NNN)")
    if Sweep.objects.filter(name=req.name).exists():
        raise LaunchError(f"a sweep named {req.name!r} already exists; choose another name")
    if req.max_concurrent is not None and req.max_concurrent < 1:
        raise LaunchError("--max-concurrent must be at least 1")
    if req.trials is not None and not 1 <= req.trials <= MAX_TRIALS:
        raise LaunchError(f"--trials must be between 1 and {MAX_TRIALS}")
    if req.mode not in ("min", "max"):
        raise LaunchError("--mode is min or max")
    grid, rand = parse_grid(req.grid), parse_random(req.random)
    if not grid and not rand:
        raise LaunchError("a sweep needs at least one --grid or --random parameter")
    overlap = set(grid) & set(rand)
    if overlap:
        raise LaunchError(f"parameter {sorted(overlap)[0]} is both --grid and --random")
    points = trials(grid, rand, req.trials, req.seed)
    if len(points) > MAX_TRIALS:
        raise LaunchError(f"the sweep would make {len(points)} trials; at most {MAX_TRIALS}")
    with transaction.atomic():
        sweep = Sweep.objects.create(
            name=req.name, script=req.base.script, max_concurrent=req.max_concurrent, metric=req.metric[:100],
            mode=req.mode, owner=req.base.owner, median_stop=req.median_stop,
            median_min_steps=req.median_min_steps,
            spec={"grid": grid, "random": rand, "trials": req.trials, "seed": req.seed},
            base={"script": req.base.script, "extra_args": req.base.extra_args, "gpus": req.base.gpus,
                  "count": req.base.count, "nodes": req.base.nodes, "gpus_per_node": req.base.gpus_per_node,
                  "time_limit_s": req.base.time_limit_s, "min_vram_mb": req.base.min_vram_mb,
                  "priority": req.base.priority},
        )  # fmt: skip
        base = replace(req.base, sweep=sweep)
        for i, params in enumerate(points, start=1):
            create_job(trial_request(base, f"{req.name}-{i:03d}", params))
    return sweep


def cancel_sweep(sweep: Sweep) -> list[Job]:
    """Cancel every trial that has not ended (queued ones at once, running ones are stopped); returns
    the trials moved to stopping, whose teardown the caller may run or leave to a worker."""
    Sweep.objects.filter(pk=sweep.pk, cancelled_at__isnull=True).update(cancelled_at=timezone.now())
    stopping = []
    for job in sweep.trials.exclude(state__in=Job.ENDED_STATES).order_by("pk"):
        try:
            job = lifecycle.cancel(job)
        except ValueError:  # it ended meanwhile
            continue
        if job.is_stopping:
            stopping.append(job)
    return stopping


@dataclass
class TrialRow:
    job: Job
    params: dict[str, Any]
    final: float | None
    best: float | None
    steps: int | None
    is_best: bool = False


def trial_rows(sweep: Sweep) -> list[TrialRow]:
    """Each trial with its params, final and best value of the sweep's metric, the best trial marked, in a
    fixed number of queries. Final: the last value rank 0 logged (else the lowest rank), as every page and
    command shows a run's final value (metrics/final.py); best: the lowest (mode min) or highest of any rank."""
    jobs = list(sweep.trials.select_related("current").order_by("pk"))
    points = MetricPoint.objects.filter(job__in=jobs, name=sweep.metric)
    best_of = min if sweep.mode == "min" else max
    agg: dict[int, dict] = {}
    rows_seen = points.values_list("job_id", "rank", "step", "value").order_by("job_id", "rank", "step", "id")
    for job_id, rank, step, value in rows_seen.iterator():
        a = agg.setdefault(job_id, {"rank": rank, "step": step, "final": value, "best": value})
        if rank == a["rank"]:  # ordered by rank: the first rank seen is the lowest
            a["step"], a["final"] = step, value
        a["best"] = best_of(a["best"], value)
    rows = []
    for job in jobs:
        a = agg.get(job.pk)
        if a:
            rows.append(TrialRow(job, job.sweep_params, a["final"], a["best"], a["step"]))
        else:
            rows.append(TrialRow(job, job.sweep_params, None, None, None))
    scored = [r for r in rows if r.final is not None]
    if scored:
        best_of(scored, key=lambda r: r.final).is_best = True
    return rows


MEDIAN_MIN_OTHERS = 2  # the median of fewer trials says too little


def median_stopping() -> QuerySet[Sweep]:
    """The sweeps the median stopping rule applies to now: they asked for it, and a trial runs."""
    return Sweep.objects.filter(median_stop=True, cancelled_at__isnull=True, trials__state=Job.State.RUNNING).distinct()


def median_stop(sweeps: list[Sweep] | None = None) -> list[str]:
    """The median stopping rule, for sweeps that asked for it: a running trial past median_min_steps
    whose best metric so far is worse than the median of the other trials' best up to the same step
    (those that reached it) is cancelled, the reason saying so. Returns the trials stopped."""
    stopped = []
    for sweep in sweeps if sweeps is not None else median_stopping():
        points = MetricPoint.objects.filter(job__sweep=sweep, name=sweep.metric)
        best_fn = Min if sweep.mode == "min" else Max
        reached = dict(points.values("job").annotate(last=Max("step")).values_list("job", "last"))
        for trial in sweep.trials.filter(state=Job.State.RUNNING):
            step = reached.get(trial.pk)
            if step is None or step < sweep.median_min_steps:
                continue
            others = [j for j, last in reached.items() if j != trial.pk and last >= step]
            if len(others) < MEDIAN_MIN_OTHERS:
                continue
            best = dict(
                points.filter(job__in=[*others, trial.pk], step__lte=step)
                .values("job")
                .annotate(best=best_fn("value"))
                .values_list("job", "best")
            )
            median = statistics.median(best[j] for j in others if j in best)
            mine = best.get(trial.pk)
            worse = mine is not None and (mine > median if sweep.mode == "min" else mine < median)
            if worse:
                reason = (f"stopped early by the median rule: best {sweep.metric} {mine:.6g} by step {step}, "
                          f"the median of {len(others)} other trials is {median:.6g}")  # fmt: skip
                lifecycle.cancel(trial, reason)
                stopped.append(trial.name)
    return stopped
