"""Loaded with `-p tests.worker_env` (pyproject's addopts), before pytest-django reads the settings.

Under pytest-xdist each worker process gets a Redis database and a controller data directory of its
own: a Celery worker started by one pytest worker's test must never take the other's tasks nor answer
its "is a worker alive?", and job files must not meet. The test database is already per worker
(pytest-django adds the `_gw<N>` suffix). Without xdist this does nothing.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit


def redis_url_for(url: str, worker: int) -> str:
    """The worker's own database on the same Redis server: database `worker` of bin/test's Redis."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{worker}"))


_worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ... (xdist sets it before plugins load)
if _worker.startswith("gw") and _worker[2:].isdigit():
    _n = int(_worker[2:])
    if "REDIS_URL" in os.environ:
        os.environ["REDIS_URL"] = redis_url_for(os.environ["REDIS_URL"], _n)
    if "UGRO_DATA_DIR" in os.environ:
        os.environ["UGRO_DATA_DIR"] = os.path.join(os.environ["UGRO_DATA_DIR"], _worker)
