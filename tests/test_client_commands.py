"""What the docs show through the `ugro` client and the REST API, as a real console script run by a Python
without Django against a live server: launch's recovery and batch options, resume (comma-separated nodes,
--detach), logs --attempt, sweeps, alerts, cluster.yaml import and export, trust; each refused in one line
under a role that does not allow it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile

import pytest
import yaml
from django.contrib.auth.models import Group, User
from django.utils import timezone

from accounts.tokens import create_token
from cluster.models import Alert, Node
from jobs import sync
from jobs.models import Job, JobCode, Sweep
from ugro_client.cli import upload
from ugro_client.http import ApiError, Client

from .conftest import wait_for
from .test_client import NO_DJANGO_PYTHON, server, ugro, ugro_script  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def operator(server):  # noqa: F811
    user = User.objects.create_user("olga")
    user.groups.add(Group.objects.get(name="operator"))
    _, token = create_token(user, "ops", "operate")
    return token


def test_launch_takes_the_recovery_and_batch_options_the_docs_show(ugro_script, server):  # noqa: F811
    Node.objects.create(name="n2", address="127.0.0.3")
    done = ugro(ugro_script, server, "launch", "--name", "rec1", "--nodes", "2", "--retry", "node-lost,oom",
                "--max-attempts", "4", "--min-nodes", "1", "--resume-template=--resume_from_checkpoint {checkpoint}",
                "--checkpoint-glob", "runs/{job}/*.ckpt", "--hang-after", "120", "--batch-per-gpu", "16",
                "--batch-weights", "n1=1.6,n2=1", "--detach", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["name"] == "rec1"
    job = Job.objects.get(name="rec1")
    assert (job.retry_on, job.max_attempts, job.min_nodes) == (["NODE_LOST", "OOM"], 4, 1)
    assert job.resume_template == "--resume_from_checkpoint {checkpoint}" and job.checkpoint_glob == "runs/{job}/*.ckpt"
    assert job.params["batch_per_gpu"] == 16 and job.params["batch_weights"] == {"n1": 1.6, "n2": 1.0}
    # a bad option value is refused in one line and creates nothing
    bad = ugro(ugro_script, server, "launch", "--name", "rec2", "--retry", "sometimes", "--detach")
    assert bad.returncode == 3 and bad.stderr.count("\n") == 1 and "retry" in bad.stderr
    assert not Job.objects.filter(name="rec2").exists()


def test_resume_takes_comma_separated_nodes_and_detach(ugro_script, server):  # noqa: F811
    Node.objects.create(name="n2", address="127.0.0.3")
    job = Job.objects.create(name="r1", script="x.py", state=Job.State.FAILED, owner=server["user"],
                             finished_at=timezone.now(), failure_kind="SCRIPT_ERROR")  # fmt: skip
    done = ugro(ugro_script, server, "resume", "r1", "--from", "scratch", "--nodes", "n1,n2", "--detach", "--json")
    assert done.returncode == 0, done.stderr
    job.refresh_from_db()
    assert job.state == Job.State.QUEUED and job.attempt == 2 and json.loads(done.stdout)["attempt"] == 2
    # on the nodes asked for: the new attempt's, the job keeps what its launch asked
    assert job.current.requested_nodes == ["n1", "n2"] and job.nodes_asked == ["n1", "n2"] and job.requested_nodes == []


def test_logs_attempt_reads_an_earlier_attempt_or_says_there_is_none(ugro_script, server):  # noqa: F811
    Job.objects.create(name="l1", script="x.py", state=Job.State.FAILED, owner=server["user"])
    missing = ugro(ugro_script, server, "logs", "l1", "--attempt", "3")
    assert missing.returncode == 3 and missing.stderr == "ugro logs: job l1 has no attempt 3 (attempts 1-1)\n"
    follow = ugro(ugro_script, server, "logs", "l1", "--attempt", "1", "--follow")
    assert follow.returncode == 2 and "--follow is for the current one" in follow.stderr


def test_a_sweep_is_created_shown_and_cancelled_through_the_client(ugro_script, server):  # noqa: F811
    made = ugro(ugro_script, server, "sweep", "lrs", "--grid", "lr=0.1,0.2", "--grid", "batch-size=8,16",
                "--max-concurrent", "2", "--", "--max-steps", "5")  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith("sweep lrs: loss (min) created")
    sweep = Sweep.objects.get(name="lrs")
    assert sweep.trials.count() == 4 and sweep.max_concurrent == 2
    assert all(t.state == Job.State.QUEUED and t.owner == server["user"] for t in sweep.trials.all())
    shown = json.loads(ugro(ugro_script, server, "sweep", "lrs", "--show", "--json").stdout)
    assert [t["name"] for t in shown["trials"]] == ["lrs-001", "lrs-002", "lrs-003", "lrs-004"]
    assert shown["trials"][0]["params"] == {"lr": 0.1, "batch-size": 8}
    cancelled = ugro(ugro_script, server, "sweep", "lrs", "--cancel")
    assert cancelled.returncode == 0, cancelled.stderr
    assert set(sweep.trials.values_list("state", flat=True)) == {Job.State.CANCELLED}
    bad = ugro(ugro_script, server, "sweep", "bad", "--grid", "lr")
    assert bad.returncode == 3 and bad.stderr.count("\n") == 1 and not Sweep.objects.filter(name="bad").exists()


def test_alerts_lists_the_open_ones_and_all_with_json(ugro_script, server):  # noqa: F811
    node = Node.objects.get(name="n1")
    now = timezone.now()
    Alert.objects.create(node=node, key="down", severity="critical", message="n1 is DOWN", opened_at=now,
                         updated_at=now)  # fmt: skip
    Alert.objects.create(node=node, key="disk", severity="warning", message="disk 95 %", opened_at=now, updated_at=now,
                         resolved_at=now)  # fmt: skip
    shown = ugro(ugro_script, server, "alerts")
    assert shown.returncode == 0 and "CRITICAL" in shown.stdout and "n1 is DOWN (open)" in shown.stdout
    assert "disk" not in shown.stdout
    every = json.loads(ugro(ugro_script, server, "alerts", "--all", "--json").stdout)["alerts"]
    assert {a["key"] for a in every} == {"down", "disk"}


def test_cluster_yaml_is_exported_and_imported_by_an_operator_only(ugro_script, server, operator, tmp_path):  # noqa: F811
    exported = ugro(ugro_script, server, "export_cluster")
    assert exported.returncode == 0 and "n1" in exported.stdout and "127.0.0.2" in exported.stdout
    as_json = json.loads(ugro(ugro_script, server, "export_cluster", "--json").stdout)
    assert as_json["nodes"]["n1"]["ip"] == "127.0.0.2"
    path = tmp_path / "cluster.yaml"
    path.write_text(exported.stdout.replace("127.0.0.2", "127.0.0.9"))
    # a launcher may not change the cluster: one line, nothing changed
    refused = ugro(ugro_script, server, "import_cluster", str(path))
    assert refused.returncode == 4 and refused.stderr.count("\n") == 1
    assert Node.objects.get(name="n1").address == "127.0.0.2"
    # an operator may
    done = ugro(ugro_script, server, "import_cluster", str(path), token=operator)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"imported {path}: ") and Node.objects.get(name="n1").address == "127.0.0.9"
    # a file that is not cluster.yaml is refused in one line, all or nothing
    path.write_text("nodes: [{name: 'a;b', ip: 1}]\n")
    bad = ugro(ugro_script, server, "import_cluster", str(path), token=operator)
    assert bad.returncode == 3 and bad.stderr.count("\n") == 1 and "nothing was imported" in bad.stderr
    assert list(Node.objects.values_list("name", flat=True)) == ["n1"]
    missing = ugro(ugro_script, server, "import_cluster", str(tmp_path / "nope.yaml"), token=operator)
    assert missing.returncode == 2 and missing.stderr.startswith("ugro import_cluster: cannot read")


def test_trust_is_for_operators_and_an_unreachable_node_is_one_line(ugro_script, server, operator):  # noqa: F811
    Node.objects.filter(name="n1").update(ssh_port=9)  # nothing listens there
    refused = ugro(ugro_script, server, "trust", "n1")
    assert refused.returncode == 4 and refused.stderr.count("\n") == 1
    down = ugro(ugro_script, server, "trust", "n1", "--fingerprint", "SHA256:abc", token=operator, timeout=90)
    assert down.returncode == 3 and down.stderr.count("\n") == 1 and down.stderr.startswith("ugro trust: ")
    assert Node.objects.get(name="n1").host_key == ""


def test_version_shows_the_clients_and_the_servers_and_warns_when_they_differ(ugro_script, server):  # noqa: F811
    import re
    import tomllib

    from .conftest import REPO

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    shown = ugro(ugro_script, server, "--version")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [f"ugro client {version}", f"UGRO server {version} at {server['url']}"]
    assert shown.stderr == ""
    # a client from another checkout: told, not refused
    path, site = ugro_script
    init = site / "ugro_client" / "__init__.py"
    original = init.read_text()
    try:
        init.write_text(re.sub(r'__version__ = "[^"]+"', '__version__ = "0.0.1"', original))
        other = ugro(ugro_script, server, "--version")
    finally:
        init.write_text(original)
    assert other.returncode == 0 and "ugro client 0.0.1" in other.stdout
    assert f"warning: client 0.0.1 and server {version} differ" in other.stderr


def test_the_client_installs_alone_on_an_old_python_without_django(tmp_path):
    import glob
    import shutil
    import subprocess
    import tomllib

    from .conftest import REPO

    # the oldest Python here that pip can install for (3.9 where pyenv has it; Debian's otherwise)
    pythons = sorted(glob.glob("/root/.pyenv/versions/3.9*/bin/python3.9")) or ["/usr/bin/python3"]
    python = pythons[0]
    src = tmp_path / "src"
    shutil.copytree(REPO / "ugro_client", src, ignore=shutil.ignore_patterns("__pycache__", "build"))
    client = tomllib.loads((src / "pyproject.toml").read_text())["project"]
    assert client["requires-python"] == ">=3.9" and client["dependencies"] == ["pathspec>=0.12"]
    assert client["version"] == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    target = tmp_path / "site"
    subprocess.run([python, "-m", "pip", "install", "-q", "--target", str(target), str(src)],
                   check=True, capture_output=True, timeout=180)  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(target), "HOME": str(tmp_path), "UGRO_URL": "http://127.0.0.1:9"}
    shown = subprocess.run([python, str(target / "bin" / "ugro"), "--version"], env=env, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert shown.stdout == f"ugro client {client['version']}\n"
    assert shown.returncode == 5 and shown.stderr.startswith("ugro --version: the server's version is unknown: ")
    assert not (target / "django").exists()


def test_a_job_file_is_read_like_the_flags_and_the_flags_typed_win(ugro_script, server, tmp_path, settings):  # noqa: F811
    settings.DATA_DIR = tmp_path / "data"
    (tmp_path / "job" / "src").mkdir(parents=True)
    (tmp_path / "job" / "src" / "train.py").write_text("print('hi')\n")
    job_file = tmp_path / "job" / "job.yaml"
    job_file.write_text(
        "# my run\nname: filed\nnodes: 1\nscript: train.py\nsync: ./src\ntime-limit: 2h\nretry: [node-lost]\n"
        "priority: 20\nextra_args: [--max-steps, '50']\n"
    )
    # --dry-run -f prints a job file: the resolved spec (the typed --priority over the file's, the file's sync
    # directory made absolute) and each rank's command as a comment
    dry = ugro(ugro_script, server, "launch", "-f", str(job_file), "--priority", "5", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert yaml.safe_load(dry.stdout) == {
        "name": "filed", "nodes": 1, "script": "train.py", "time_limit": "2h", "priority": 5, "retry": ["node-lost"],
        "sync": str(tmp_path / "job" / "src"), "extra_args": ["--max-steps", "50"],
    }  # fmt: skip
    assert "# dry run of job filed: nothing was created or started" in dry.stdout.splitlines()
    assert not Job.objects.exists()
    # saved elsewhere and launched under a typed name: the spec it printed, the directory uploaded
    saved = tmp_path / "resolved.yaml"
    saved.write_text(dry.stdout)
    done = ugro(ugro_script, server, "launch", "-f", str(saved), "--name", "filed2", "--detach", "--json")
    assert done.returncode == 0, done.stderr
    job = Job.objects.get(name="filed2")
    assert (job.retry_on, job.priority, job.time_limit_s, job.script_args[-2:]) == (["NODE_LOST"], 5, 7200,
                                                                                    ["--max-steps", "50"])  # fmt: skip
    assert JobCode.objects.get(job=job).sync_source.endswith(str(tmp_path / "job" / "src"))
    # a key that is no option, or a file that is not YAML, is refused in one line that names the file and the fix
    job_file.write_text("name: bad\nnodez: 1\n")
    bad = ugro(ugro_script, server, "launch", "-f", str(job_file), "--detach")
    assert (bad.returncode, bad.stderr) == (3, f"ugro launch: {job_file}: unknown key 'nodez': did you mean 'nodes'?\n")
    job_file.write_text("name: [unclosed\n")
    bad = ugro(ugro_script, server, "launch", "-f", str(job_file), "--detach")
    assert bad.returncode == 3 and bad.stderr == f"ugro launch: {job_file}: not valid YAML (line 2)\n"
    assert Job.objects.count() == 1
    # a sweep file too, with the command line's names and a grid as a mapping
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text("name: sw\ngrid:\n  lr: [0.1, 0.2]\nmax-concurrent: 1\n")
    made = ugro(ugro_script, server, "sweep", "-f", str(sweep_file), "--json")
    assert made.returncode == 0, made.stderr
    assert len(json.loads(made.stdout)["trials"]) == 2 and Sweep.objects.get(name="sw").max_concurrent == 1


def test_the_job_files_json_schema_is_published_from_the_launch_spec(server):  # noqa: F811
    from django.test import Client as WebClient

    web = WebClient()
    headers = {"HTTP_AUTHORIZATION": f"Bearer {server['token']}"}
    schema = web.get("/api/v1/spec/launch.schema.json", **headers).json()
    assert {"nodes", "node", "count", "time_limit", "time-limit", "hang_after", "sync"} <= set(schema["properties"])
    assert "dry_run" not in schema["properties"]
    assert schema["additionalProperties"] is False and schema["required"] == ["name"]
    assert schema["properties"]["priority"]["maximum"] == 100 and schema["properties"]["count"]["minimum"] == 1
    assert schema["properties"]["extra_args"]["type"] == ["array", "string"]
    assert web.get("/api/v1/spec/sweep.schema.json", **headers).json()["title"] == "UGRO sweep file"
    assert web.get("/api/v1/spec/nope.schema.json", **headers).status_code == 404


def test_ones_own_tokens_through_the_client_never_wider_than_the_token_used(ugro_script, server, tmp_path):  # noqa: F811
    made = ugro(ugro_script, server, "token", "create", "ci", "--scope", "read", "--save", str(tmp_path / "tok"),
                "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    row = json.loads(made.stdout)
    assert row["scope"] == "read" and row["user"] == "dana" and row["token"].startswith("ugro_")
    saved = tmp_path / "tok"
    assert saved.read_text().strip() == row["token"] and (saved.stat().st_mode & 0o777) == 0o600
    # the new read token works, and cannot make a wider one; a launch token cannot make an operate one
    listed = ugro(ugro_script, server, "token", "list", token=row["token"])
    assert listed.returncode == 0 and row["prefix"] in listed.stdout and "active" in listed.stdout
    wider = ugro(ugro_script, server, "token", "create", "x", "--scope", "launch", token=row["token"])
    assert wider.returncode == 4 and wider.stderr == "ugro token: a read-scoped token cannot make a launch-scoped one\n"
    assert ugro(ugro_script, server, "token", "create", "y", "--scope", "operate").returncode == 4
    # revoked, it no longer opens anything
    gone = ugro(ugro_script, server, "token", "revoke", row["prefix"])
    assert gone.returncode == 0 and gone.stdout == f"token {row['prefix']} revoked\n"
    assert ugro(ugro_script, server, "status", token=row["token"]).returncode == 4
    again = ugro(ugro_script, server, "token", "revoke", row["prefix"])
    assert again.returncode == 3 and again.stderr == f"ugro token: token {row['prefix']} was already revoked\n"


def test_preflight_through_the_client_names_each_problem_and_exits_1(ugro_script, server):  # noqa: F811
    Node.objects.filter(name="n1").update(ssh_port=9)  # nothing listens there
    failed = ugro(ugro_script, server, "preflight", "--json", timeout=120)
    assert failed.returncode == 1, failed.stderr
    report = json.loads(failed.stdout)
    assert report["ok"] is False and report["nodes"] == ["n1"] and any("n1" in p for p in report["problems"])
    assert failed.stderr.startswith("ugro preflight: failed on 1 node(s): ")
    unknown = ugro(ugro_script, server, "preflight", "--nodes", "n1,ghost")
    assert unknown.returncode == 3 and unknown.stderr == "ugro preflight: unknown node(s): ghost\n"


def test_launch_sync_uploads_the_directory_once_and_the_job_runs_its_copy(ugro_script, server, tmp_path, settings):  # noqa: F811
    settings.DATA_DIR = tmp_path / "data"
    project = tmp_path / "proj"
    (project / "lib").mkdir(parents=True)
    (project / "train.py").write_text("print('hi')\n")
    (project / "lib" / "big.py").write_bytes(b"#" * 300_000)
    (project / ".gitignore").write_text("*.ckpt.bak\n")
    (project / "old.ckpt.bak").write_text("x")
    # a laptop's `ugro launch --sync DIR` uploads the tree (not what .gitignore leaves out) and queues the job
    done = ugro(ugro_script, server, "launch", "--name", "up1", "--sync", str(project), "--script", "train.py",
                "--detach", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    code = JobCode.objects.get(job__name="up1")
    assert code.sync_files == 3 and code.sync_source.startswith("dana@") and code.sync_source.endswith(str(project))
    listed = {f["path"] for f in sync.load_manifest(code.sync_digest)["files"]}
    assert listed == {"train.py", "lib/big.py", ".gitignore"} and not sync.missing_objects(sync.load_manifest(
        code.sync_digest))  # fmt: skip
    # the same tree again sends no file: the server has every one
    sent = []
    client = Client(server["url"], server["token"])
    original = client.post_bytes
    client.post_bytes = lambda *a: sent.append(a) or original(*a)
    assert upload(client, str(project)) == code.sync_digest and sent == []
    # a script outside the uploaded tree is refused in one line, and bytes that are not their name are not kept
    bad = ugro(ugro_script, server, "launch", "--name", "up2", "--sync", str(project), "--script", "nope.py",
               "--detach")  # fmt: skip
    assert bad.returncode == 3 and "script nope.py is not in dana@" in bad.stderr and bad.stderr.count("\n") == 1
    assert not Job.objects.filter(name="up2").exists()
    tampered = Client(server["url"], server["token"])
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("0" * 64)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(ApiError, match="the uploaded bytes have sha256"):
        tampered.post_bytes("sync/objects", buffer.getvalue(), "application/x-tar")


def test_an_attached_launch_that_waits_says_why_and_again_when_that_changes(ugro_script, server, tmp_path):  # noqa: F811
    # given n2 is down: a job on n1 and n2 cannot start
    Node.objects.create(name="n2", address="127.0.0.3", status=Node.Status.DOWN)
    out = tmp_path / "launch.out"
    path, site = ugro_script
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "PYTHON"))}
    env.update(PYTHONPATH=str(site), UGRO_URL=server["url"], UGRO_TOKEN=server["token"], HOME="/nonexistent")
    # when it is launched attached
    proc = subprocess.Popen([NO_DJANGO_PYTHON, str(path), "launch", "--name", "w1", "--node", "n1", "--node", "n2"],
                            env=env, stdout=open(out, "wb"), stderr=subprocess.STDOUT)  # fmt: skip
    try:
        # then it says why it waits, as `ugro queue` does: which node, in which state
        wait_for(lambda: "w1 waits" in out.read_text(), timeout=30, what="the reason it waits")
        assert "w1 waits (resources): needs 2 nodes (whole); not enough such nodes are up (n2 down)" in out.read_text()
        # and when the reason changes (n2 answers again, but an operator drained it), it says the new one
        Node.objects.filter(name="n2").update(status=Node.Status.HEALTHY, enabled=False)
        wait_for(lambda: "(n2 drained)" in out.read_text(), timeout=30, what="the new reason")
        # cancelled elsewhere, the attached launch ends with it
        assert ugro(ugro_script, server, "cancel", "w1").returncode == 0
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert text.count("w1 waits") == 2, text  # each reason once, however often it was asked
    assert "-- job w1 cancelled" in text


def test_netcheck_through_the_client_refuses_in_one_line_and_exits_1(ugro_script, server):  # noqa: F811
    unknown = ugro(ugro_script, server, "netcheck", "--nodes", "n1,ghost")
    assert unknown.returncode == 3 and unknown.stderr == "ugro netcheck: unknown node(s): ghost\n"
    sizes = ugro(ugro_script, server, "netcheck", "--sizes", "1,x")
    assert sizes.returncode == 2 and sizes.stderr.startswith("ugro netcheck: --sizes: whole numbers of MB")
    # given a second node nothing answers for: its interface cannot be chosen, and nothing is measured
    Node.objects.create(name="n9", address="127.0.0.9", ssh_port=9)
    failed = ugro(ugro_script, server, "netcheck", "--json", timeout=120)
    assert failed.returncode == 1 and failed.stderr.startswith("ugro netcheck: refused: ")
    report = json.loads(failed.stdout)
    assert report["ok"] is False and any(p.startswith("n9: ") for p in report["problems"]), report
    assert not report["netcheck"]
