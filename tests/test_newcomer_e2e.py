"""What a new user does, as the README tells it, run from the README itself: the fenced blocks under "Start it",
"The CLI" (set it up once), "Add your nodes" and the one at the top, each line through bash as written, in that
order. So `bin/start` on a default install (its own PostgreSQL, no DATABASE_URL), `bin/setup` (which links
`~/.local/bin/ugro`: every `ugro` line runs the one on PATH), the token command, `ugro whoami`, the cluster.yaml
imported and exported, an attached launch followed to its end, status, logs, results, a detached launch
cancelled; then the first job's loss curve in Chromium and Ctrl-C.

Only what must be this run's is not the README's: the port, data dir, HOME and Redis database in the
environment, and the cluster.yaml's content (the README's addresses are a user's LAN: the test writes as many
loopback sshd nodes, in the same format). Lines that start with `ugro` run in the user's directory (where the
cluster.yaml is), the others in the checkout. A README line that no longer runs, or says what it did not do,
fails here.

Cancelling a running job on real nodes is test_cli_process's, one that is starting test_launch_e2e's; here the
cancel comes as fast as a user types it, whatever state the job has reached. tests/test_docs_commands.py checks
in a second that these blocks are where this test reads them.
"""

from __future__ import annotations

import getpass
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, cluster_yaml, free_port, started_by, wait_for
from .test_browser import CHROMIUM, CHROMIUM_ARGS, http_ok
from .test_dashboard_browser import BLUE, INK
from .worker_env import redis_url_for

pytestmark = [pytest.mark.e2e, pytest.mark.browser]
REDIS_DB = 13  # not used by other tests (xdist workers use 0..N, test_start_script 12)
README = REPO / "README.md"
# The README's sections a newcomer goes through, in order; the blocks at the top (before any "## ") come last:
# they need UGRO started, set up and given nodes
SECTIONS = ("## Start it", "## The CLI", "## Add your nodes", "# UGRO")


def readme_blocks() -> dict[str, list[tuple[str, list[str]]]]:
    """Each of SECTIONS -> its fenced blocks, as (language, lines)."""
    blocks: dict[str, list[tuple[str, list[str]]]] = {s: [] for s in SECTIONS}
    section, fence = None, None
    for line in README.read_text().splitlines():
        if fence is not None:
            if line.startswith("```"):
                if section:
                    blocks[section].append(fence)
                fence = None
            else:
                fence[1].append(line)
        elif line.startswith("```"):
            fence = (line[3:].strip(), [])
        elif line.startswith("#"):
            section = next((s for s in SECTIONS if line.startswith(s + " ") or line == s), None)
    return blocks


def readme_steps() -> tuple[str, list[str], str, list[str]]:
    """(the start command, the set-up lines, the cluster.yaml, the lines that use it), as the README shows them."""
    blocks = readme_blocks()
    (start,) = blocks["## Start it"][0][1]
    setup = [ln for ln in blocks["## The CLI"][0][1] if ln.strip()]
    (cluster,) = [lines for lang, lines in blocks["## Add your nodes"] if lang == "yaml"]
    nodes = next(lines for lang, lines in blocks["## Add your nodes"] if lang != "yaml")
    quick = [ln for ln in blocks["# UGRO"][0][1] if ln.strip()]
    return start, setup, "\n".join(cluster), [ln for ln in nodes if ln.strip()] + quick


def argv_of(line: str) -> list[str]:
    return shlex.split(line, comments=True)


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"({path} unreadable)"


@pytest.mark.timeout(900)
def test_a_newcomer_follows_the_readme(loopback, private_data_dir, tmp_path):
    """Covers: the README's commands verbatim from a fresh data dir: bin/start with its own PostgreSQL, bin/setup's ugro
    on PATH, jobs on real sshd nodes, the loss curve in Chromium, and Ctrl-C stopping everything.
    """
    start_line, setup, readme_cluster, lines = readme_steps()
    assert argv_of(setup[0]) == ["bin/setup"], setup  # first, and it needs no server (below)
    data = str(private_data_dir)
    run_dir = private_data_dir / "run"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    home = tmp_path / "home"
    home.mkdir()
    workdir = tmp_path / "work"  # the user's directory, with their cluster.yaml
    workdir.mkdir()
    # bin/test gives each run a Redis server of its own: a database of ours on it; else the default server's
    redis = redis_url_for(os.environ["REDIS_URL"], REDIS_DB) if "REDIS_URL" in os.environ else (
        f"redis://127.0.0.1:6379/{REDIS_DB}")  # fmt: skip
    # the default install: no DATABASE_URL, so bin/start runs its own PostgreSQL in the data dir; UGRO's settings
    skip = ("DATABASE_URL", "UGRO_TEST_DB_NAME", "UGRO_TOKEN", "DJANGO_SETTINGS_MODULE", "XDG_CONFIG_HOME")
    env = {k: v for k, v in os.environ.items() if k not in skip}
    # a user's PATH: ~/.local/bin (where bin/setup links ugro) first, and no venv of the checkout's
    path = [p for p in env.get("PATH", "/usr/bin:/bin").split(":") if not p.startswith(str(REPO))]
    env.update(UGRO_DATA_DIR=data, UGRO_PORT=str(port), REDIS_URL=redis, HOME=str(home), UGRO_URL=base,
               PATH=":".join([str(home / ".local" / "bin"), *path]))  # fmt: skip
    out = tmp_path / "start.out"

    def logs() -> str:
        return (f"bin/start:\n{tail(out)}\nweb.log:\n{tail(run_dir / 'web.log')}\n"
                f"worker.log:\n{tail(run_dir / 'worker.log')}")  # fmt: skip

    def run(line: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """One README line through bash, as typed: `ugro` lines in the user's directory, others in the checkout."""
        cwd = workdir if argv_of(line)[0] == "ugro" else REPO
        done = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"README line `{line}` exited {done.returncode}:\n{done.stdout[-3000:]}" + (
            f"\n{done.stderr[-3000:]}\n{logs()}")  # fmt: skip
        return done

    start = subprocess.Popen(
        ["bash", "-c", start_line], cwd=REPO, env=env, stdout=open(out, "wb"), stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a terminal gives it; Ctrl-C = SIGINT to the group
    )  # fmt: skip
    # bin/setup needs no server: it runs while bin/start starts, as in a second terminal, at a lower priority so
    # that it takes the CPU bin/start leaves while it waits for its database
    linking = subprocess.Popen(["bash", "-c", setup[0]], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, preexec_fn=lambda: os.nice(19))  # fmt: skip
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

        # 2. the client, set up once: bin/setup has linked ugro onto the user's PATH; a token saved; whoami
        linked, _ = linking.communicate(timeout=300)
        assert linking.returncode == 0, f"README line `{setup[0]}` exited {linking.returncode}:\n{linked[-3000:]}"
        assert (home / ".local" / "bin" / "ugro").resolve() == REPO / ".venv" / "bin" / "ugro"
        found = subprocess.run(["bash", "-c", "command -v ugro"], env=env, capture_output=True, text=True)
        assert found.stdout.strip() == str(home / ".local" / "bin" / "ugro"), found.stdout
        for line in setup[1:]:
            done = run(line)
            if argv_of(line)[0] == "ugro":  # whoami: what its comment says, with you and this run's URL
                said = line.split("#", 1)[1].strip().replace("you", admin, 1).replace("http://127.0.0.1:8099", base)
                assert done.stdout.strip() == said, done.stdout
            else:  # the token, saved where the client reads it
                assert (home / ".config" / "ugro" / "token").exists(), done.stdout + done.stderr

        # 3. the user's cluster.yaml (as many nodes as the README's, on loopback), then the README's lines
        nodes = len(yaml.safe_load(readme_cluster)["nodes"])
        (workdir / "cluster.yaml").write_text(cluster_yaml(loopback, nodes))
        ended: dict[str, str] = {}  # job -> its state as the README's commands showed it
        ids: dict[str, int] = {}  # job -> its id, as its launch said it
        for line in lines:
            argv = argv_of(line)
            verb, name = argv[1], (argv[2] if len(argv) > 2 else "")
            done = run(line, timeout=300)
            said = done.stdout.splitlines() or [""]
            if verb == "import_cluster":
                assert said[0].startswith(f"imported {name}: "), done.stdout
            elif verb == "launch":
                name = argv[argv.index("--name") + 1]
                queued = re.match(rf"job {name} queued \(id (\d+)\)", said[0])
                assert queued, done.stdout
                ids[name] = int(queued[1])
                assert "no UGRO worker is running" not in done.stdout
                if "--detach" not in argv:  # followed live to its end, every rank's lines
                    assert said[-1] == f"-- job {name} succeeded", done.stdout[-3000:] + logs()
                    count = int(argv[argv.index("--nodes") + 1])
                    assert {f"[rank {r}]" for r in range(count)} <= {ln[:8] for ln in said}, done.stdout[-3000:]
                    ended[name] = "succeeded"
            elif verb == "status":
                assert said[0].endswith(f": {ended[name]}"), done.stdout
            elif verb == "logs":
                assert said[-1] == f"-- job {name} {ended[name]}", done.stdout[-3000:]
                assert any(ln.startswith("[rank 0] ") for ln in said), done.stdout[-3000:]
            elif verb == "results":
                assert re.search(r"^  final loss: \S+ at step \d+", done.stdout, re.M), done.stdout
            elif verb == "cancel":
                assert done.stdout.strip() == f"job {name} cancelled; no process of it remains on its nodes"
                ended[name] = "cancelled"
        assert sorted(ended.values()) == ["cancelled", "succeeded"], ended  # a job run to its end, one cancelled
        first_id = next(ids[n] for n, state in ended.items() if state == "succeeded")

        # 4. the dashboard: the first job's page asks to log in; with the printed password, it draws its loss curve
        from playwright.sync_api import sync_playwright

        errors: list[str] = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_context(viewport={"width": 1440, "height": 1000}).new_page()
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
                page.goto(f"{base}/jobs/{first_id}/")
                assert "/accounts/login/" in page.url
                page.fill("#id_username", admin)
                page.fill("#id_password", password)
                page.click("button[type=submit]")
                page.wait_for_url(f"{base}/jobs/{first_id}/", timeout=30_000)
                try:
                    page.wait_for_selector("#panels[data-ready]", state="attached", timeout=30_000)
                except Exception as exc:
                    raise AssertionError(f"the job page's panels never ready; page errors: {errors}") from exc
                wait_for(lambda: page.evaluate(INK, ["loss", list(BLUE)]) > 10, timeout=15,
                         what="the loss curve drawn")  # fmt: skip
            finally:
                browser.close()
        assert not errors, errors

        # 5. Ctrl-C: everything stops, PostgreSQL included, with exit status 0
        os.killpg(start.pid, signal.SIGINT)
        try:
            stopped = start.wait(timeout=60)
        except subprocess.TimeoutExpired:  # say what is still running, and what bin/start and its services said
            raise AssertionError(f"bin/start runs 60 s after Ctrl-C; left: {started_by(data)}\n{logs()}") from None
        assert stopped == 0, logs()
        assert "exited" not in out.read_text(), logs()  # no service died and was started again on the way
        wait_for(lambda: not started_by(data), timeout=30, what="every process bin/start started to stop")
        for name in ("web.log", "worker.log"):
            assert "Traceback" not in (run_dir / name).read_text(), f"{name}:\n{tail(run_dir / name, 20000)}"
    finally:
        if linking.poll() is None:
            linking.kill()
        if start.poll() is None:
            os.killpg(start.pid, signal.SIGKILL)
        for pid in started_by(data):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
