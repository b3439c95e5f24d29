"""Job files as people write them: every launch option under the command line's name or the API's, YAML lists
or the comma strings, read to the same spec as the command line on every surface; the option table in
docs/api.md made from the launch spec (jobs/spec.py) and checked against each surface; bad keys and values
in one line that names the fix; `--dry-run -f` printing a job file that reads back to the same spec."""

from __future__ import annotations

import argparse
import io
import json
import re
import shlex

import pytest
import yaml
from django.core.management import CommandError, call_command, load_command_class
from rest_framework import serializers

from api import spec as api_spec
from api.serializers import LaunchSerializer, SweepSerializer
from jobs.launch import LaunchRequest
from jobs.spec import LAUNCH, SWEEP, Option, SpecError, read_text, table
from ugro_client import cli
from ugro_client.cli import LAUNCH_FIELDS, SWEEP_KEYS

from .conftest import two_launch_nodes
from .test_docs_commands import REPO, _subparser

ISSUE_FILE = "name: fromfile\nnodes: 1\nretry: [oom, node-lost]\nmax_attempts: 3\n"
ISSUE_ARGV = "--name fromfile --nodes 1 --retry oom,node-lost --max-attempts 3"


def manage_parser(command: str) -> argparse.ArgumentParser:
    return load_command_class("jobs", command).create_parser("manage.py", command)


def from_command_line(argv: str) -> LaunchRequest:
    """`manage.py launch ARGV` as the request it makes (the options typed, nothing else)."""
    options = vars(manage_parser("launch").parse_args(shlex.split(argv)))
    return LaunchRequest.from_fields({o.field: options[o.field] for o in LAUNCH if o.field in options})


def from_client(argv: str) -> LaunchRequest:
    """`ugro launch ARGV` as the API reads the body the client sends."""
    a = cli.parse(["launch", *shlex.split(argv)])
    data = LaunchSerializer(data={key: getattr(a, dest) for key, dest in LAUNCH_FIELDS})
    assert data.is_valid(), data.errors
    return data.launch_request()


def from_file(text: str) -> LaunchRequest:
    """The file as the server reads it (`POST /api/v1/jobs/` with `spec`), and as `manage.py launch -f` does."""
    data = LaunchSerializer(data=api_spec.merged({"spec": text}, "launch"))
    assert data.is_valid(), data.errors
    values, _ = read_text(text, LAUNCH)
    assert LaunchRequest.from_fields(values) == data.launch_request()
    return data.launch_request()


@pytest.mark.parametrize(
    ("text", "argv"),
    [
        (ISSUE_FILE, ISSUE_ARGV),
        ("name: fromfile\ncount: 1\nretry: oom,node-lost\nmax-attempts: 3\n", ISSUE_ARGV),
        ("name: a\nnodes: [gpu1, gpu2]\n", "--name a --node gpu1 --node gpu2"),
        ("name: a\nnode: [gpu1, gpu2]\n", "--name a --node gpu1 --node gpu2"),
        ("name: a\nnodes: gpu1,gpu2\n", "--name a --node gpu1 --node gpu2"),
        ("name: a\nnode: gpu1\n", "--name a --node gpu1"),
        ("name: a\nnodes: '3'\n", "--name a --nodes 3"),
        ("name: a\ntime-limit: 2h\nhang-after: 120\n", "--name a --time-limit 2h --hang-after 120"),
        ("name: a\ntime_limit: 2h\nhang_after_s: 120\n", "--name a --time-limit 2h --hang-after 120"),
        ("name: a\ngpus: 4\ngpus-per-node: 2\n", "--name a --gpus 4 --gpus-per-node 2"),
        ("name: a\nbatch_weights: {gpu1: 2, gpu2: 1.5}\n", "--name a --batch-weights gpu1=2,gpu2=1.5"),
        ("name: a\nbatch-weights: gpu1=2,gpu2=1.5\n", "--name a --batch-weights gpu1=2,gpu2=1.5"),
        ("name: a\nextra_args: [--max-steps, 50]\n", "--name a -- --max-steps 50"),
        ("name: a\nextra_args: --max-steps 50 --note 'a b'\n", "--name a -- --max-steps 50 --note 'a b'"),
        ("name: a\nmetrics_files: [logs, runs/x]\n", "--name a --metrics-file logs --metrics-file runs/x"),
        ("name: a\nmetrics-file: logs\n", "--name a --metrics-file logs"),
        ("name: a\nlr: 1e-4\nepochs: 3\n", "--name a --lr 1e-4 --epochs 3"),
        ("name: a\nallow-mismatch: true\npriority: 7\n", "--name a --allow-mismatch --priority 7"),
    ],
)
def test_a_file_gives_the_spec_its_command_line_gives(text: str, argv: str):
    # given a job file written the way the command line reads; when the server and manage.py read it
    read = from_file(text)
    # then it is the request manage.py launch and ugro launch make from the same options typed
    assert read == from_command_line(argv) == from_client(argv)


def _typed(option: Option) -> list[str]:
    """The option's example as the command line types it."""
    value = option.example
    if option.kind == "bool":
        return [option.flag]
    if option.kind in ("names", "paths"):
        return [arg for item in value for arg in (option.flag, item)]
    if option.kind == "kinds":
        return [option.flag, ",".join(value)]
    if option.kind == "weights":
        return [option.flag, ",".join(f"{k}={v}" for k, v in value.items())]
    if option.kind == "args":
        return ["--", *value]
    return [option.flag, str(value)]


EVERY_KEY = [(o, key) for o in LAUNCH for key in o.file_keys if o.kind != "dir" and o.field != "name"]


@pytest.mark.parametrize(("option", "key"), EVERY_KEY, ids=[f"{o.field}:{k}" for o, k in EVERY_KEY])
def test_every_option_under_every_file_key_and_its_dashed_spelling(option: Option, key: str):
    argv = shlex.join(["--name", "every", *_typed(option)])
    for written in {key, key.replace("_", "-")}:
        text = yaml.safe_dump({"name": "every", written: option.example}, sort_keys=False)
        assert from_file(text) == from_command_line(argv) == from_client(argv), written


def test_a_sync_directory_is_relative_to_the_file_and_a_typed_one_to_where_it_was_typed():
    body = {"spec": "name: a\nsync: ./src\n", "spec_dir": "/home/u/proj"}
    assert api_spec.resolved(body, "launch")["sync"] == "/home/u/proj/src"
    assert api_spec.resolved({**body, "sync": "/elsewhere"}, "launch")["sync"] == "/elsewhere"
    assert api_spec.resolved({**body, "sync": "none"}, "launch")["sync"] == "none"
    # a file's directory sent straight to the API, with nothing uploaded, is one line that says what to do
    with pytest.raises(serializers.ValidationError, match=r"sync: '\./src' is a directory beside the file"):
        api_spec.merged({"spec": body["spec"]}, "launch")
    assert api_spec.merged({"spec": body["spec"], "sync_upload": "ab" * 32}, "launch")["sync_upload"] == "ab" * 32


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: a\nnodez: 1\n", "job file: unknown key 'nodez': did you mean 'nodes'?"),
        ("name: a\nretries: [oom]\n", "job file: unknown key 'retries': did you mean 'retry'?"),
        ("name: a\nhang_aftr: 5\n", "job file: unknown key 'hang_aftr': did you mean 'hang_after'?"),
        (
            "name: a\nepochs: ten\n",
            "job file: epochs: takes a whole number from 1 to 1000000, e.g. `epochs: 3`; not 'ten'",
        ),
        (
            "name: a\nnodes: 0\n",
            "job file: nodes: takes a whole number of nodes from 1 to 1024 or a list of node "
            "names, e.g. `nodes: 3` or `nodes: [gpu1, gpu2]`; not 0",
        ),
        (
            "name: a\nbatch_weights: [2, 1]\n",
            "job file: batch_weights: takes node: weight pairs, or auto, e.g. "
            "`batch_weights: {gpu1: 2, gpu2: 1}`; not [2, 1]",
        ),
        (
            "name: a\nallow_mismatch: 'yes'\n",
            "job file: allow_mismatch: takes true or false, e.g. `allow_mismatch: true`; not 'yes'",
        ),
        (
            "name: a\ntime_limit: 2h\ntime-limit: 3h\n",
            "job file: 'time_limit' and 'time-limit' both give time_limit: keep one",
        ),
        ("name: a\nnodes: 2\nnode: [gpu1]\n", "job file: 'nodes' and 'node': give a count or names, not both"),
        ("- name: a\n", "job file: write options as `key: value` lines, e.g. `name: llama-ft-3`"),
        ("name: [unclosed\n", "job file: not valid YAML (line 2)"),
    ],
)
def test_a_wrong_key_or_value_is_one_line_that_names_the_fix(text: str, message: str):
    with pytest.raises(SpecError) as raised:
        read_text(text, LAUNCH)
    assert str(raised.value) == message


def test_the_sweep_file_takes_the_command_lines_names_and_yaml_lists():
    text = (
        "name: lrs\nscript: train.py\ngrid:\n  lr: [0.1, 1e-4]\n  batch-size: [8, 16]\nrandom:\n"
        "  wd: loguniform(1e-5,1e-2)\nnodes: 2\nmax-concurrent: 1\nmedian-stop: true\nextra_args: --steps 5\n"
    )
    values = api_spec.merged({"spec": text}, "sweep")
    typed = SweepSerializer(
        data={
            "name": "lrs",
            "script": "train.py",
            "grid": ["lr=0.1,1e-4", "batch-size=8,16"],
            "random": ["wd=loguniform(1e-5,1e-2)"],
            "nodes": 2,
            "max_concurrent": 1,
            "median_stop": True,
            "extra_args": ["--steps", "5"],
        }
    )
    read = SweepSerializer(data=values)
    assert typed.is_valid() and read.is_valid(), read.errors
    assert read.sweep_request() == typed.sweep_request()
    # the comma items keep working; a sweep's nodes are a count
    assert api_spec.merged({"spec": "name: s\ngrid: ['lr=0.1,0.2']\n"}, "sweep")["grid"] == ["lr=0.1,0.2"]
    with pytest.raises(serializers.ValidationError, match=r"sweep file: nodes: takes a whole number of nodes"):
        api_spec.merged({"spec": "name: s\nnodes: [gpu1]\n"}, "sweep")


def test_the_option_table_in_the_docs_is_the_one_the_launch_spec_makes():
    docs = (REPO / "docs" / "api.md").read_text()
    for options in (LAUNCH, SWEEP):
        assert table(options) in docs, (
            f"docs/api.md's table is stale; `python -m jobs.spec` prints it:\n{table(options)}"
        )


# the options that say how a command answers, whom it acts as, or where it reads: not what is launched
SURFACE_ONLY = {"detach", "json", "as_user", "file", "show", "cancel", "command", "top_help", "version", "given"}
DJANGO = {"help", "verbosity", "settings", "pythonpath", "traceback", "no_color", "force_color", "skip_checks"}


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in DJANGO | SURFACE_ONLY}


def _flag(action: argparse.Action) -> str:
    return (
        action.option_strings[-1]
        if action.option_strings
        else {"extra_args": "--", "extra": "--"}.get(action.dest, "NAME")
    )


def _check_flags(actions: dict[str, argparse.Action], dests: dict[str, str], options: tuple[Option, ...]) -> None:
    """Each option has its flag, under the dest the surface names it by, with the kind's parsing and default."""
    for o in options:
        dest = dests.get(o.field, o.field)
        assert dest in actions, f"no {o.flag} ({o.field})"
        action = actions.pop(dest)
        assert _flag(action) == o.flag, (o.field, action.option_strings)
        if o.kind == "bool":
            assert isinstance(action, argparse._StoreTrueAction), o.field
        elif o.kind in ("names", "paths", "grid", "random"):
            assert isinstance(action, argparse._AppendAction), o.field
        elif o.kind in ("int", "count", "float"):
            parse = action.type
            assert parse is not None and isinstance(parse("7"), int if o.kind != "float" else float), o.field
            with pytest.raises((ValueError, argparse.ArgumentTypeError)):
                parse("x")
        if action.default is not argparse.SUPPRESS and action.option_strings and o.field != "name":
            assert action.default == o.default, (o.field, action.default, o.default)
    assert actions == {}, f"options the launch spec does not have: {sorted(actions)}"


def test_manage_py_launch_has_every_option_of_the_table_and_no_other():
    _check_flags(_actions(manage_parser("launch")), {"sync_upload": "sync"}, LAUNCH)


def test_manage_py_sweep_has_every_option_of_the_table_and_no_other():
    _check_flags(_actions(manage_parser("sweep")), {"extra_args": "extra"}, SWEEP)


def test_the_clients_launch_and_sweep_have_every_option_of_the_table_and_no_other():
    dests = dict(LAUNCH_FIELDS)
    assert set(dests) == {o.field for o in LAUNCH} - {"sync_upload"}, "LAUNCH_FIELDS and the launch spec differ"
    _check_flags(_actions(_subparser("launch")), {**dests, "sync_upload": "sync"}, LAUNCH)
    assert SWEEP_KEYS == [o.field for o in SWEEP], "SWEEP_KEYS and the sweep options differ"
    _check_flags(_actions(_subparser("sweep")), {"extra_args": "extra"}, SWEEP)


API_TYPES = {
    "int": serializers.IntegerField,
    "count": serializers.IntegerField,
    "float": serializers.FloatField,
    "bool": serializers.BooleanField,
    "names": serializers.ListField,
    "paths": serializers.ListField,
    "args": serializers.ListField,
    "grid": serializers.ListField,
    "random": serializers.ListField,
    "choice": serializers.ChoiceField,
}


@pytest.mark.parametrize(("serializer", "options"), [(LaunchSerializer, LAUNCH), (SweepSerializer, SWEEP)])
def test_the_api_has_every_field_of_the_table_with_its_type_bounds_and_default(serializer, options):
    fields = dict(serializer().fields)
    assert set(fields) == {o.field for o in options}
    for o in options:
        field = fields[o.field]
        assert isinstance(field, API_TYPES.get(o.kind, serializers.CharField)), o.field
        assert (getattr(field, "min_value", None), getattr(field, "max_value", None)) == (o.low, o.high), o.field
        if o.field != "name":
            default = None if field.default is serializers.empty else field.default
            assert (default() if callable(default) else default) == o.default, o.field


def test_the_launch_form_has_every_field_of_the_table_but_what_a_browser_cannot_give(db):
    from django import forms

    from jobs.views import LaunchForm

    fields = LaunchForm().fields
    # a browser has no directory to upload; a dry run is the form's own button
    assert set(fields) == {o.field for o in LAUNCH} - {"sync_upload", "dry_run"}
    kinds = {
        "int": forms.IntegerField,
        "count": forms.IntegerField,
        "float": forms.FloatField,
        "bool": forms.BooleanField,
        "names": forms.MultipleChoiceField,
    }
    for o in LAUNCH:
        if o.field in fields:
            assert isinstance(fields[o.field], kinds.get(o.kind, forms.CharField)), o.field
            assert (getattr(fields[o.field], "min_value", None), getattr(fields[o.field], "max_value", None)) == (
                o.low,
                o.high,
            ), o.field


def test_the_json_schema_has_every_file_key():
    schema = api_spec.json_schema("launch", "UGRO job file")
    keys = {k for o in LAUNCH for key in o.file_keys for k in (key, key.replace("_", "-"))}
    assert set(schema["properties"]) == keys
    assert [p["type"] for p in schema["properties"]["nodes"]["anyOf"]] == ["integer", ["array", "string"]]


def test_a_bad_option_value_on_manage_py_is_one_line_and_help_still_shows_the_usage(capsys):
    # when manage.py launch is run from a shell with a value its option does not take
    command = load_command_class("jobs", "launch")
    with pytest.raises(SystemExit) as stopped:
        command.run_from_argv(["manage.py", "launch", "--name", "x", "--lr", "abc"])
    # then one line says the option, the value and what it takes, and where to read more; no usage block
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "manage.py launch: --lr 'abc': takes a number from 0 to 100, e.g. --lr 0.0003 (see manage.py launch --help)\n"
    )
    # an option of another command, typed by argparse's int: the same one line
    with pytest.raises(SystemExit):
        load_command_class("jobs", "status").run_from_argv(["manage.py", "status", "--limit", "x"])
    assert (
        capsys.readouterr().err == "manage.py status: --limit 'x': takes a whole number (see manage.py status --help)\n"
    )
    # and --help still shows the usage and every option
    with pytest.raises(SystemExit) as stopped:
        command.run_from_argv(["manage.py", "launch", "--help"])
    out = capsys.readouterr().out
    assert stopped.value.code == 0 and out.startswith("usage: manage.py launch") and "--hang-after HANG_AFTER" in out


def dry(*args: str) -> str:
    out = io.StringIO()
    call_command("launch", "--dry-run", *args, stdout=out)
    return out.getvalue()


def test_dry_run_with_a_file_prints_a_job_file_that_reads_back_to_the_same_spec(db, tmp_path):
    # given two nodes, a directory to sync beside the job file, and the file written with the command line's names
    two_launch_nodes()
    from cluster.models import ClusterSettings

    cs = ClusterSettings.load()
    cs.paths = {"sync_roots": [str(tmp_path)]}
    cs.save()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print(1)\n")
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: fromfile\nnodes: 2\nscript: train.py\nretry: [oom, node-lost]\nmax-attempts: 3\ntime-limit: 2h\n"
        "sync: ./src\nextra_args: [--max-steps, 50]\n"
    )
    # when it is dry-run with an option typed beside it
    first = dry("-f", str(job), "--priority", "5")
    # then the output is a job file: the resolved spec as YAML, each rank's command as a comment
    assert yaml.safe_load(first) == {
        "name": "fromfile",
        "nodes": 2,
        "script": "train.py",
        "time_limit": "2h",
        "priority": 5,
        "retry": ["oom", "node-lost"],
        "max_attempts": 3,
        "sync": str(tmp_path / "src"),
        "extra_args": ["--max-steps", "50"],
    }
    assert "# rank 0 on gpu0 (127.0.0.2, GPUs 0), in /srv/w0/outputs/fromfile/code:" in first.splitlines()
    # and saved elsewhere and fed back, it gives the same spec and the same commands (but each run's rendezvous id)
    saved = tmp_path / "elsewhere" / "saved.yaml"
    saved.parent.mkdir()
    saved.write_text(first)
    assert re.sub(r"fromfile-\w+", "TAG", dry("-f", str(saved))) == re.sub(r"fromfile-\w+", "TAG", first)
    # the typed name wins over the file's; a file that names no job and no --name is one line
    assert yaml.safe_load(dry("-f", str(job), "--name", "other"))["name"] == "other"
    (tmp_path / "noname.yaml").write_text("nodes: 1\n")
    with pytest.raises(CommandError, match=r"^--name is required \(or a job file with -f that names the job\)$"):
        dry("-f", str(tmp_path / "noname.yaml"))


def test_the_servers_reading_of_a_file_for_the_client_reads_back_to_itself():
    text = ISSUE_FILE + "lr: 1e-4\nextra_args: --max-steps 5\nmetrics_file: logs\nsync: ../code\nhang-after: 90\n"
    first = api_spec.resolved({"spec": text, "spec_dir": "/p/jobs", "priority": 5}, "launch")
    assert first["sync"] == "/p/code" and first["spec"]["priority"] == 5
    again = api_spec.resolved({"spec": first["yaml"], "spec_dir": "/anywhere"}, "launch")
    assert again == first
    assert json.loads(json.dumps(first)) == first  # what the client gets
