"""`ugro`: launch, watch and stop training jobs on a UGRO server from any machine (exit codes: README)."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import time

from . import __version__, manifest
from .http import EXIT_FAILED, EXIT_OK, EXIT_REFUSED, EXIT_USAGE, ApiError, Client, token_path

GROUPS = [
    ("Jobs", [
        ("launch", "queue a job on the cluster's nodes and follow it (--detach: return at once)"),
        ("status", "recent jobs as a table, or one job: ranks, nodes, exit codes, the failure explained"),
        ("logs", "a job's log lines, all ranks merged or one (--follow until it ends)"),
        ("results", "config, exit codes, final metrics, checkpoints, log files"),
        ("cancel", "stop every process of a job on every node"),
        ("resume", "a new attempt of a failed or cancelled job, from its checkpoint"),
        ("queue", "queued jobs in the order they will start"),
        ("sweep", "a grid or random search, one job per trial; --show, --cancel"),
        ("serve", "serve a job's checkpoint: N engine replicas behind /serve/NAME/v1/; --list, --stop"),
    ]),
    ("Cluster", [
        ("health", "every node's health; exit 1 if one is not healthy"),
        ("alerts", "open alerts (--all: resolved ones and events too)"),
        ("drain", "place no new job on a node (operators)"),
        ("undrain", "place jobs on a drained node again (operators)"),
        ("import_cluster", "import cluster.yaml: nodes and settings, all or nothing (operators)"),
        ("export_cluster", "the cluster as cluster.yaml, to stdout or a file"),
        ("trust", "pin the SSH host key a node offers now (operators)"),
        ("node", "node add [USER@]HOST[:PORT]: add a machine by probing it; node probe NAME: read it again; "
                 "node disk NAME: what a node's store holds and why; node envs NAME: its Python environments; "
                 "node sleep NAME / node wake NAME: put it to sleep or wake it now (operators)"),
        ("preflight", "the checks every launch runs first, on all or the given nodes"),
        ("netcheck", "the network between all or the given nodes: interfaces, bus bandwidth, latency"),
    ]),
    ("Account", [
        ("whoami", "the account, role and token scope the client acts as"),
        ("audit", "who did what, when, from where (operators)"),
        ("token", "your API tokens: create NAME [--scope S] [--save], list, revoke PREFIX"),
    ]),
]  # fmt: skip
FOLLOW_POLL_S = 0.5
WAIT_POLL_S = 2.0  # how often a followed queued job asks the queue why it waits (a whole plan per ask)
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE: what the shell reports for a program whose reader went away (head)
CANCEL_WAIT_S = 120.0
SERVE_UPDATE_WAIT_S = 900.0  # a rolling update starts each new replica (a cold start) and drains an old one
EXIT_STATES = {"succeeded": 0, "failed": 1, "cancelled": 2}
NOT_ENDED_EXIT = 3


class Parser(argparse.ArgumentParser):
    """argparse errors as one line and where to look, exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        name = self.prog.split(" ", 1)[1] if " " in self.prog else ""
        where = f"ugro {name} --help" if name else "ugro help"
        sys.stderr.write(f"{self.prog}: {message} (see `{where}`)\n")
        sys.exit(EXIT_USAGE)


def build_parser() -> Parser:
    parser = Parser(prog="ugro", add_help=False, description="UGRO's client: jobs and nodes on a UGRO server.")
    parser.add_argument("-h", "--help", action="store_true", dest="top_help")
    parser.add_argument("--version", action="store_true", help="the client's and the server's versions")
    sub = parser.add_subparsers(dest="command", parser_class=Parser, metavar="COMMAND")
    sub.add_parser("help", help="this list")

    p = sub.add_parser("launch", help="queue a job and follow it")
    p.add_argument("--file", "-f", help="a job file (YAML: these options by name, docs/api.md); typed ones win")
    p.add_argument("--name", help="job name (letters, digits, . _ -); required unless the job file names it")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--nodes", type=int, dest="count", help="how many nodes (default: all enabled)")
    where.add_argument("--node", action="append", default=[], dest="nodes", help="a node to use (repeatable)")
    p.add_argument("--script", default="", help="training script on the nodes (default: the cluster's)")
    p.add_argument("--model", default="")
    p.add_argument("--dataset", default="")
    p.add_argument("--epochs", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--gpus", type=int, help="GPUs in all, on any nodes (instead of --nodes/--node)")
    p.add_argument("--gpus-per-node", type=int, dest="gpus_per_node", help="with --nodes K: GPUs on each node")
    p.add_argument("--time-limit", default="", dest="time_limit", help="e.g. 90m, 2h, 1d (default: the cluster's)")
    p.add_argument("--min-vram", default="", dest="min_vram", help="memory each GPU needs, e.g. 10G")
    p.add_argument("--after", default="", help="start only after this job succeeded")
    p.add_argument("--nproc-per-node", type=int, dest="nproc_per_node")
    p.add_argument("--priority", type=int, default=0, help="0-100 (launchers: up to the server's bound)")
    p.add_argument("--metrics-pattern", default="", dest="metrics_pattern")
    p.add_argument("--metrics-file", action="append", default=[], dest="metrics_files")
    p.add_argument("--data", action="append", default=[], metavar="SRC[:DEST]",
                   help="a directory or file on the controller, or NODE:PATH, at {job_dir}/DEST on every node")
    p.add_argument("--packages", default="", metavar="FILE",
                   help="a lock file on the controller (requirements.txt, uv.lock, pylock.toml): its environment on "
                   "every node (docs/envs.md)")
    p.add_argument("--batch-per-gpu", type=int, dest="batch_per_gpu", help="the even split's batch per GPU")
    p.add_argument("--batch-weights", default="", dest="batch_weights", help="NODE=WEIGHT,... or auto")
    p.add_argument("--scale-probe", default="", dest="scale_probe", metavar="DURATION",
                   help="run the first steps on 1..N nodes this long each, then on the fastest count; or off")
    rec = p.add_argument_group("recovery (docs/recovery.md)")
    rec.add_argument("--retry", default="", help="failure kinds resumed automatically, e.g. node-lost,oom")
    rec.add_argument("--max-attempts", type=int, dest="max_attempts", help="most attempts in all")
    rec.add_argument("--min-nodes", type=int, dest="min_nodes", help="a node-lost retry may run on this few")
    rec.add_argument("--resume-template", default="", dest="resume_template", help="e.g. '--resume-from {checkpoint}'")
    rec.add_argument("--checkpoint-glob", default="", dest="checkpoint_glob", help="more checkpoints to record")
    rec.add_argument("--keep", default="", help="checkpoints kept: LATEST[,best:METRIC:K], e.g. 2,best:eval_loss:1")
    rec.add_argument("--batch-template", default="", dest="batch_template", help="e.g. '--batch-size {batch}'")
    rec.add_argument("--batch", type=int, help="per-rank batch for --batch-template")
    rec.add_argument("--grad-accum", type=int, dest="grad_accum", help="accumulation for --batch-template")
    rec.add_argument("--hang-after", type=float, dest="hang_after_s", help="seconds without a metric line: HUNG")
    code = p.add_argument_group("code on every node (docs/sync.md)")
    code.add_argument("--sync", default="", metavar="DIR",
                      help="upload DIR (.gitignore respected); the ranks start in its copy on every node")  # fmt: skip
    code.add_argument("--allow-mismatch", action="store_true", dest="allow_mismatch",
                      help="start even if the script's sha256 differs between nodes")  # fmt: skip
    p.add_argument("--detach", action="store_true", help="return once the job is queued")
    p.add_argument("--dry-run", action="store_true", dest="dry_run", help="print each rank's exact command only")
    p.add_argument("--json", action="store_true", help="the queued job as JSON (with --detach)")
    p.add_argument("extra", nargs="*", help="after --: extra arguments for the script")

    p = sub.add_parser("status", help="jobs, or one job")
    p.add_argument("name", nargs="?")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--exit-code", action="store_true", dest="exit_code",
                   help="exit 0 succeeded, 1 failed, 2 cancelled, 3 not ended")  # fmt: skip
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("logs", help="a job's log lines")
    p.add_argument("name")
    p.add_argument("--rank", type=int)
    p.add_argument("--tail", type=int, default=200, help="the last N lines first (default 200)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")
    p.add_argument("--attempt", type=int, help="an earlier attempt's lines (default: the current one)")
    p.add_argument("--json", action="store_true", help="one JSON object per line: time, rank, text")

    for name in ("results", "cancel"):
        p = sub.add_parser(name, help=dict(dict(GROUPS)["Jobs"])[name])
        p.add_argument("name")
        p.add_argument("--json", action="store_true")
        if name == "cancel":
            p.add_argument("--no-wait", action="store_true", dest="no_wait", help="return once it is cancelling")
    p = sub.add_parser("resume", help="a new attempt of a job, followed to its end like launch")
    p.add_argument("name")
    p.add_argument("--from", dest="from_step", default="latest", help="a checkpoint step, latest, or scratch")
    p.add_argument("--nodes", nargs="+", metavar="NODE", help="run the new attempt on these nodes (a,b or a b)")
    p.add_argument("--detach", action="store_true", help="return once the new attempt is queued")
    p.add_argument("--json", action="store_true", help="the queued attempt as JSON (with --detach)")
    p = sub.add_parser("sweep", help="a grid or random search")
    p.add_argument("name", nargs="?", help="sweep name; trials are NAME-001, NAME-002, ... (or in the file)")
    p.add_argument("--file", "-f", help="a sweep file (YAML: these options by name, docs/api.md); typed ones win")
    p.add_argument("--script", default="")
    p.add_argument("--grid", action="append", default=[], help="NAME=V1,V2,... (repeatable)")
    p.add_argument("--random", action="append", default=[], help="NAME=loguniform(a,b) ... (repeatable)")
    p.add_argument("--trials", type=int, help="random draws (per grid point)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrent", type=int, dest="max_concurrent")
    p.add_argument("--metric", default="loss")
    p.add_argument("--mode", default="min", choices=["min", "max"])
    p.add_argument("--median-stop", action="store_true", dest="median_stop")
    p.add_argument("--median-min-steps", type=int, default=10, dest="median_min_steps")
    p.add_argument("--gpus", type=int)
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int, dest="gpus_per_node")
    p.add_argument("--time-limit", default="", dest="time_limit")
    p.add_argument("--min-vram", default="", dest="min_vram")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--show", action="store_true", help="its trials, their state and metric")
    p.add_argument("--cancel", action="store_true", help="cancel every trial not yet ended")
    p.add_argument("--json", action="store_true")
    p.add_argument("extra", nargs="*", help="after --: arguments every trial's script gets")
    p = sub.add_parser("serve", help="serve a job's checkpoint behind one OpenAI-compatible endpoint")
    p.add_argument("name", nargs="?", help="the service's name: its endpoint is /serve/NAME/v1/ (or in the file)")
    p.add_argument("--file", "-f", help="a service file (YAML: these options by name, docs/serving.md); typed ones win")
    p.add_argument("--from", dest="source", metavar="JOB[:STEP|latest]", help="the checkpoint to serve")
    p.add_argument("--replicas", type=int, help="how many start (default: --min-replicas, at least 1)")
    p.add_argument("--gpus-per-replica", type=int, dest="gpus_per_replica", help="default 1")
    p.add_argument("--engine", choices=["transformers", "vllm", "sglang", "custom"], help="default transformers")
    p.add_argument("--command", dest="engine_command", help="with --engine custom: {model} {host} "
                   "{port} {gpus} {name} {python}")  # fmt: skip
    p.add_argument("--min-replicas", type=int, dest="min_replicas", help="0: sleeps when idle, wakes on a request")
    p.add_argument("--max-replicas", type=int, dest="max_replicas", help="added with the load up to this")
    p.add_argument("--target-outstanding", type=int, dest="target_outstanding",
                   help="requests in flight per replica above which another is added (default 4)")  # fmt: skip
    p.add_argument("--idle-after", dest="idle_after", help="with --min-replicas 0: sleep after this long idle (15m)")
    p.add_argument("--cold-start-timeout", dest="cold_start_timeout",
                   help="how long a request waits for a sleeping service (default: the engine's)")  # fmt: skip
    p.add_argument("--stop", action="store_true", help="stop it: no process left, its GPUs free")
    p.add_argument("--list", action="store_true", help="every service and each replica's state")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("queue", help="queued jobs")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("health", help="node health")
    p.add_argument("--json", action="store_true")
    for name in ("drain", "undrain"):
        p = sub.add_parser(name, help=name)
        p.add_argument("node")
        p.add_argument("--json", action="store_true")
    p = sub.add_parser("preflight", help="pre-flight checks")
    p.add_argument("--nodes", nargs="+", default=[], metavar="NODE", help="a,b or a b (default: all enabled)")
    p.add_argument("--script", default="", help="training script (default: the cluster's)")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("netcheck", help="measure the network between nodes")
    p.add_argument("--nodes", nargs="+", default=[], metavar="NODE", help="a,b or a b (default: all enabled)")
    p.add_argument("--sizes", default="", help="all_reduce sizes in MB, e.g. 1,16,64 (the default)")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("token", help="your API tokens")
    verbs = p.add_subparsers(dest="verb", required=True, parser_class=Parser)
    v = verbs.add_parser("create", help="a new token, printed once")
    v.add_argument("name", help="what it is for, e.g. laptop")
    v.add_argument("--scope", choices=["read", "launch", "operate"], default="read",
                   help="at most your own token's scope")  # fmt: skip
    v.add_argument("--save", nargs="?", const="", metavar="FILE",
                   help="also write it to FILE (default ~/.config/ugro/token, mode 0600)")  # fmt: skip
    v.add_argument("--json", action="store_true")
    v = verbs.add_parser("list", help="your tokens")
    v.add_argument("--json", action="store_true")
    v = verbs.add_parser("revoke", help="revoke one of your tokens by its prefix")
    v.add_argument("prefix")
    v.add_argument("--json", action="store_true")
    p = sub.add_parser("alerts", help="open alerts")
    p.add_argument("--all", action="store_true", dest="show_all", help="resolved ones and INFO events too")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("import_cluster", help="import cluster.yaml")
    p.add_argument("path", help="cluster.yaml to import")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("export_cluster", help="the cluster as cluster.yaml")
    p.add_argument("path", nargs="?", help="file to write (default: stdout)")
    p.add_argument("--json", action="store_true", help="the same cluster as JSON")
    p = sub.add_parser("trust", help="pin a node's SSH host key")
    p.add_argument("node")
    p.add_argument("--fingerprint", default="", help="pin only if the node's key has this SHA256 fingerprint")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("node", help="add [USER@]HOST[:PORT], probe NAME, disk NAME, envs NAME, sleep NAME, wake NAME")
    verbs = p.add_subparsers(dest="verb", required=True, parser_class=Parser)
    v = verbs.add_parser("add", help="add a machine: pin its host key, read its GPUs, CPUs, RAM, disk, Pythons, route")
    v.add_argument("target", help="[USER@]HOST[:PORT]")
    v.add_argument("--name", default="", help="the node's name (default: HOST as typed)")
    v.add_argument("--key", default="", help="the private key to log in with, a path on the UGRO server")
    v.add_argument("--workdir", default="", help="where its ranks start (default: paths.project_base, else ~/ugro)")
    v.add_argument("--fingerprint", default="", help="add it only if its host key has this SHA256 fingerprint")
    v.add_argument("--json", action="store_true")
    v = verbs.add_parser("probe", help="read its GPUs, CPUs, RAM, disk, Pythons and route again; says what changed")
    v.add_argument("node")
    v.add_argument("--json", action="store_true")
    v = verbs.add_parser("disk", help="what its store holds and why: size against its limit, free disk, each item")
    v.add_argument("node")
    v.add_argument("--json", action="store_true")
    v = verbs.add_parser("envs", help="its Python environments (--packages): size, last use, the jobs that name them")
    v.add_argument("node")
    v.add_argument("--json", action="store_true")
    v = verbs.add_parser("sleep", help="put it to sleep now (its power: block's sleep command; operators)")
    v.add_argument("node")
    v.add_argument("--json", action="store_true")
    v = verbs.add_parser("wake", help="wake it now (its magic packet or wake command); awake when it answers")
    v.add_argument("node")
    v.add_argument("--json", action="store_true")
    p = sub.add_parser("whoami", help="account, role, scope")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("audit", help="the audit log")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--action", dest="what")
    p.add_argument("--user")
    p.add_argument("--json", action="store_true")
    return parser


def usage() -> str:
    lines = ["usage: ugro COMMAND [options]   (ugro COMMAND --help for its options)", ""]
    for title, commands in GROUPS:
        lines.append(f"{title}:")
        lines += [f"  {name:9} {text}" for name, text in commands]
        lines.append("")
    lines.append("Server: UGRO_URL (default http://127.0.0.1:8099); token: UGRO_TOKEN or ~/.config/ugro/token.")
    return "\n".join(lines)


def parse(argv: list[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The command line; what follows `--` is the script's (`extra`), after a command's own positionals too
    (`ugro sweep NAME --grid ... -- --max-steps 5`)."""
    parser = parser or build_parser()
    extra = None
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if extra is not None:
        if not hasattr(args, "extra"):
            parser.error(f"unrecognized arguments: -- {' '.join(extra)}")
        args.extra = [*args.extra, *extra]
    if args.command in ("launch", "sweep", "serve"):  # which options were typed: they win over a job file's
        args.given = set(vars(_parse_typed(argv, args.command))) | ({"extra"} if extra else set())
    return args


def _parse_typed(argv: list[str], command: str) -> argparse.Namespace:
    """The command's options as typed, without defaults (a parse with every default suppressed)."""
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for option in action.choices[command]._actions:
                option.default = argparse.SUPPRESS
    typed = parser.parse_args(argv)
    return argparse.Namespace(**{k: v for k, v in vars(typed).items() if k not in ("command", "top_help", "version")})


MAX_JOB_FILE = 64 * 1024


def read_text_file(path: str, limit: int) -> str:
    """A UTF-8 file of at most `limit` bytes (sent to the server), or ApiError in one line."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise ApiError(f"cannot read {path}: {exc.strerror}", EXIT_USAGE) from None
    if len(data) > limit:
        raise ApiError(f"{path} is larger than {limit // 1024} KiB", EXIT_USAGE)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(f"{path} is not UTF-8 text", EXIT_USAGE) from None


def with_file(a, fields: list[tuple[str, str]], body: dict) -> dict:
    """The request body: every field, or with -f the file's text and only the options typed beside it."""
    if not a.file:
        return body
    text = read_text_file(a.file, MAX_JOB_FILE)
    typed = {key: body[key] for key, dest in fields if dest in a.given}
    return {"spec": text, **typed, **({"dry_run": True} if body.get("dry_run") else {})}


def main(argv: list[str] | None = None) -> int:
    """The `ugro` console script; a reader that goes away (`ugro status | head -1`) ends it quietly."""
    try:
        try:
            return run(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, inside the try, not at exit as a traceback
    except BrokenPipeError:
        # the signal module docs' "Note on SIGPIPE": what is still buffered goes nowhere, no second error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE_CLOSED


def run(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.version:
        return show_version()
    if args.command in (None, "help") or args.top_help:
        print(usage())
        return EXIT_OK
    try:
        return COMMANDS[args.command](Client(), args)
    except ApiError as exc:
        sys.stderr.write(f"ugro {args.command}: {exc}\n")
        return exc.code
    except KeyboardInterrupt:
        return 130


def show_version() -> int:
    """`ugro --version`: this client's version and the server's, a warning when they differ."""
    print(f"ugro client {__version__}")
    try:
        client = Client()
        server = client.get("controller").get("version")
    except ApiError as exc:
        sys.stderr.write(f"ugro --version: the server's version is unknown: {exc}\n")
        return exc.code
    print(f"UGRO server {server or 'unknown (older than 0.1.0)'} at {client.url}")
    if server != __version__:
        sys.stderr.write(f"ugro: warning: client {__version__} and server {server or 'unknown'} differ; "
                         "install the client from the server's checkout\n")  # fmt: skip
    return EXIT_OK


def emit_json(data) -> None:
    print(json.dumps(data, indent=2))


def age(seconds: float) -> str:
    seconds = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def jobs_table(jobs: list[dict]) -> list[str]:
    rows = [f"{'NAME':24} {'STATE':10} {'PROGRESS':>8} {'NODES':24} {'AGE':>5} OWNER"]
    for j in jobs:
        prog = f"{j['progress']:.0f}%" if j.get("progress") is not None else "-"
        nodes = ",".join(j["nodes"]) or "-"
        rows.append(f"{j['name'][:24]:24} {j['state']:10} {prog:>8} {nodes[:24]:24} {age(j['age_s']):>5} "
                    f"{j['owner'] or '-'}")  # fmt: skip
    return rows


# the API's launch fields and the options that give them
LAUNCH_FIELDS = [
    ("name", "name"), ("nodes", "nodes"), ("count", "count"), ("script", "script"), ("model", "model"),
    ("dataset", "dataset"), ("epochs", "epochs"), ("lr", "lr"), ("nproc_per_node", "nproc_per_node"),
    ("priority", "priority"), ("extra_args", "extra"), ("metrics_pattern", "metrics_pattern"),
    ("metrics_files", "metrics_files"), ("dry_run", "dry_run"), ("gpus", "gpus"), ("gpus_per_node", "gpus_per_node"),
    ("time_limit", "time_limit"), ("min_vram", "min_vram"), ("after", "after"), ("batch_per_gpu", "batch_per_gpu"),
    ("batch_weights", "batch_weights"), ("retry", "retry"), ("max_attempts", "max_attempts"),
    ("min_nodes", "min_nodes"), ("resume_template", "resume_template"), ("checkpoint_glob", "checkpoint_glob"),
    ("keep", "keep"),
    ("batch_template", "batch_template"), ("batch", "batch"), ("grad_accum", "grad_accum"),
    ("hang_after_s", "hang_after_s"), ("allow_mismatch", "allow_mismatch"), ("data", "data"),
    ("packages", "packages"), ("scale_probe", "scale_probe"),
]  # fmt: skip
UPLOAD_BATCH_BYTES = 16 * 1024 * 1024  # objects sent together in one tar, up to this much a request


def upload(client: Client, directory: str) -> str:
    """Send a directory to the server for `launch --sync`: its manifest, then (as tars) only the files the
    server lacks; returns the digest a launch names. ApiError in one line for a tree that cannot go."""
    try:
        found = manifest.build(directory)
    except manifest.ManifestError as exc:
        raise ApiError(str(exc), EXIT_USAGE) from None
    answer = client.post("sync", {"manifest": found.as_dict(), "source": found.root,
                                  "git": manifest.git_info(found.root)})  # fmt: skip
    missing = set(answer["missing"])
    paths = {f["sha256"]: os.path.join(found.root, f["path"]) for f in found.files}
    batch: list[str] = []
    size = 0
    for sha in sorted(missing):
        batch.append(sha)
        size += os.path.getsize(paths[sha])
        if size >= UPLOAD_BATCH_BYTES:
            _send_tar(client, batch, paths)
            batch, size = [], 0
    if batch:
        _send_tar(client, batch, paths)
    return answer["digest"]


def _send_tar(client: Client, shas: list[str], paths: dict[str, str]) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for sha in shas:
            tar.add(paths[sha], arcname=sha, recursive=False)
    client.post_bytes("sync/objects", buffer.getvalue(), "application/x-tar")


def read_job_file(client: Client, a, body: dict) -> tuple[dict, str, str]:
    """`launch -f`: the server reads the file with the options typed beside it (one reader for every surface):
    the resolved spec as the API's fields, the directory to sync (a file's is relative to the file), the YAML."""
    text = read_text_file(a.file, MAX_JOB_FILE)
    typed = {key: body[key] for key, dest in LAUNCH_FIELDS if dest in a.given and key != "dry_run"}
    request = {"spec": text, "spec_dir": os.path.dirname(os.path.abspath(a.file)), **typed}
    if "sync" in a.given:
        request["sync"] = a.sync if a.sync == "none" else os.path.abspath(a.sync)
    try:
        answer = client.post("spec/launch", request)
    except ApiError as exc:
        if exc.status == 404 and "job file" not in str(exc):
            raise ApiError("this UGRO server reads job files the older way: update it, or launch without -f",
                           EXIT_USAGE) from None  # fmt: skip
        message = f"{a.file}:{str(exc)[len('job file:') :]}" if str(exc).startswith("job file:") else str(exc)
        raise ApiError(message, exc.code, exc.status) from None
    return {**answer["spec"], "dry_run": a.dry_run}, answer["sync"], answer["yaml"]


def cmd_launch(client: Client, a) -> int:
    if not a.name and not a.file:
        raise ApiError("--name is required (or a job file with -f that names the job)", EXIT_USAGE)
    body, sync, shown = {key: getattr(a, dest) for key, dest in LAUNCH_FIELDS}, a.sync, ""
    if a.file:
        body, sync, shown = read_job_file(client, a, body)
    if sync and sync != "none":
        body["sync_upload"] = upload(client, sync)
    answer = client.post("jobs/", body)
    if a.dry_run:
        if a.json:
            emit_json({**answer, "yaml": shown} if a.file else answer)
        else:  # with -f the whole output is a job file: the resolved spec, each rank's command as a comment
            sys.stdout.write(shown)
            print("\n".join(f"# {line}" if a.file else line for line in answer["lines"]))
        return EXIT_OK
    a.name = answer["name"]
    if a.json and a.detach:
        emit_json(answer)
        return EXIT_OK
    print(f"job {answer['name']} queued (id {answer['id']})")
    if answer.get("worker_alive") is False:
        print("no UGRO worker is running on the server: the job waits in the queue until one does (bin/start)")
    if a.detach:
        return EXIT_OK
    try:
        job = follow(client, a.name, rank=None, tail=0, announce_states=True)
    except KeyboardInterrupt:
        print(
            f"\nleft job {a.name} to go on without this command. Follow it: ugro logs {a.name} --follow; "
            f"cancel it: ugro cancel {a.name}"
        )
        return EXIT_OK
    return EXIT_OK if job["state"] == "succeeded" else EXIT_FAILED


def follow(client: Client, name: str, rank: int | None, tail: int, announce_states: bool = False,
           as_json: bool = False) -> dict:  # fmt: skip
    """Print lines as they are committed until the job ends and all its output is in; returns the job."""
    first = client.get(f"jobs/{name}/logs", rank=rank, tail=max(tail, 1))
    if tail:
        show(first["lines"], rank, as_json)
    offsets = first["offsets"]
    state = None
    waiting, delivering = Waiting(client, name), Delivering(client, name)
    while True:
        answer = client.get(f"jobs/{name}/logs", rank=rank, since=",".join(f"{k}:{v}" for k, v in offsets.items()))
        show(answer["lines"], rank, as_json)
        offsets = answer["offsets"] or offsets
        if announce_states and answer["state"] != state:
            state = answer["state"]
            print(f"[{time.strftime('%H:%M:%S')}] {name} {state}")
        if announce_states and state == "queued":
            waiting.say_why()
        if announce_states and state == "starting":
            delivering.show()
        if answer["settled"]:
            job = client.get(f"jobs/{name}/")
            print(f"-- job {name} {job['state']}" + (f": {job['failure_reason']}" if job["failure_reason"] else ""))
            return job
        if not answer["more"]:
            time.sleep(FOLLOW_POLL_S)


class Waiting:
    """Says why a followed job waits in the queue (`ugro queue`'s reason and detail), again when that changes."""

    def __init__(self, client: Client, name: str) -> None:
        self.client, self.name = client, name
        self.said: str | None = None
        self.asked_at = -WAIT_POLL_S

    def say_why(self) -> None:
        if time.monotonic() - self.asked_at < WAIT_POLL_S:
            return
        self.asked_at = time.monotonic()
        entry = next((j for j in self.client.get("queue") if j.get("name") == self.name), None)
        if entry is None or entry.get("starts_now") or not (entry.get("reason") or entry.get("detail")):
            return  # gone from the queue, or starting at the next pass: the state line says what follows
        reason, detail = entry.get("reason") or "", entry.get("detail") or ""
        why = f"({reason})" + (f": {detail}" if detail else "") if reason else f": {detail}"
        if why != self.said:
            self.said = why
            print(f"[{time.strftime('%H:%M:%S')}] {self.name} waits {why}")
            sys.stdout.flush()


class Delivering:
    """While a followed job starts: its data's delivery to the nodes (bytes and rate per node), again when it
    changes; on a terminal one line rewritten in place, with a bar of the bytes the nodes hold of the total."""

    def __init__(self, client: Client, name: str) -> None:
        self.client, self.name = client, name
        self.said = ""
        self.asked_at = -WAIT_POLL_S

    def show(self) -> None:
        if time.monotonic() - self.asked_at < WAIT_POLL_S:
            return
        self.asked_at = time.monotonic()
        code = self.client.get(f"jobs/{self.name}/").get("code") or {}
        line = code.get("data_line") or ""
        if not line or line == self.said:
            return
        self.said = line
        if sys.stdout.isatty():
            nodes = ((code.get("transfer") or {}).get("nodes") or {}).values()
            held, total = sum(n.get("held", 0) for n in nodes), sum(n.get("total", 0) for n in nodes)
            done = held / total if total else 0.0
            bar = "[" + "#" * round(20 * done) + "." * (20 - round(20 * done)) + f"] {100 * done:3.0f}% "
            width = shutil.get_terminal_size().columns
            print("\r" + (bar + line)[: width - 1].ljust(width - 1), end="\n" if "delivered" in line else "")
        else:
            print(f"[{time.strftime('%H:%M:%S')}] {self.name} {line}")
        sys.stdout.flush()


def show(lines: list, rank: int | None, as_json: bool = False) -> None:
    for when, r, text in lines:
        if as_json:
            print(json.dumps({"time": when, "rank": r, "text": text}))
        else:
            print(text if rank is not None else f"[rank {r}] {text}")
    sys.stdout.flush()


def cmd_status(client: Client, a) -> int:
    if not a.name:
        if a.exit_code:
            raise ApiError("--exit-code needs a job name", EXIT_USAGE)
        jobs = client.get("jobs/", limit=a.limit)
        emit_json(jobs) if a.json else print("\n".join(jobs_table(jobs)))
        return EXIT_OK
    job = client.get(f"jobs/{a.name}/")
    emit_json(job) if a.json else print("\n".join(job["lines"]))
    if a.exit_code:
        return EXIT_STATES.get(job["state"], NOT_ENDED_EXIT)
    return EXIT_FAILED if job["state"] == "failed" else EXIT_OK


def cmd_logs(client: Client, a) -> int:
    if a.tail < 1:
        raise ApiError("--tail must be at least 1", EXIT_USAGE)
    if a.attempt is not None and a.follow:
        raise ApiError("--attempt shows an attempt that ended: --follow is for the current one", EXIT_USAGE)
    if a.follow:
        try:
            follow(client, a.name, a.rank, a.tail, as_json=a.json)
        except KeyboardInterrupt:
            pass
        return EXIT_OK
    answer = client.get(f"jobs/{a.name}/logs", rank=a.rank, tail=a.tail, attempt=a.attempt)
    show(answer["lines"], a.rank, a.json)
    return EXIT_OK


def cmd_results(client: Client, a) -> int:
    answer = client.get(f"jobs/{a.name}/results")
    emit_json(answer) if a.json else print("\n".join(answer["lines"]))
    return EXIT_OK


def cmd_cancel(client: Client, a) -> int:
    job = client.post(f"jobs/{a.name}/cancel")
    deadline = time.monotonic() + CANCEL_WAIT_S
    while not a.no_wait and job["state"] == "cancelling" and time.monotonic() < deadline:
        time.sleep(0.3)
        job = client.get(f"jobs/{a.name}/")
    if job["state"] == "cancelling":
        if a.no_wait:
            print(f"job {a.name} cancelling: its processes are being stopped")
            return EXIT_OK
        raise ApiError(f"job {a.name} is still cancelling after {CANCEL_WAIT_S:.0f}s: is a UGRO worker running?",
                       EXIT_FAILED)  # fmt: skip
    if job["state"] != "cancelled":
        raise ApiError(f"job {a.name} {job['state']} before it could be cancelled", EXIT_FAILED)
    if "not confirmed stopped" in job["failure_reason"]:
        raise ApiError(f"job {a.name} cancelled, but {job['failure_reason']}", EXIT_FAILED)
    emit_json(job) if a.json else print(f"job {a.name} cancelled; no process of it remains on its nodes")
    return EXIT_OK


def cmd_resume(client: Client, a) -> int:
    try:
        body = {"from": a.from_step}
        if a.nodes:  # `--nodes gpu1,gpu2` and `--nodes gpu1 gpu2` alike
            body["nodes"] = [n for item in a.nodes for n in item.split(",") if n]
        job = client.post(f"jobs/{a.name}/resume", body)
    except ApiError as exc:
        if exc.status == 404 and "no job named" not in str(exc):
            raise ApiError("this UGRO server has no resume endpoint (it predates resume)", EXIT_REFUSED) from None
        raise
    if a.json and a.detach:
        emit_json(job)
        return EXIT_OK
    print(f"job {job['name']} queued again (attempt {job['attempt']})")
    if a.detach:
        return EXIT_OK
    try:
        job = follow(client, a.name, rank=None, tail=0, announce_states=True)
    except KeyboardInterrupt:
        print(f"\nleft job {a.name} to go on without this command. Follow it: ugro logs {a.name} --follow")
        return EXIT_OK
    return EXIT_OK if job["state"] == "succeeded" else EXIT_FAILED


SWEEP_KEYS = ["name", "script", "grid", "random", "trials", "seed", "max_concurrent", "metric", "mode", "median_stop",
              "median_min_steps", "gpus", "nodes", "gpus_per_node", "time_limit", "min_vram", "priority",
              "extra_args"]  # fmt: skip


def cmd_sweep(client: Client, a) -> int:
    if a.show and a.cancel:
        raise ApiError("--show or --cancel, not both", EXIT_USAGE)
    if not a.name and (a.show or a.cancel or not a.file):
        raise ApiError("the sweep's NAME is required (or a sweep file with -f that names it)", EXIT_USAGE)
    if a.show:
        sweep = client.get(f"sweeps/{a.name}/")
    elif a.cancel:
        sweep = client.post(f"sweeps/{a.name}/cancel")
    else:
        fields = [(key, "extra" if key == "extra_args" else key) for key in SWEEP_KEYS]
        sweep = client.post("sweeps/", with_file(a, fields, {key: getattr(a, dest) for key, dest in fields}))
    if a.json:
        emit_json(sweep)
        return EXIT_OK
    done = "cancelled" if a.cancel else ("" if a.show else "created")
    print(f"sweep {sweep['name']}: {sweep['metric']} ({sweep['mode']}){' ' + done if done else ''}"
          f"{', cancelled' if sweep['cancelled'] and not a.cancel else ''}")  # fmt: skip
    for t in sweep["trials"]:
        final = "-" if t["final"] is None else f"{t['final']:.6g}"
        best = "-" if t["best"] is None else f"{t['best']:.6g}"
        params = " ".join(f"{k}={v}" for k, v in t["params"].items())
        mark = "  <- best" if t["is_best"] else ""
        energy = (t.get("energy") or {}).get("text", "-")  # a server before energy per trial has none
        print(f"  {t['name']:24} {t['state']:10} final {final:>10} best {best:>10}  energy {energy}  {params}{mark}")
    return EXIT_OK


# (the API's field, this parser's dest): serving/spec.py's SERVE, checked by tests/test_serve_files.py
SERVE_FIELDS = [
    ("name", "name"), ("from", "source"), ("replicas", "replicas"), ("gpus_per_replica", "gpus_per_replica"),
    ("engine", "engine"), ("command", "engine_command"), ("min_replicas", "min_replicas"),
    ("max_replicas", "max_replicas"), ("target_outstanding", "target_outstanding"), ("idle_after", "idle_after"),
    ("cold_start_timeout", "cold_start_timeout"),
]  # fmt: skip


def serve_body(a) -> dict:
    """`ugro serve`'s request: the options given; with -f, the file's text and the options typed beside it."""
    body = {key: getattr(a, dest) for key, dest in SERVE_FIELDS}
    return {key: value for key, value in with_file(a, SERVE_FIELDS, body).items() if value is not None}


def cmd_serve(client: Client, a) -> int:
    if a.list:
        listed = client.get("services/")
        emit_json(listed["services"]) if a.json else print("\n".join(listed["lines"]) or "no services")
        return EXIT_OK
    if not a.name and (a.stop or not a.file):
        raise ApiError("name the service: ugro serve NAME --from JOB (or -f FILE), NAME --stop, or --list", EXIT_USAGE)
    if a.stop:
        service = client.post(f"services/{a.name}/stop")
        deadline = time.monotonic() + CANCEL_WAIT_S
        while service["state"] != "stopped" and time.monotonic() < deadline:
            time.sleep(0.3)
            service = client.get(f"services/{a.name}/")
        if service["state"] != "stopped":
            notes = "; ".join(r["note"] for r in service["replicas"] if r["state"] != "stopped" and r["note"])
            raise ApiError(f"service {a.name} is still stopping: {notes or 'is a UGRO worker running?'}", EXIT_FAILED)
        emit_json(service) if a.json else print(f"service {a.name} stopped; no process of it remains, GPUs free")
        return EXIT_OK
    if not a.source and not a.file:
        raise ApiError("--from JOB[:STEP|latest] names the checkpoint to serve", EXIT_USAGE)
    try:
        service = client.post("services/", serve_body(a))
    except ApiError as exc:  # the server read the file: its lines name the file as the user typed it
        message = str(exc).replace("service file:", f"service file {a.file}:", 1) if a.file else str(exc)
        raise ApiError(message, exc.code, exc.status) from None
    a.name = service["name"]
    if service.get("update"):
        return _serve_update(client, a, service)
    if a.json:
        emit_json(service)
    else:
        count = "asleep until its first request," if service["state"] == "sleeping" else \
            f"{len(service['replicas'])} replica(s) of"  # fmt: skip
        print(f"service {a.name}: {count} {service['engine']} serving "
              f"{service['checkpoint']} (step {service['step']}); endpoint {client.url}{service['endpoint']} "
              "(ugro serve --list shows when they are ready)")  # fmt: skip
    return EXIT_OK


def _serve_update(client: Client, a, service: dict) -> int:
    """`ugro serve NAME --from JOB` on a running service: wait (bounded) for its rolling update to end."""
    deadline = time.monotonic() + SERVE_UPDATE_WAIT_S
    while service["updating_to_step"] is not None and time.monotonic() < deadline:
        time.sleep(0.5)
        service = client.get(f"services/{a.name}/")
    if a.json:
        emit_json(service)
    if service["updating_to_step"] is not None:
        raise ApiError(f"service {a.name} is still updating ({service['note']}): ugro serve --list", EXIT_FAILED)
    if " failed: " in service["note"]:
        raise ApiError(f"service {a.name}: {service['note']}", EXIT_FAILED)
    if not a.json:
        print(f"service {a.name}: {service['note']}")
    return EXIT_OK


def cmd_alerts(client: Client, a) -> int:
    if a.limit < 1:
        raise ApiError("--limit must be at least 1", EXIT_USAGE)
    alerts = client.get("alerts", all=1 if a.show_all else None, limit=a.limit)["alerts"]
    if a.json:
        emit_json({"alerts": alerts})
    elif not alerts:
        print("no open alerts" if not a.show_all else "no alerts")
    for x in alerts if not a.json else []:
        where = x["node"] or x["job"] or "cluster"
        state = "open" if x["open"] else f"resolved {x['resolved_at'][:19].replace('T', ' ')}"
        when = x["opened_at"][:19].replace("T", " ")
        print(f"{when} {x['severity'].upper():<8} {where:<12} {x['message']} ({state})")
    return EXIT_OK


MAX_CLUSTER_YAML = 1024 * 1024


def cmd_import_cluster(client: Client, a) -> int:
    text = read_text_file(a.path, MAX_CLUSTER_YAML)
    try:
        answer = client.post("cluster", {"yaml": text})
    except ApiError as exc:
        raise ApiError(f"{a.path}: {exc}", exc.code, exc.status) from None
    emit_json(answer) if a.json else print(f"imported {a.path}: {answer['summary']}")
    return EXIT_OK


def cmd_export_cluster(client: Client, a) -> int:
    answer = client.get("cluster")
    text = json.dumps(answer["cluster"], indent=2) + "\n" if a.json else answer["yaml"]
    if a.path:
        with open(a.path, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"wrote {a.path}")
    else:
        sys.stdout.write(text)
    return EXIT_OK


def cmd_trust(client: Client, a) -> int:
    answer = client.post(f"nodes/{a.node}/trust", {"fingerprint": a.fingerprint})
    if a.json:
        emit_json(answer)
        return EXIT_OK
    old, new = answer["old"], answer["new"]
    if old == new:
        print(f"{a.node}: host key {new} was already pinned")
    else:
        print(f"{a.node}: host key {new} pinned" + (f" (was {old})" if old else ""))
    return EXIT_OK


def cmd_node(client: Client, a) -> int:
    client.timeout = max(client.timeout, 120.0)  # add and probe read every Python environment a machine has
    if a.verb == "add":
        report = client.post("nodes", {"target": a.target, "name": a.name, "key": a.key, "workdir": a.workdir,
                                       "fingerprint": a.fingerprint})  # fmt: skip
    elif a.verb in ("probe", "sleep", "wake"):
        report = client.post(f"nodes/{a.node}/{a.verb}")
    else:
        report = client.get(f"nodes/{a.node}/{a.verb}")
    if a.json:
        emit_json(report)
    else:
        print("\n".join(report["lines"]))
    return EXIT_OK


def cmd_queue(client: Client, a) -> int:
    jobs = client.get("queue")
    if a.json:
        emit_json(jobs)
    elif not jobs:
        print("queue is empty")
    else:
        print(f"{'POS':>3} {'NAME':24} {'PRIO':>4} {'OWNER':10} {'REASON':11} {'EST. START':20} DETAIL")
        for j in jobs:
            reason = "starting" if j.get("starts_now") else (j.get("reason") or "-")
            est = "now" if j.get("starts_now") else (j.get("estimated_start") or "unknown")[:16].replace("T", " ")
            print(f"{j.get('position', 0):>3} {j['name'][:24]:24} {j['priority']:>4} {(j['owner'] or '-')[:10]:10} "
                  f"{reason:11} {est:20} {j.get('detail') or ''}")  # fmt: skip
    return EXIT_OK


RESTING = ("asleep", "waking")  # put to sleep by a node's power: block: not a failure (docs/power.md)


def cmd_health(client: Client, a) -> int:
    nodes = [n for n in client.get("health") if n["enabled"]]
    controller = client.get("controller")
    if a.json:
        emit_json(nodes)
    width = max((len(n["name"]) for n in nodes), default=0) + 2
    for n in nodes if not a.json else []:
        if n["status"] == "healthy":
            print(f"✓ {n['name']:<{width}} {n['gpu']} - Ready (score {n['score']})")
        elif n["status"] in RESTING:
            why = n["reason"] or "woken when a job needs it"
            print(f"○ {n['name']:<{width}} {n['gpu']} - {n['status'].upper()}: {why}")
        else:
            print(f"✗ {n['name']:<{width}} {n['gpu']} - {n['status'].upper()}: {n['reason'] or 'no reading'}")
        for check in n["checks"]:
            print(f"    {check.get('severity')}: {check.get('detail')}")
    if controller["problem"] and not a.json:
        print(f"✗ {controller['problem']}")
    return EXIT_FAILED if any(n["status"] not in ("healthy", *RESTING) for n in nodes) else EXIT_OK


def cmd_drain(client: Client, a) -> int:
    node = client.post(f"nodes/{a.node}/{a.command}")
    if a.json:
        emit_json(node)
        return EXIT_OK
    print(f"node {node['name']} {'drained: no new job is placed on it' if not node['enabled'] else 'takes jobs again'}")
    return EXIT_OK


def cmd_whoami(client: Client, a) -> int:
    me = client.get("me")
    emit_json(me) if a.json else print(f"{me['username']} (role {me['role']}, token scope {me['scope'] or '-'}) "
                                       f"at {client.url}")  # fmt: skip
    return EXIT_OK


def cmd_audit(client: Client, a) -> int:
    events = client.get("audit", limit=a.limit, action=a.what, user=a.user)
    if a.json:
        emit_json(events)
        return EXIT_OK
    for e in events:
        argv = f"  argv: {json.dumps(e['argv'])}" if e["argv"] else ""
        print(f"{e['time'][:19]} {e['username'] or '-':12} {e['action']:14} {e['target']:24} {e['source']:28} "
              f"{e['outcome']}{argv}")  # fmt: skip
    return EXIT_OK


def cmd_preflight(client: Client, a) -> int:
    nodes = [n for item in a.nodes for n in item.split(",") if n]
    report = client.post("preflight", {"nodes": nodes, "script": a.script})
    if a.json:
        emit_json(report)
    else:
        for note in report["notes"]:
            print(f"note: {note}")
        for problem in report["problems"]:
            print(problem)
        if report["ok"]:
            print(f"pre-flight passed: {', '.join(report['nodes'])} (rendezvous {report['rendezvous']})")
    if not report["ok"]:
        sys.stderr.write(f"ugro preflight: failed on {len(report['nodes'])} node(s): "
                         f"{len(report['problems'])} problem(s)\n")  # fmt: skip
        return EXIT_FAILED
    return EXIT_OK


def cmd_netcheck(client: Client, a) -> int:
    nodes = [n for item in a.nodes for n in item.split(",") if n]
    try:
        sizes = [int(s) for s in a.sizes.split(",") if s.strip()] or None
    except ValueError:
        sys.stderr.write(f"ugro netcheck: --sizes: whole numbers of MB separated by commas, not {a.sizes[:40]!r}\n")
        return EXIT_USAGE
    report = client.post("netcheck", {"nodes": nodes, "sizes": sizes})
    if a.json:
        emit_json(report)
    else:
        for line in report["problems"] + report["lines"]:
            print(line)
    if not report["ok"]:
        why = f"refused: {len(report['problems'])} problem(s)" if report["problems"] else "not measured"
        sys.stderr.write(f"ugro netcheck: {why}\n")
        return EXIT_FAILED
    return EXIT_OK


def cmd_token(client: Client, a) -> int:
    if a.verb == "list":
        tokens = client.get("tokens")["tokens"]
        if a.json:
            emit_json(tokens)
            return EXIT_OK
        print(f"{'PREFIX':10} {'SCOPE':8} {'NAME':16} {'CREATED':17} {'LAST USED':17} STATE")
        for t in tokens:
            when = lambda d: d[:16].replace("T", " ") if d else "-"  # noqa: E731
            print(f"{t['prefix']:10} {t['scope']:8} {t['name'][:16]:16} {when(t['created_at']):17} "
                  f"{when(t['last_used_at']):17} {'revoked' if t['revoked'] else 'active'}")  # fmt: skip
        return EXIT_OK
    if a.verb == "revoke":
        row = client.post(f"tokens/{a.prefix}/revoke")
        emit_json(row) if a.json else print(f"token {row['prefix']} revoked")
        return EXIT_OK
    row = client.post("tokens", {"name": a.name, "scope": a.scope})
    if a.json:
        emit_json(row)
    else:
        print(f"token {row['prefix']} for {row['user']}, scope {row['scope']} (shown once, keep it secret):")
        print(row["token"])
    if a.save is not None:
        path = os.path.expanduser(a.save) if a.save else str(token_path())
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(row["token"] + "\n")
        os.chmod(path, 0o600)
        if not a.json:
            print(f"saved to {path}")
    return EXIT_OK


COMMANDS = {
    "launch": cmd_launch, "status": cmd_status, "logs": cmd_logs, "results": cmd_results, "cancel": cmd_cancel,
    "resume": cmd_resume, "queue": cmd_queue, "health": cmd_health, "drain": cmd_drain, "undrain": cmd_drain,
    "whoami": cmd_whoami, "audit": cmd_audit, "sweep": cmd_sweep, "alerts": cmd_alerts,
    "import_cluster": cmd_import_cluster, "export_cluster": cmd_export_cluster, "trust": cmd_trust,
    "preflight": cmd_preflight, "netcheck": cmd_netcheck, "token": cmd_token, "serve": cmd_serve, "node": cmd_node,
}  # fmt: skip

if __name__ == "__main__":
    sys.exit(main())
