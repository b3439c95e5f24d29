"""What a new user does, as the README tells it: `bin/start` on a default install (its own PostgreSQL, no
DATABASE_URL), a token saved with manage.py, `ugro whoami`, a cluster.yaml imported, a job launched,
followed, checked and its results read, a second one cancelled, the job page's loss curve in Chromium,
then Ctrl-C. The README's commands as written; only the data dir, port, HOME and Redis db are this test's."""

from __future__ import annotations

import getpass
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import FAST_TRAIN, REPO, SLOW_TRAIN, cluster_yaml, free_port, wait_for
from .test_browser import CHROMIUM, CHROMIUM_ARGS, http_ok
from .test_dashboard_browser import BLUE, INK
from .test_start_supervisor_e2e import started_by
from .worker_env import redis_url_for

pytestmark = [pytest.mark.e2e, pytest.mark.browser]
REDIS_DB = 13  # not used by other tests (xdist workers use 0..N, test_start_script 12)
PY = str(REPO / ".venv" / "bin" / "python")
UGRO = str(REPO / ".venv" / "bin" / "ugro")


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"({path} unreadable)"


@pytest.mark.timeout(900)
def test_a_newcomer_follows_the_readme(loopback, private_data_dir, tmp_path):
    data = str(private_data_dir)
    run_dir = private_data_dir / "run"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    home = tmp_path / "home"
    home.mkdir()
    # bin/test gives each run a Redis server of its own: a database of ours on it; else the default server's
    redis = redis_url_for(os.environ["REDIS_URL"], REDIS_DB) if "REDIS_URL" in os.environ else (
        f"redis://127.0.0.1:6379/{REDIS_DB}")  # fmt: skip
    # the default install: no DATABASE_URL, so bin/start runs its own PostgreSQL in the data dir; UGRO's settings
    skip = ("DATABASE_URL", "UGRO_TEST_DB_NAME", "UGRO_TOKEN", "DJANGO_SETTINGS_MODULE")
    env = {k: v for k, v in os.environ.items() if k not in skip}
    env.update(UGRO_DATA_DIR=data, UGRO_PORT=str(port), REDIS_URL=redis, HOME=str(home))
    client_env = dict(env, UGRO_URL=base)
    out = tmp_path / "start.out"

    def logs() -> str:
        return (f"bin/start:\n{tail(out)}\nweb.log:\n{tail(run_dir / 'web.log')}\n"
                f"worker.log:\n{tail(run_dir / 'worker.log')}")  # fmt: skip

    def command(argv: list[str], timeout: float = 60, environ: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=REPO, env=environ or env, capture_output=True, text=True, timeout=timeout)

    def ugro(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return command([UGRO, *args], timeout=timeout, environ=client_env)

    start = subprocess.Popen(
        [str(REPO / "bin" / "start")], cwd=REPO, env=env, stdout=open(out, "wb"), stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a terminal gives it; Ctrl-C = SIGINT to the group
    )  # fmt: skip
    try:
        # 1. bin/start: its own PostgreSQL, migrations, the demo node, the first admin with a printed password
        wait_for(lambda: "UGRO is up" in out.read_text() or start.poll() is not None, timeout=240,
                 interval=0.5, what="bin/start to say UGRO is up")  # fmt: skip
        assert start.poll() is None, logs()
        wait_for(lambda: http_ok(base + "/accounts/login/"), timeout=60, what="the web server to serve")
        said = re.search(r"created admin user '([^']+)' with password (\S+) \(also in (.+)\)", out.read_text())
        assert said, logs()
        admin, password = said.group(1), said.group(2)
        assert admin == getpass.getuser()
        assert (private_data_dir / "admin_password.txt").read_text().strip().endswith(password)

        # 2. the client, set up once: a token saved by manage.py (as the OS user's account), then whoami
        saved = command([PY, "manage.py", "token", "create", "laptop", "--scope", "launch", "--save"])
        assert saved.returncode == 0, saved.stdout + saved.stderr
        assert (home / ".config" / "ugro" / "token").exists(), saved.stdout + saved.stderr
        me = ugro("whoami")
        assert me.returncode == 0, me.stdout + me.stderr
        assert me.stdout.startswith(f"{admin} (role superuser, token scope launch) at {base}"), me.stdout

        # 3. the user's cluster.yaml: two nodes
        cluster = tmp_path / "cluster.yaml"
        cluster.write_text(cluster_yaml(loopback, 2))
        imported = command([PY, "manage.py", "import_cluster", str(cluster)])
        assert imported.returncode == 0, imported.stdout + imported.stderr

        # 4. a short job on both nodes, detached, then followed to its end
        launched = ugro("launch", "--name", "first", "--nodes", "2", "--detach", "--", *FAST_TRAIN)
        assert launched.returncode == 0, launched.stdout + launched.stderr
        assert launched.stdout.startswith("job first queued (id "), launched.stdout
        assert "no UGRO worker is running" not in launched.stdout
        followed = ugro("logs", "first", "--follow", timeout=300)
        assert followed.returncode == 0, followed.stdout[-3000:] + followed.stderr + logs()
        lines = followed.stdout.splitlines()
        assert lines and lines[-1] == "-- job first succeeded", followed.stdout[-3000:] + logs()
        assert {"[rank 0]", "[rank 1]"} <= {ln[:8] for ln in lines}, followed.stdout[-3000:]
        status = ugro("status", "first")
        assert status.returncode == 0, status.stdout + status.stderr
        assert status.stdout.splitlines()[0].endswith(": succeeded"), status.stdout
        results = ugro("results", "first")
        assert results.returncode == 0, results.stdout + results.stderr
        assert re.search(r"^  final loss: \S+ at step \d+", results.stdout, re.M), results.stdout
        first_id = json.loads(ugro("status", "first", "--json").stdout)["id"]

        # 5. a long job, detached, cancelled once it runs
        launched = ugro("launch", "--name", "second", "--nodes", "2", "--detach", "--", *SLOW_TRAIN)
        assert launched.returncode == 0, launched.stdout + launched.stderr

        def second_state() -> str:
            answer = ugro("status", "second", "--json")
            return json.loads(answer.stdout)["state"] if answer.returncode == 0 else ""

        wait_for(lambda: second_state() in ("running", "failed", "succeeded", "cancelled"), timeout=180,
                 interval=1, what="second to run")  # fmt: skip
        assert second_state() == "running", ugro("status", "second").stdout + logs()
        cancelled = ugro("cancel", "second", timeout=180)
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr + logs()
        assert cancelled.stdout.strip() == "job second cancelled; no process of it remains on its nodes"
        status = ugro("status", "second")
        assert status.returncode == 0, status.stdout + status.stderr
        assert status.stdout.splitlines()[0].endswith(": cancelled"), status.stdout

        # 6. the dashboard: the first job's page draws its loss curve
        from playwright.sync_api import sync_playwright

        errors: list[str] = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_context(viewport={"width": 1440, "height": 1000}).new_page()
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
                page.goto(base + "/")
                assert "/accounts/login/" in page.url
                page.fill("#id_username", admin)
                page.fill("#id_password", password)
                page.click("button[type=submit]")
                page.wait_for_url(base + "/", timeout=30_000)
                page.goto(f"{base}/jobs/{first_id}/")
                try:
                    page.wait_for_selector("#panels[data-ready]", state="attached", timeout=30_000)
                except Exception as exc:
                    raise AssertionError(f"the job page's panels never ready; page errors: {errors}") from exc
                wait_for(lambda: page.evaluate(INK, ["loss", list(BLUE)]) > 10, timeout=15,
                         what="the loss curve drawn")  # fmt: skip
            finally:
                browser.close()
        assert not errors, errors

        # 7. Ctrl-C: everything stops, PostgreSQL included, with exit status 0
        os.killpg(start.pid, signal.SIGINT)
        assert start.wait(timeout=60) == 0, logs()
        wait_for(lambda: not started_by(data), timeout=30, what="every process bin/start started to stop")
        for name in ("web.log", "worker.log"):
            assert "Traceback" not in (run_dir / name).read_text(), f"{name}:\n{tail(run_dir / name, 20000)}"
    finally:
        if start.poll() is None:
            os.killpg(start.pid, signal.SIGKILL)
        for pid in started_by(data):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
