"""Service files (`manage.py serve -f chat.yaml`; `ugro serve -f`'s are read by the server, tests/test_serve_client.py):
serve's options under the command line's names or the API's, read to the request the same flags make on every
surface, the flags typed beside the file winning; bad files refused in one line with nothing created; a file kept
beside its service, its `from:` changed, updating it. The worker is the test (the fake agent of
tests/test_serve_scaling.py); serving/spec.py's table is checked against manage.py's, the client's flags and the
docs."""

from __future__ import annotations

import argparse
import io
import shlex
import time
from types import SimpleNamespace

import pytest
import yaml
from django.core.management import CommandError, call_command, load_command_class

from jobs.models import Allocation
from jobs.spec import table
from serving import scaling
from serving.management.commands import serve as serve_command
from serving.models import Replica, Service
from serving.requests import ServeError, ServeRequest
from serving.spec import SERVE, request_of_body, serve_request
from ugro_client import cli

from .test_docs_commands import REPO, _subparser
from .test_job_files import DJANGO, _check_flags
from .test_serve_scaling import _worker, cluster, drain_now, tend  # noqa: F401 (cluster: the fixture)

pytestmark = pytest.mark.django_db
ISSUE_FILE = """\
name: chat
from: trained:20
engine: transformers
min-replicas: 0
max-replicas: 2
idle-after: 15m
"""
ISSUE_ARGV = "chat --from trained:20 --engine transformers --min-replicas 0 --max-replicas 2 --idle-after 15m"


def manage_parser() -> argparse.ArgumentParser:
    return load_command_class("serving", "serve").create_parser("manage.py", "serve")


def typed(argv: str) -> dict:
    """The options `manage.py serve ARGV` typed, as the command passes them to the reader."""
    options = vars(manage_parser().parse_args(shlex.split(argv)))
    return {o.field: options[o.field] for o in SERVE if o.field in options}


def from_command_line(argv: str) -> ServeRequest:
    return serve_request(None, typed(argv))


def from_client(argv: str) -> ServeRequest:
    """`ugro serve ARGV` as the API reads the body the client sends."""
    return request_of_body(cli.serve_body(cli.parse(["serve", *shlex.split(argv)])))


def from_file(text: str) -> ServeRequest:
    """The file as `manage.py serve -f` reads it, and as the server does (`POST /api/v1/services/` with `spec`)."""
    read = serve_request(text, {})
    assert request_of_body({"spec": text}) == read
    return read


def serve(*args: str) -> str:
    out = io.StringIO()
    call_command("serve", *args, stdout=out)
    return out.getvalue()


def held() -> set[str]:
    return set(Allocation.objects.filter(active=True, job=None).values_list("holder", flat=True))


@pytest.mark.parametrize(
    ("text", "argv"),
    [
        (ISSUE_FILE, ISSUE_ARGV),
        (
            "name: chat\nsource: trained:10\nmin_replicas: 0\nmax_replicas: 2\nidle_after: 900\nreplicas: 0\n",
            "chat --from trained:10 --min-replicas 0 --max-replicas 2 --idle-after 900 --replicas 0",
        ),
        (
            "name: c\nfrom: t\nengine: custom\ncommand: '{python} e.py --port {port}'\ngpus-per-replica: 2\n"
            "replicas: 3\ntarget-outstanding: 8\ncold-start-timeout: 5m\n",
            "c --from t --engine custom --command '{python} e.py --port {port}' --gpus-per-replica 2 --replicas 3 "
            "--target-outstanding 8 --cold-start-timeout 5m",
        ),
    ],
)
def test_a_file_gives_the_request_its_command_line_gives(text: str, argv: str):
    # given a service file written the way the command line reads; when manage.py and the server read it
    # then it is the request manage.py serve and ugro serve make from the same options typed
    assert from_file(text) == from_command_line(argv) == from_client(argv)


EVERY_KEY = [(o, key) for o in SERVE for key in o.file_keys if o.field != "name"]


@pytest.mark.parametrize(("option", "key"), EVERY_KEY, ids=[f"{o.field}:{k}" for o, k in EVERY_KEY])
def test_every_option_under_every_file_key_and_its_dashed_spelling(option, key: str):
    source = [] if option.field == "source" else ["--from", "trained"]
    argv = shlex.join(["chat", *source, option.flag, str(option.example)])
    for written in {key, key.replace("_", "-")}:
        text = yaml.safe_dump({"name": "chat", **({"from": "trained"} if source else {}), written: option.example})
        assert from_file(text) == from_command_line(argv) == from_client(argv), written


def test_the_options_typed_beside_a_file_win_on_every_surface(tmp_path):
    # given the issue's file; when a name, an idle time and a bound are typed beside it
    want = from_command_line(
        "other --from trained:20 --engine transformers --min-replicas 0 --max-replicas 3 --idle-after 20m"
    )
    # then manage.py's reading and the server's (the fields the client sends beside the file) take the typed ones
    assert serve_request(ISSUE_FILE, typed("other --idle-after 20m --max-replicas 3")) == want
    body = {"spec": ISSUE_FILE, "name": "other", "idle_after": "20m", "max_replicas": 3}
    assert request_of_body(body) == want
    path = tmp_path / "chat.yaml"
    path.write_text(ISSUE_FILE)
    sent = cli.serve_body(cli.parse(["serve", "other", "-f", str(path), "--idle-after", "20m", "--max-replicas", "3"]))
    assert sent == body and request_of_body(sent) == want
    assert (want.name, want.idle_after, want.max_replicas, want.min_replicas) == ("other", "20m", 3, 0)


def test_the_apis_fields_are_read_by_the_same_table_without_a_file():
    with pytest.raises(ServeError, match=r"^request: unknown key 'min_replica': did you mean 'min_replicas'\?$"):
        request_of_body({"name": "chat", "from": "trained", "min_replica": 0})
    with pytest.raises(ServeError, match=r"^request: replicas: takes a whole number, e.g. `replicas: 2`; not 'x'$"):
        request_of_body({"name": "chat", "from": "trained", "replicas": "x"})
    with pytest.raises(ServeError, match=r"^name the service"):
        request_of_body({"from": "trained"})
    with pytest.raises(ServeError, match=r"^spec: the text of a service file$"):
        request_of_body({"spec": {"name": "chat"}})


@pytest.mark.usefixtures("cluster")
def test_a_file_starts_a_service_asleep_and_the_same_file_with_a_new_from_updates_it(monkeypatch, tmp_path):
    _worker(monkeypatch)
    # given the issue's file, asleep from the start (replicas: 0)
    path = tmp_path / "chat.yaml"
    path.write_text(ISSUE_FILE + "replicas: 0\n")

    # when it is served from the file
    said = serve("-f", str(path))

    # then the service sleeps with the file's shape, holding nothing until a request
    assert said.startswith("service chat: asleep until its first request, transformers serving n1:/w/out/checkpoint-20")
    service = Service.objects.get()
    assert (service.state, service.min_replicas, service.max_replicas, service.idle_after_s) == ("sleeping", 0, 2, 900)
    assert (Replica.objects.count(), held()) == (0, set())

    # when the file's checkpoint is changed and it is served again: an update (asleep: its next replica's)
    path.write_text(ISSUE_FILE.replace("trained:20", "trained:10") + "replicas: 0\n")
    said = serve("-f", str(path))
    assert said == "service chat: now serves trained step 10: its next replica starts from it\n"

    # and a request wakes it on that checkpoint
    assert scaling.wake("chat")
    service = tend(2)
    assert service.state == "running" and service.replica_set.get().checkpoint.step == 10
    assert held() == {"serve:chat/0"}


@pytest.mark.usefixtures("cluster")
def test_a_file_kept_beside_a_running_service_updates_it_and_a_changed_shape_is_refused(monkeypatch, tmp_path):
    _worker(monkeypatch)
    # given two replicas started from a file
    path = tmp_path / "chat.yaml"
    text = "name: chat\nfrom: trained:10\nreplicas: 2\nmax-replicas: 3\nidle-after:\n"
    path.write_text(text)
    assert serve("-f", str(path)).startswith("service chat: 2 replica(s) of transformers")
    service = tend(2)
    assert [r.state for r in service.replica_set.all()] == ["ready", "ready"]

    # when the file's `from:` is changed and it is given again (the command waits for the worker: each of its waits
    # is a pass here)
    path.write_text(text.replace("trained:10", "trained:20"))
    monkeypatch.setattr(serve_command, "time", SimpleNamespace(monotonic=time.monotonic,
                                                              sleep=lambda s: drain_now(tend())))  # fmt: skip
    said = serve("-f", str(path))

    # then it is the rolling update the flags make
    assert said.startswith("service chat: updated to trained step 20")
    assert Service.objects.get().checkpoint.step == 20

    # when the file's shape changes too: refused in one line naming what, nothing changed
    before = list(Service.objects.values())
    path.write_text(text.replace("max-replicas: 3", "max-replicas: 4"))
    with pytest.raises(CommandError) as err:
        serve("-f", str(path))
    assert "--max-replicas need a new service" in str(err.value) and "\n" not in str(err.value)
    assert list(Service.objects.values()) == before


@pytest.mark.usefixtures("cluster")
def test_a_bad_file_is_one_line_and_creates_nothing(monkeypatch, tmp_path):
    _worker(monkeypatch)
    base = "name: chat\nfrom: trained:10\n"
    cases = [
        (base + "min-replica: 0\n", "unknown key 'min-replica': did you mean 'min_replicas'?"),
        (base + "replicas: two\n", "replicas: takes a whole number, e.g. `replicas: 2`; not 'two'"),
        (
            base + "engine: tgi\n",
            "engine: takes transformers or vllm or sglang or custom, e.g. `engine: vllm`; not 'tgi'",
        ),
        ("- chat\n- trained\n", "write options as `key: value` lines, e.g. `name: chat`"),
        ("name: [chat\n", "not valid YAML (line 2)"),
        (base + "# padding\n" * 7000, "at most 64 KiB"),
        ("from: trained\n", "name the service: `name: chat`, or NAME typed beside the file"),
        ("name: chat\n", "name the checkpoint to serve: `from: JOB[:STEP|latest]`, or --from typed beside the file"),
    ]
    for number, (text, message) in enumerate(cases):
        path = tmp_path / f"bad{number}.yaml"
        path.write_text(text)
        with pytest.raises(CommandError) as err:
            serve("-f", str(path))
        assert str(err.value) == f"service file {path}: {message}", text[:80]
    # serving/requests.py's checks, the same for a file's values as for flags
    checks = [
        ("min-replicas: 3\nmax-replicas: 2\n", "--min-replicas 3 is above --max-replicas 2"),
        ("min-replicas: 0\nidle-after: 30s\n", "--idle-after must be at least 1m, not 30s"),
        ("idle-after: 20m\n", "--idle-after is for --min-replicas 0"),
        ("cold-start-timeout: 2h\n", "--cold-start-timeout must be 1s-1h"),
    ]
    for number, (extra, message) in enumerate(checks):
        path = tmp_path / f"check{number}.yaml"
        path.write_text(base + extra)
        with pytest.raises(CommandError) as err:
            serve("-f", str(path))
        assert message in str(err.value) and "\n" not in str(err.value), extra
    with pytest.raises(CommandError, match=r"^cannot read service file /nonexistent/chat.yaml: No such file"):
        serve("-f", "/nonexistent/chat.yaml")
    assert (Service.objects.count(), Replica.objects.count(), held()) == (0, 0, set())


# how a command answers, whom it acts as, where it reads: not what a service is started with
SURFACE_ONLY = {"file", "stop", "list", "json", "as_user", "help", "version"}


def test_manage_py_serve_and_ugro_serve_have_every_option_of_the_table_and_no_other():
    _check_flags({a.dest: a for a in manage_parser()._actions if a.dest not in DJANGO | SURFACE_ONLY}, {}, SERVE)
    dests = {next(o.field for o in SERVE if key in o.file_keys): dest for key, dest in cli.SERVE_FIELDS}
    assert set(dests) == {o.field for o in SERVE}, "SERVE_FIELDS and the serve spec differ"
    client = {a.dest: a for a in _subparser("serve")._actions if a.dest not in SURFACE_ONLY}
    assert tuple(client["engine"].choices) == next(o.choices for o in SERVE if o.field == "engine")
    _check_flags(client, dests, SERVE)


def test_the_option_table_in_the_docs_is_the_one_the_serve_spec_makes():
    shown = table(SERVE)
    assert shown in (REPO / "docs" / "serving.md").read_text(), f"docs/serving.md's table is stale:\n{shown}"
