"""A throwaway PostgreSQL database for a benchmark's UGRO (UGRO runs on PostgreSQL only).

    with throwaway_database() as url:  # postgres://.../ugro_bench_<pid>_<random>
        ... DATABASE_URL=url ...

It is made on the server `UGRO_BENCH_DATABASE_URL` names (a database URL of a role that may create
databases; default the local server's `postgres` database, trust auth) and dropped on the way out,
WITH (FORCE): a worker, daphne or command the benchmark left connected cannot keep it alive. The name
carries the pid and a random part, so runs that overlap never share a database or drop each other's.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import psycopg
from psycopg import sql

DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432/postgres"


def server_url() -> str:
    return os.environ.get("UGRO_BENCH_DATABASE_URL") or DEFAULT_SERVER


def database_url(name: str, server: str | None = None) -> str:
    """The server's URL with `name` as its database (user, host, port and query kept)."""
    return urlsplit(server or server_url())._replace(path=f"/{name}").geturl()


@contextmanager
def throwaway_database(keep: bool = False) -> Iterator[str]:
    """Create a fresh database, yield its postgres:// URL, drop it afterwards (`keep`: leave it, and say
    where it is, as --keep leaves a benchmark's temp dir)."""
    server = server_url()
    name = f"ugro_bench_{os.getpid()}_{secrets.token_hex(4)}"
    with psycopg.connect(server, autocommit=True) as admin:  # CREATE/DROP DATABASE refuse a transaction
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield database_url(name, server)
    finally:
        if keep:
            print(f"kept the bench database {name} (DROP DATABASE {name} WITH (FORCE) when done)", file=sys.stderr)
        else:
            try:
                with psycopg.connect(server, autocommit=True) as admin:
                    admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
            except psycopg.Error as exc:  # the results are still worth having: say what is left behind
                print(f"could not drop the bench database {name}: {exc}", file=sys.stderr)
