"""Docs that cannot drift from the code: every `ugro ...` and `manage.py ...` command line in README.md and
docs/*.md parses with today's parsers, every `ugro` command an error message names exists, and the surfaces
that take a launch (manage.py, the `ugro` client, the REST API) offer the same options, and the README's newcomer
blocks are where tests/test_newcomer_e2e.py reads and runs them. Paths, names and variables the docs mention:
tests/test_docs_references.py."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import yaml
from django.core.management import get_commands, load_command_class

from api.serializers import LaunchSerializer, SweepSerializer
from ugro_client import cli
from ugro_client.cli import COMMANDS, build_parser

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```")
INLINE = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"(?:^|\s|\$ )(?P<cmd>(?:ugro|(?:\S*python3?\S* )?(?:\./)?manage\.py) [a-z_].*)$")


def _cut(text: str) -> str:
    """A documented command line without its comment, shell plumbing or continuation."""
    text = re.split(r"\s+#\s", text, maxsplit=1)[0].replace("[", "").replace("]", "")  # [--json]: optional
    text = re.split(r"\s(?:>|\||&&|;)\s?", text, maxsplit=1)[0]
    return text.rstrip("\\ ").strip()


def documented() -> list[tuple[str, str]]:
    """(where, command line) of every ugro / manage.py command in the docs' code; where ends in "`" for a
    command inside a sentence (`ugro launch --detach`: it may leave out what the reader supplies)."""
    found = []
    for path in DOCS:
        fenced = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if FENCE.match(line.strip()):
                fenced = not fenced
                continue
            code = fenced or line.startswith("    ")  # a fenced block, or markdown's indented code
            spans = [line] if code else INLINE.findall(line)
            for span in spans:
                m = COMMAND.search(span.strip())
                if m and "..." not in m["cmd"]:  # "ugro launch ... --dry-run" stands for any launch
                    where = f"{path.relative_to(REPO)}:{number}" + ("" if code else "`")
                    found.append((where, _cut(m["cmd"])))
    return found


DOCUMENTED = documented()


def test_the_docs_show_commands_of_both_kinds():
    kinds = {cmd.split()[0] for _, cmd in DOCUMENTED}
    assert "ugro" in kinds and len(DOCUMENTED) > 60


def test_the_readme_shows_a_newcomer_every_step_where_the_newcomer_test_reads_it():
    from .test_newcomer_e2e import argv_of, readme_steps

    # given the README's start, set-up, cluster.yaml and quick-start blocks, as the end-to-end test reads them
    start, setup, cluster, lines = readme_steps()
    # then they are the steps of a newcomer, in an order that runs
    assert start == "bin/start"
    assert [argv_of(line)[:2] for line in setup] == [
        ["bin/setup"],
        [".venv/bin/python", "manage.py"],
        ["ugro", "whoami"],
    ]
    assert len(yaml.safe_load(cluster)["nodes"]) >= 2
    verbs = [argv_of(line)[1] for line in lines]
    assert verbs[0] == "import_cluster" and {"launch", "status", "logs", "results", "cancel"} <= set(verbs), verbs
    launches = [argv_of(line) for line in lines if argv_of(line)[1] == "launch"]
    attached = [a for a in launches if "--detach" not in a]
    assert attached and attached[0] == argv_of(lines[verbs.index("launch")]), "the first launch is followed live"
    assert any("--detach" in a for a in launches), "a detached launch, for the cancel"


class Refused(Exception):
    pass


def _strict(parser: argparse.ArgumentParser, mention: bool = False) -> None:
    """Parse errors raise Refused; for a mention (a command in a sentence), a missing required argument is
    no error."""

    def error(message: str):
        raise Refused(message)

    if mention:
        for action in parser._actions:
            action.required = False

    parser.error = error  # type: ignore[method-assign]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _strict(sub, mention)


@pytest.mark.parametrize(("where", "line"), [d for d in DOCUMENTED if d[1].startswith("ugro ")],
                         ids=[d[0] for d in DOCUMENTED if d[1].startswith("ugro ")])  # fmt: skip
def test_every_documented_ugro_command_parses_with_the_client(where: str, line: str):
    parser = build_parser()
    _strict(parser, mention=where.endswith("`"))
    argv = shlex.split(line)[1:]
    if len(argv) == 1:  # a command named in the text ("`ugro cancel` stops it"): it must exist
        assert argv[0] in COMMANDS or argv[0] == "help", f"{where}: `{line}`: no such command"
        return
    try:
        args = cli.parse(argv, parser)
    except Refused as exc:
        pytest.fail(f"{where}: `{line}`: {exc}")
    assert args.command in COMMANDS or args.command == "help", f"{where}: `{line}`"


@pytest.mark.parametrize(("where", "line"), [d for d in DOCUMENTED if "manage.py" in d[1]],
                         ids=[d[0] for d in DOCUMENTED if "manage.py" in d[1]])  # fmt: skip
def test_every_documented_manage_py_command_parses_with_its_command(where: str, line: str):
    argv = shlex.split(line)
    argv = argv[next(i for i, a in enumerate(argv) if a.endswith("manage.py")) + 1 :]
    name, rest = argv[0], argv[1:]
    commands = get_commands()
    assert name in commands, f"{where}: `{line}`: no command {name!r}"
    if name in ("runserver", "test", "shell", "migrate", "createsuperuser", "changepassword"):
        return
    parser = load_command_class(commands[name], name).create_parser("manage.py", name)
    _strict(parser, mention=where.endswith("`"))
    try:
        parser.parse_args(rest)
    except Refused as exc:
        pytest.fail(f"{where}: `{line}`: {exc}")


def test_every_ugro_command_an_error_message_names_exists():
    named = set()
    for path in REPO.glob("*/**/*.py"):
        if path.parts[len(REPO.parts)] in ("tests", "bench", ".venv", ".venv-node") or "migrations" in path.parts:
            continue
        named.update(re.findall(r"`ugro ([a-z_]+)", path.read_text()))
    missing = sorted(named - set(COMMANDS) - {"help"})
    assert missing == [], f"messages send users to `ugro {missing}`, which the client lacks"


def test_every_manage_py_command_an_error_message_names_exists():
    named = set()
    for path in REPO.glob("*/**/*.py"):
        if path.parts[len(REPO.parts)] in ("tests", "bench", ".venv", ".venv-node") or "migrations" in path.parts:
            continue
        named.update(re.findall(r"manage\.py ([a-z_]+)", path.read_text()))
    assert named and sorted(named - set(get_commands())) == []


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions if a.dest not in ("help", "version", "verbosity", "settings",
            "pythonpath", "traceback", "no_color", "force_color", "skip_checks", "top_help")}  # fmt: skip


def _subparser(name: str) -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError(name)


def test_every_client_command_answers_with_json_when_asked():
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, parser in action.choices.items():
                if name == "help":
                    continue
                verbs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
                for sub in verbs[0].choices.values() if verbs else [parser]:
                    assert "--json" in sub.format_usage(), f"`ugro {name}` has no --json"


# the same option under another name on a surface: manage.py's dest -> the client's, the API's
RENAMED = {
    "extra": ("extra", "extra_args"),
    "extra_args": ("extra", "extra_args"),
    "sync": ("sync", "sync_upload"),
}  # the client uploads the directory; the API takes its digest
SURFACE_ONLY = {"detach", "json", "as_user", "file"}  # how a command answers, whom it acts as, where it reads


@pytest.mark.parametrize("command", ["launch", "sweep"])
def test_manage_py_the_client_and_the_api_take_the_same_options(command: str):
    commands = get_commands()
    ours = _dests(load_command_class(commands[command], command).create_parser("manage.py", command))
    client = _dests(_subparser(command))
    api = set((LaunchSerializer if command == "launch" else SweepSerializer)().fields)
    for dest in sorted(ours - SURFACE_ONLY):
        as_client, as_api = RENAMED.get(dest, (dest, dest)) if command == "launch" or dest == "extra" else (dest, dest)
        assert as_client in client, f"`ugro {command}` lacks manage.py's {dest}"
        if dest not in ("show", "cancel"):  # sweep's --show/--cancel are endpoints of their own
            assert as_api in api, f"the API's {command} lacks manage.py's {dest}"


LISTS = {"extra_args", "metrics_files", "data"}  # a text box on the form, a list in the API: lengths differ in kind


def test_the_launch_form_takes_every_launch_field_with_the_apis_bounds(db):
    from jobs.views import LaunchForm

    form = LaunchForm().fields
    api = LaunchSerializer().fields
    # a browser has no directory to upload: code is synced from the command line (ugro launch --sync DIR)
    assert set(api) - {"dry_run", "sync_upload"} - set(form) == set(), "the launch form lacks these launch fields"
    assert set(form) - set(api) == set()
    for name, field in form.items():
        for bound in ("min_value", "max_value"):
            if hasattr(field, bound) and hasattr(api[name], bound):
                assert getattr(field, bound) == getattr(api[name], bound), (name, bound)
        if getattr(field, "max_length", None) and getattr(api[name], "max_length", None) and name not in LISTS:
            assert field.max_length == api[name].max_length, (name, "max_length")
