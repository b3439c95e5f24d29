from __future__ import annotations

from django.core.management.base import CommandError

from accounts import actions, policy
from accounts.commands import UserCommand
from jobs.energy import job_energies
from jobs.launch import LaunchError, LaunchRequest
from jobs.lifecycle import wait_final
from jobs.limits import parse_duration, parse_size_mb
from jobs.models import Job, Sweep
from jobs.scheduler import request_schedule
from jobs.sweeps import SweepRequest, trial_rows
from ugro_site.celery import NoWorker, require_worker


class Command(UserCommand):
    help = (
        "Create a sweep: one queued job per trial of a grid (--grid lr=1e-4,3e-4) or random search "
        "(--random lr=loguniform(1e-5,1e-2) --trials 20); --show lists its trials, --cancel cancels them."
    )

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        # NAME comes first and the script's arguments after --: argparse must not bind both positionals
        # at NAME (it would, and refuse the arguments after --); intermixed parsing takes options first.
        parser.parse_args = parser.parse_intermixed_args
        return parser

    def add_arguments(self, parser):
        parser.add_argument("name", help="sweep name; trials are NAME-001, NAME-002, ...")
        parser.add_argument("--script", default="", help="training script on the nodes")
        parser.add_argument("--grid", action="append", default=[], help="NAME=V1,V2,... (repeatable)")
        parser.add_argument(
            "--random", action="append", default=[],
            help="NAME=uniform(a,b) | loguniform(a,b) | int(a,b) | choice(x,y,...) (repeatable)",
        )  # fmt: skip
        parser.add_argument("--trials", type=int, help="random draws (per grid point)")
        parser.add_argument("--seed", type=int, default=0, help="random seed (a sweep is reproducible)")
        parser.add_argument("--max-concurrent", type=int, dest="max_concurrent", help="trials running at once")
        parser.add_argument("--metric", default="loss", help="the metric that ranks trials (default loss)")
        parser.add_argument("--mode", default="min", choices=["min", "max"])
        parser.add_argument(
            "--median-stop", action="store_true", dest="median_stop",
            help="stop a running trial whose best metric is worse than the median of the others at the same step",
        )  # fmt: skip
        parser.add_argument("--median-min-steps", type=int, default=10, dest="median_min_steps",
                            help="with --median-stop: no trial is stopped before this step")  # fmt: skip
        parser.add_argument("--gpus", type=int, help="GPUs per trial, on any nodes")
        parser.add_argument("--nodes", type=int, help="nodes per trial")
        parser.add_argument("--gpus-per-node", type=int, dest="gpus_per_node")
        parser.add_argument("--time-limit", default="", dest="time_limit")
        parser.add_argument("--min-vram", default="", dest="min_vram")
        parser.add_argument("--priority", type=int, default=0)
        parser.add_argument("--show", action="store_true", help="list the sweep's trials and their metric")
        parser.add_argument("--cancel", action="store_true", help="cancel every trial not yet ended")
        parser.add_argument("extra", nargs="*", help="after --: arguments every trial's script gets")

    def handle(self, **o):
        if o["show"] or o["cancel"]:
            sweep = Sweep.objects.filter(name=o["name"]).first()
            if sweep is None:
                raise CommandError(f"no sweep named {o['name']!r}")
            return self._cancel(sweep) if o["cancel"] else self._show(sweep)
        try:
            limit = parse_duration(o["time_limit"]) if o["time_limit"] else None
            vram = parse_size_mb(o["min_vram"]) if o["min_vram"] else None
            base = LaunchRequest(
                name="", script=o["script"], count=o["nodes"], gpus=o["gpus"], gpus_per_node=o["gpus_per_node"],
                time_limit_s=limit, min_vram_mb=vram, priority=o["priority"], extra_args=o["extra"],
            )  # fmt: skip
            require_worker()  # before anything is recorded
            sweep = actions.launch_sweep(
                self.user,
                SweepRequest(
                    name=o["name"],
                    base=base,
                    grid=o["grid"],
                    random=o["random"],
                    trials=o["trials"],
                    max_concurrent=o["max_concurrent"],
                    seed=o["seed"],
                    metric=o["metric"],
                    mode=o["mode"],
                    median_stop=o["median_stop"],
                    median_min_steps=o["median_min_steps"],
                ),  # fmt: skip
                self.source,
            )
        except (LaunchError, ValueError, policy.Refused, NoWorker) as exc:
            raise CommandError(str(exc)) from None
        request_schedule()
        n = sweep.trials.count()
        most = f", at most {sweep.max_concurrent} at once" if sweep.max_concurrent else ""
        self.stdout.write(f"sweep {sweep.name} (id {sweep.pk}): {n} trials queued{most}")
        for row in trial_rows(sweep):
            self.stdout.write(f"  {row.job.name}  {_params(row.params)}")

    def _show(self, sweep: Sweep) -> None:
        self.stdout.write(
            f"sweep {sweep.name}: {sweep.metric} ({sweep.mode}){' cancelled' if sweep.cancelled_at else ''}"
        )
        rows = trial_rows(sweep)
        used = job_energies([row.job for row in rows])
        for row in rows:
            final = "-" if row.final is None else f"{row.final:.6g}"
            best = "-" if row.best is None else f"{row.best:.6g}"
            mark = "  <- best" if row.is_best else ""
            energy = used[row.job.pk].text()
            self.stdout.write(f"  {row.job.name:24} {row.job.state:10} final {final:>10} best {best:>10}  "
                              f"energy {energy}  {_params(row.params)}{mark}")  # fmt: skip

    def _cancel(self, sweep: Sweep) -> None:
        try:
            if sweep.trials.filter(state__in=Job.LIVE_STATES + Job.STOPPING_STATES).exists():
                require_worker()  # their processes are the worker's to stop
            stopping = actions.cancel_sweep_as(self.user, sweep, self.source)
        except (policy.Refused, NoWorker) as exc:
            raise CommandError(str(exc)) from None
        for job in stopping:
            wait_final(job)  # the worker stops each trial's processes
        counts: dict[str, int] = {}
        for state in sweep.trials.values_list("state", flat=True):
            counts[state] = counts.get(state, 0) + 1
        self.stdout.write(f"sweep {sweep.name} cancelled: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))


def _params(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())
