"""The launch spec: every option a job (or a sweep) is launched with, written once.

Every surface reads this table: `manage.py launch` builds its options from it; job files (`ugro launch -f`,
`manage.py launch -f`, `ugro sweep -f`) take its keys; docs/api.md's option table is made from it
(`python -m jobs.spec`); a test checks the `ugro` client's flags, the API's fields and the launch form's
against it (tests/test_job_files.py). A file takes an option under the command line's name
(`nodes: 3`, `time-limit: 2h`, `hang-after: 120`, `sync: ./src`) or the API's (`count`, `hang_after_s`),
and list-valued options as YAML lists (`retry: [oom, node-lost]`) or the command line's comma strings.
Django-free: the bounds live here so that the table, the reader and the docs need no settings.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import math
import posixpath
import shlex
import sys
from dataclasses import dataclass, replace
from typing import Any

import yaml

# Bounds of the numbers a launch takes (forms, CLI, API and build_job all read these).
PRIORITY_MIN, PRIORITY_MAX = 0, 100  # the api helper's per-role bounds narrow this, never widen it
NODES_MAX = 1024
GPUS_MAX = NODES_MAX * 64
EPOCHS_MAX = 1_000_000
LR_MIN, LR_MAX = 0.0, 100.0  # 0 passes the fields' bounds; build_job refuses it in its own words
NPROC_MAX = 64
BATCH_MAX = 1_000_000
ATTEMPTS_MAX = 100
HANG_MAX_S = 30 * 86400.0
TRIALS_MAX = 1000
SEED_MAX = 2**31 - 1
MAX_FILE_BYTES = 64 * 1024

RETRY_NAMES = "node-lost, rendezvous, oom, script-error, hang, nccl, killed, timeout, unknown"
RECOVERY = "recovery (docs/recovery.md)"
CODE = "code on every node (docs/sync.md)"


class SpecError(ValueError):
    """A job file that cannot be read: one line that names the key and what it takes."""


@dataclass(frozen=True)
class Option:
    """One launch option on every surface: its flag, its file keys, its API field, what it takes."""

    field: str  # the API's field, the launch form's, and the key of a resolved spec
    flag: str  # the command line's: `--nodes`; `--` for the script's own arguments; NAME for a positional
    kind: str  # what the value is: see WHAT
    default: Any = None
    help: str = ""
    example: Any = None  # a value as a job file writes it
    low: float | None = None
    high: float | None = None
    keys: tuple[str, ...] = ()  # the file's names, the first the one written; default: the flag's name
    section: str = ""  # the group --help shows it in
    in_files: bool = True
    shown_default: str = ""  # what no value means, where the default alone does not say
    choices: tuple[str, ...] = ()

    @property
    def file_keys(self) -> tuple[str, ...]:
        """The keys a job file may give it under: the command line's name (dashes as underscores), then the
        API's; a dashed spelling of each is taken too (`time-limit`)."""
        if not self.in_files:
            return ()
        named = self.keys or (self.flag.lstrip("-").replace("-", "_"),)
        return tuple(dict.fromkeys((*named, self.field)))

    @property
    def key(self) -> str:
        """The key a resolved spec is written under."""
        return self.file_keys[0]

    def what(self) -> str:
        """What the option takes, in words."""
        bounded = self.low is not None and self.high is not None
        span = f" from {_shown(self.low)} to {_shown(self.high)}" if bounded else ""
        return {
            "name": "a name: letters, digits, '.', '_' or '-'",
            "text": "text",
            "int": f"a whole number{span}",
            "count": f"a whole number of nodes{span}",
            "float": f"a number{span}",
            "bool": "true or false",
            "names": "a list of node names",
            "args": "a list of the script's arguments (or one line, split like a shell)",
            "paths": "a list of paths on the nodes",
            "kinds": f"a list of failure kinds ({RETRY_NAMES})",
            "weights": "node: weight pairs, or auto",
            "duration": "a duration: 90m, 2h, 1d or H:MM:SS",
            "size": "a size: 10G, 512M",
            "keep": "LATEST[,best:METRIC:K]: the newest checkpoints, and the best by a metric",
            "dir": "a directory, relative to the job file",
            "choice": " or ".join(self.choices),
            "grid": "parameter: [values] pairs (or NAME=V1,V2 items)",
            "random": "parameter: distribution pairs: uniform(a,b), loguniform(a,b), int(a,b), choice(x,y)",
        }[self.kind]

    def example_line(self, key: str = "") -> str:
        """`key: example` as a job file writes it."""
        text = yaml.safe_dump({key or self.key: self.example}, default_flow_style=True, width=1000, sort_keys=False)
        return text.strip()[1:-1]

    def read(self, value: Any, key: str = "") -> Any:
        """The value as the API takes it, from a job file's; SpecError naming what it takes, with an example."""
        try:
            return _read(self, value)
        except (TypeError, ValueError):
            key = key or self.key
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise SpecError(f"{key}: takes {self.what()}, e.g. `{self.example_line(key)}`; not {shown}") from None

    def write(self, value: Any) -> Any:
        """The value as a job file writes it (None: nothing to write), from the API's."""
        if value is None or value == self.default or value in ("", [], {}):
            return None
        if self.kind == "kinds":
            return [k.strip() for k in str(value).split(",") if k.strip()]
        if self.kind == "weights" and value != "auto":
            try:
                return {name.strip(): _number(w) for name, _, w in (p.partition("=") for p in value.split(","))}
            except ValueError:
                return value  # not checked yet: the launch names what is wrong with it
        return list(value) if isinstance(value, list | tuple) else value


def _shown(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


def _scalar_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    raise TypeError(value)


def _number(text: str) -> int | float:
    number = float(text)
    return int(number) if number.is_integer() else number


def _whole(value: Any, option: Option) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(value)
    number = int(value)
    if option.low is not None and option.high is not None and not option.low <= number <= option.high:
        raise ValueError(number)
    return number


def _read(option: Option, value: Any) -> Any:
    kind = option.kind
    if kind in ("int", "count"):
        return _whole(value, option)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise TypeError(value)
        number = float(value)  # YAML reads 1e-4 as text: the command line's number all the same
        if not math.isfinite(number) or (option.low is not None and not option.low <= number <= option.high):
            raise ValueError(number)
        return number
    if kind == "bool":
        if not isinstance(value, bool):
            raise TypeError(value)
        return value
    if kind in ("name", "text", "duration", "size", "dir", "choice", "keep"):
        text = _scalar_text(value)
        if kind == "choice" and text not in option.choices:
            raise ValueError(text)
        return text
    if kind in ("names", "paths", "args", "kinds"):
        if isinstance(value, list):
            items = [_scalar_text(v) for v in value]
        elif kind == "args":
            items = shlex.split(_scalar_text(value))
        elif kind == "paths":
            items = [_scalar_text(value)]
        else:
            items = [v.strip() for v in _scalar_text(value).split(",") if v.strip()]
        return ",".join(items) if kind == "kinds" else items
    if kind == "weights":
        if isinstance(value, dict):
            return ",".join(f"{name}={_number(_scalar_text(w)):g}" for name, w in value.items())
        return _scalar_text(value)
    if kind in ("grid", "random"):
        if isinstance(value, dict):
            return [f"{name}={_values_text(v) if kind == 'grid' else _scalar_text(v)}" for name, v in value.items()]
        return [_scalar_text(v) for v in value] if isinstance(value, list) else [_scalar_text(value)]
    raise AssertionError(kind)


def _values_text(value: Any) -> str:
    return ",".join(_scalar_text(v) for v in value) if isinstance(value, list) else _scalar_text(value)


def _sweep(option: Option, **changes: Any) -> Option:
    return replace(option, **changes)


# one option a line or two: the table reads as one
# fmt: off
NAME = Option("name", "--name", "name", help="job name (letters, digits, . _ -)", example="llama-ft-3",
              shown_default="required")
COUNT = Option("count", "--nodes", "count", help="how many nodes (default: all enabled)", example=3, low=1,
               high=NODES_MAX, keys=("nodes", "count"), shown_default="all enabled nodes")
NODE_NAMES = Option("nodes", "--node", "names", default=[], help="a node to use (repeatable)",
                    example=["gpu1", "gpu2"], keys=("nodes", "node"))
SCRIPT = Option("script", "--script", "text", default="", help="training script on the nodes",
                example="train/train_production.py", shown_default="the cluster's")
GPUS = Option("gpus", "--gpus", "int", help="GPUs in all, on any nodes (instead of --nodes/--node)", example=4,
              low=1, high=GPUS_MAX, shown_default="whole nodes")
GPUS_PER_NODE = Option("gpus_per_node", "--gpus-per-node", "int", example=1, low=1, high=NPROC_MAX,
                       help="with --nodes K or --node: GPUs on each node (default: the whole node)",
                       shown_default="the whole node")
TIME_LIMIT = Option("time_limit", "--time-limit", "duration", default="", example="6h",
                    help="stop the job (TIMEOUT, SIGTERM then SIGKILL) this long after it starts: 90m, 2h, 1d, "
                    "H:MM:SS (default: the cluster's)", shown_default="the cluster's")
MIN_VRAM = Option("min_vram", "--min-vram", "size", default="", example="10G",
                  help="memory each GPU needs, e.g. 10G (default: learned from earlier runs of the script, if any)",
                  shown_default="learned from earlier runs")
PRIORITY = Option("priority", "--priority", "int", default=0, help="0-100, higher starts first", example=20,
                  low=PRIORITY_MIN, high=PRIORITY_MAX)
EXTRA_ARGS = Option("extra_args", "--", "args", default=[], help="after --: extra arguments for the script",
                    example=["--max-steps", "20000"], keys=("extra_args",))

LAUNCH: tuple[Option, ...] = (
    NAME,
    COUNT,
    NODE_NAMES,
    SCRIPT,
    Option("model", "--model", "text", default="", example="tiny", shown_default="the cluster's"),
    Option("dataset", "--dataset", "text", default="", example="wikitext", shown_default="the cluster's"),
    Option("epochs", "--epochs", "int", example=3, low=1, high=EPOCHS_MAX, shown_default="not passed"),
    Option("lr", "--lr", "float", example=0.0003, low=LR_MIN, high=LR_MAX, shown_default="not passed"),
    GPUS,
    GPUS_PER_NODE,
    TIME_LIMIT,
    MIN_VRAM,
    Option("batch_per_gpu", "--batch-per-gpu", "int", example=16, low=1, high=BATCH_MAX,
           help="the even split's batch per GPU: fills {local_batch} (default: training.batch_size_per_gpu)",
           shown_default="training.batch_size_per_gpu"),
    Option("batch_weights", "--batch-weights", "weights", default="", example={"gpu1": 2, "gpu2": 1},
           help="uneven GPUs: NODE=WEIGHT,... relative speeds, or auto (learned from earlier runs of the script "
           "alone on each node); each rank gets its share of the global batch (docs/uneven-gpus.md)",
           shown_default="an even split"),
    Option("scale_probe", "--scale-probe", "duration", default="", example="60s",
           help="before the run, run its first steps on 1, 2, ... N of its nodes for this long each (outputs "
           "discarded), then run on the fastest count; off: no probe (docs/scaling.md)",
           shown_default="the cluster's training.scale_probe, else off"),
    Option("after", "--after", "text", default="", example="prepare-data",
           help="start only after this job succeeded (a dependency)"),
    Option("nproc_per_node", "--nproc-per-node", "int", example=1, low=1, high=NPROC_MAX,
           shown_default="the node's GPUs"),
    PRIORITY,
    Option("metrics_pattern", "--metrics-pattern", "text", default="", example="^step (?P<step>\\d+)",
           help="regex: the script's lines it matches give their key=value / key: value pairs as metrics"),
    Option("metrics_files", "--metrics-file", "paths", default=[], example=["lightning_logs", "runs/{job}"],
           help="a metrics.csv or TensorBoard event file, or a directory with them, on the nodes (relative to "
           "the workdir; {job} is the job name; repeatable)", keys=("metrics_files", "metrics_file")),
    Option("retry", "--retry", "kinds", default="", example=["node-lost", "oom"], section=RECOVERY,
           help=f"failure kinds resumed automatically: {RETRY_NAMES.replace(' ', '')}"),
    Option("max_attempts", "--max-attempts", "int", example=4, low=1, high=ATTEMPTS_MAX, section=RECOVERY,
           help="most attempts in all", shown_default="3"),
    Option("min_nodes", "--min-nodes", "int", example=2, low=1, high=NODES_MAX, section=RECOVERY,
           help="a node-lost retry may run on this few", shown_default="the nodes it started on"),
    Option("resume_template", "--resume-template", "text", default="", example="--resume-from {checkpoint}",
           section=RECOVERY, help="the script's resume argument (default: --resume-from {checkpoint}; HF: "
           "--resume_from_checkpoint {checkpoint})", shown_default="--resume-from {checkpoint}"),
    Option("checkpoint_glob", "--checkpoint-glob", "text", default="", example="runs/{job}/*.ckpt",
           section=RECOVERY, help="more checkpoints to record: a glob relative to the workdir ({job}: the name)"),
    Option("keep", "--keep", "keep", default="", example="2,best:eval_loss:1", section=RECOVERY,
           help="checkpoints kept: the newest LATEST and the K best by METRIC (lower is better for loss, ppl, "
           "error, wer, cer; :min or :max says it); the others are deleted on every node (docs/recovery.md)",
           shown_default="the cluster's training.keep, else all"),
    Option("batch_template", "--batch-template", "text", default="", section=RECOVERY,
           example="--batch-size {batch} --grad-accum {accum}",
           help="e.g. '--batch-size {batch} --grad-accum {accum}': an OOM retry halves the batch"),
    Option("batch", "--batch", "int", example=8, low=1, high=BATCH_MAX, section=RECOVERY,
           help="per-rank batch for --batch-template"),
    Option("grad_accum", "--grad-accum", "int", example=1, low=1, high=BATCH_MAX, section=RECOVERY,
           help="accumulation for --batch-template"),
    Option("hang_after_s", "--hang-after", "float", example=120, low=1, high=HANG_MAX_S, section=RECOVERY,
           help="seconds without a metric line that make the job HUNG (default 60, or 5x its interval)",
           shown_default="60 s, or 5x the metric interval"),
    Option("sync_upload", "--sync", "dir", default="", example="./src", section=CODE, keys=("sync",),
           help="copy DIR to every node before the ranks start, and start them there (none: not even the "
           "cluster's default); the API takes the digest of the directory the client uploaded",
           shown_default="the cluster's training.sync"),
    Option("data", "--data", "paths", default=[], example=["~/datasets/tiny:tiny", "gpu1:/mnt/models/llama:model"],
           section=CODE, help="SRC[:DEST]: a directory or file on the controller, or NODE:PATH on one node, put at "
           "DEST in the job's directory ({job_dir}/DEST) on every node before the ranks start, read-only "
           "(docs/data.md; repeatable)", shown_default="the cluster's training.data"),
    Option("packages", "--packages", "text", default="", example="~/project/requirements.txt", section=CODE,
           help="a lock file on the controller (a pinned requirements.txt, a uv.lock beside its pyproject.toml, or a "
           "pylock.toml): its environment is built with uv on every node, the same everywhere, and the ranks "
           "start with its torchrun (docs/envs.md; none: not even the cluster's default)",
           shown_default="the cluster's training.packages"),
    Option("allow_mismatch", "--allow-mismatch", "bool", default=False, example=True, section=CODE,
           help="start even if the script's sha256 differs between nodes"),
    EXTRA_ARGS,
    Option("dry_run", "--dry-run", "bool", default=False, in_files=False,
           help="print each rank's exact command line and environment; create and start nothing"),
)

SWEEP: tuple[Option, ...] = (
    _sweep(NAME, flag="NAME", keys=("name",), help="sweep name; trials are NAME-001, NAME-002, ...",
           example="lr-search"),
    SCRIPT,
    Option("grid", "--grid", "grid", default=[], example={"lr": [0.0001, 0.0003]}, help="NAME=V1,V2,... (repeatable)"),
    Option("random", "--random", "random", default=[], example={"lr": "loguniform(1e-5,1e-2)"},
           help="NAME=uniform(a,b) | loguniform(a,b) | int(a,b) | choice(x,y,...) (repeatable)"),
    Option("trials", "--trials", "int", example=20, low=1, high=TRIALS_MAX, help="random draws (per grid point)",
           shown_default="1"),
    Option("seed", "--seed", "int", default=0, example=7, low=0, high=SEED_MAX,
           help="random seed (a sweep is reproducible)"),
    Option("max_concurrent", "--max-concurrent", "int", example=2, low=1, high=TRIALS_MAX,
           help="trials running at once", shown_default="no bound"),
    Option("metric", "--metric", "text", default="loss", example="eval_loss",
           help="the metric that ranks trials (default loss)"),
    Option("mode", "--mode", "choice", default="min", example="max", choices=("min", "max")),
    Option("median_stop", "--median-stop", "bool", default=False, example=True,
           help="stop a running trial whose best metric is worse than the median of the others at the same step"),
    Option("median_min_steps", "--median-min-steps", "int", default=10, example=100, low=0, high=10**12,
           help="with --median-stop: no trial is stopped before this step"),
    _sweep(GPUS, help="GPUs per trial, on any nodes"),
    _sweep(COUNT, field="nodes", keys=("nodes",), help="nodes per trial", example=1),
    GPUS_PER_NODE,
    TIME_LIMIT,
    MIN_VRAM,
    PRIORITY,
    _sweep(EXTRA_ARGS, help="after --: arguments every trial's script gets"),
)
# fmt: on
FIELDS = frozenset(o.field for o in LAUNCH)


def defaults(options: tuple[Option, ...]) -> dict[str, Any]:
    """Every field's value when nothing gives one (the name has none)."""
    return {o.field: copy.copy(o.default) for o in options if o.field != "name"}


def _keys(options: tuple[Option, ...]) -> dict[str, list[Option]]:
    found: dict[str, list[Option]] = {}
    for option in options:
        for key in option.file_keys:
            found.setdefault(key, []).append(option)
    return found


def _chosen(candidates: list[Option], value: Any) -> Option:
    """`nodes: 3` is a count, `nodes: [gpu1, gpu2]` (or `nodes: gpu1`) names them."""
    if len(candidates) == 1:
        return candidates[0]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    counts = number or isinstance(value, str) and value.isdigit()
    return next(o for o in candidates if (o.kind == "count") == counts)


def read_values(loaded: Any, options: tuple[Option, ...], what: str = "job file") -> tuple[dict[str, Any], str]:
    """A job file's mapping as the API's fields, and its `sync:` directory as written ('' for none);
    SpecError in one line (`unknown key 'nodez': did you mean 'nodes'?`)."""
    if loaded is None:
        return {}, ""
    if not isinstance(loaded, dict):
        raise SpecError(f"{what}: write options as `key: value` lines, e.g. `{options[0].example_line()}`")
    keys = _keys(options)
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    sync = ""
    for raw, value in loaded.items():
        key = str(raw)
        candidates = keys.get(key.replace("-", "_"))
        if not candidates:
            wanted, written = key.replace("-", "_"), list(dict.fromkeys(o.key for o in options if o.in_files))
            close = difflib.get_close_matches(wanted, written, n=1, cutoff=0.6) or difflib.get_close_matches(
                wanted, list(keys), n=1, cutoff=0.6
            )  # the names files are written with first: `nodez` means `nodes`, not the alias `node`
            hint = f"did you mean '{close[0]}'?" if close else f"the keys are {', '.join(written)}"
            raise SpecError(f"{what}: unknown key {key[:60]!r}: {hint}")
        if value is None:  # `key:` with nothing after it: as if it were not there
            continue
        option = _chosen(candidates, value)
        if option.field in given:
            raise SpecError(f"{what}: {given[option.field]!r} and {key!r} both give {option.key}: keep one")
        given[option.field] = key
        try:
            read = option.read(value, key)
        except SpecError as exc:
            if len(candidates) == 1:
                raise SpecError(f"{what}: {exc}") from None
            count, names = sorted(candidates, key=lambda o: o.kind != "count")
            raise SpecError(
                f"{what}: {key}: takes {count.what()} or {names.what()}, e.g. `{count.example_line(key)}` "
                f"or `{names.example_line(key)}`; not {value!r}"[:300]
            ) from None
        if option.kind == "dir" and key.replace("-", "_") != option.field:
            sync = read  # a directory the client uploads (or, on the controller, copies); the API takes its digest
        else:
            values[option.field] = read
    if "nodes" in given and "count" in given and "count" in {o.field for o in options}:
        raise SpecError(f"{what}: {given['count']!r} and {given['nodes']!r}: give a count or names, not both")
    return values, sync


def read_text(text: str, options: tuple[Option, ...], what: str = "job file") -> tuple[dict[str, Any], str]:
    """A job file's text: its values as the API's fields and its `sync:` directory (see read_values)."""
    if len(text.encode()) > MAX_FILE_BYTES:
        raise SpecError(f"{what}: at most {MAX_FILE_BYTES // 1024} KiB")
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise SpecError(f"{what}: not valid YAML{where}") from None
    return read_values(loaded, options, what)


def with_typed(values: dict[str, Any], typed: dict[str, Any]) -> dict[str, Any]:
    """The file's values under the ones typed beside it: a typed --nodes or --node replaces the file's either."""
    if "count" in typed or "nodes" in typed:
        values = {k: v for k, v in values.items() if k not in ("count", "nodes")}
    return {**values, **typed}


def sync_path(sync: str, base: str) -> str:
    """A job file's `sync:` directory, relative to the file's directory `base` (`none` stays none)."""
    if not sync or sync == "none":
        return sync
    return posixpath.normpath(posixpath.join(base, posixpath.expanduser(sync)))


def to_yaml(values: dict[str, Any], options: tuple[Option, ...], sync: str = "") -> str:
    """A resolved spec in the job file's own form: the command line's keys, YAML lists, defaults left out;
    reading it back gives the same spec."""
    out: dict[str, Any] = {}
    for option in options:
        if not option.in_files:
            continue
        key, written = option.key, option.write(values.get(option.field))
        if option.kind == "dir" and sync:
            written = sync
        elif option.kind == "dir" and written is not None:
            key = option.field  # an uploaded directory's digest, under the API's own key
        if written is not None:
            if key in out:
                raise SpecError(f"{key}: give a count or names, not both")
            out[key] = written
    return yaml.safe_dump(out, default_flow_style=None, sort_keys=False, width=1000, allow_unicode=True)


def _cli_type(option: Option) -> Any:
    convert = float if option.kind == "float" else int

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text[:40]!r}: takes {option.what()}, e.g. {option.flag} {option.example}"
            ) from None

    parse.__name__ = option.kind
    return parse


def add_arguments(parser: argparse.ArgumentParser, options: tuple[Option, ...]) -> None:
    """The options as a command's flags and positionals. One not typed is left out of the parsed options
    (argparse.SUPPRESS), so that what is typed is told apart from a default and wins over a job file."""
    groups: dict[str, Any] = {}
    both = {"count", "names"} <= {o.kind for o in options}
    where = parser.add_mutually_exclusive_group() if both else None
    for o in options:
        target = groups.setdefault(o.section, parser.add_argument_group(o.section)) if o.section else parser
        if where is not None and o.kind in ("count", "names"):
            target = where
        extra: dict[str, Any] = {"default": argparse.SUPPRESS, "help": o.help or None}
        if o.flag in ("--", "NAME"):
            nargs = "*" if o.flag == "--" else "?"
            target.add_argument(o.field, nargs=nargs, metavar="ARGS" if o.flag == "--" else "NAME", **extra)
            continue
        if o.kind == "bool":
            extra["action"] = "store_true"
        elif o.kind in ("names", "paths", "grid", "random"):
            extra["action"] = "append"
        elif o.kind in ("int", "count", "float"):
            extra["type"] = _cli_type(o)
        elif o.kind == "choice":
            extra["choices"] = o.choices
        if o.kind not in ("bool", "choice"):
            extra["metavar"] = "DIR" if o.kind == "dir" else o.flag.lstrip("-").replace("-", "_").upper()
        target.add_argument(o.flag, dest="sync" if o.kind == "dir" else o.field, **extra)


def table(options: tuple[Option, ...]) -> str:
    """The options as docs/api.md shows them: option, file key(s), API field, type, default."""
    rows = ["| option | file key(s) | API field | type | default |", "| --- | --- | --- | --- | --- |"]
    for o in options:
        flag = {"--": "`-- ARGS`", "NAME": "`NAME`"}.get(o.flag, f"`{o.flag}`")
        keys = ", ".join(f"`{k}`" for k in o.file_keys) or "(not in files)"
        shown = o.shown_default or ("-" if o.default in (None, "", []) else f"`{str(o.default).lower()}`")
        rows.append(f"| {flag} | {keys} | `{o.field}` | {o.what()} | {shown} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m jobs.spec: the tables docs/api.md shows
    sys.stdout.write(f"{table(LAUNCH)}\n\n{table(SWEEP)}\n")
