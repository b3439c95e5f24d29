"""Bounded caches (docs/data.md, "Bounded caches"): the size limits of the nodes' stores and the controller's, as
cluster.yaml writes them (`cache_limit: 50GB` on a node, `paths.cache_limit` for every node, `paths.store_limit`
for the controller), and the requests that read and trim a node's store (cluster/node/cache.py). What a job or a
service needs, and so may not go, is the caller's to say (jobs/cache.py): cluster knows nothing of jobs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .fanout import node_request
from .models import ClusterSettings, Node

DEFAULT_CACHE_LIMIT = 50 * 10**9  # a node's store when cluster.yaml names no limit
DEFAULT_STORE_LIMIT = 20 * 10**9  # the controller's store (code snapshots, client uploads, the hash cache)
REQUEST_TIMEOUT_S = 300.0  # a trim walks the store and the trees it may remove: 100,000 files take seconds
FRESH_S = 600.0  # an object used this recently stays: a delivery under way may not have placed it yet

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt](?:ib|i|b)?|b)", re.IGNORECASE)
_UNITS = {"b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(value: object) -> int:
    """Bytes from a size as cluster.yaml writes it: 500MB, 50GB (or 50G), 1.5TB (powers of 1000), 64GiB (of 1024),
    4096B. ValueError in one line for anything else (a bare number: which unit?)."""
    text = str(value).strip() if isinstance(value, str | int | float) and not isinstance(value, bool) else ""
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"must be a size like 500MB, 50GB or 1.5TB, not {str(value)[:40]!r}")
    unit = m[2].lower()
    scale = _BINARY[unit[0]] if unit.endswith(("i", "ib")) else _UNITS[unit[0]]
    size = round(float(m[1]) * scale)
    if size < 1:
        raise ValueError(f"must be more than nothing, not {text!r}")
    return size


def format_size(size: int) -> str:
    """A size parse_size reads back to the same number of bytes: 50GB, 1500GB, 64GiB, 1234567B."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("TiB", 2**40), ("GiB", 2**30),
                        ("MiB", 2**20), ("kB", 10**3)):  # fmt: skip
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


def human(size: float | None) -> str:
    """A size for people: 1.2 GB, 340 MB, 12 kB."""
    n = float(size or 0)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def node_limit(node: Node, cs: ClusterSettings | None = None) -> int:
    """The node's cache limit: its own, else the cluster's (paths.cache_limit), else DEFAULT_CACHE_LIMIT."""
    if node.cache_limit:
        return int(node.cache_limit)
    cs = cs or ClusterSettings.load()
    given = (cs.paths or {}).get("cache_limit")
    return parse_size(given) if given else DEFAULT_CACHE_LIMIT


def store_limit(cs: ClusterSettings | None = None) -> int:
    """The controller's store limit (paths.store_limit), else DEFAULT_STORE_LIMIT."""
    cs = cs or ClusterSettings.load()
    given = (cs.paths or {}).get("store_limit")
    return parse_size(given) if given else DEFAULT_STORE_LIMIT


def stores(nodes: Iterable[Node]) -> list[list[Node]]:
    """The nodes grouped by the store they use: those of one working directory (the same Node.workdir_id) share
    one; a node without an id is alone. Each group in the nodes' order."""
    groups: dict[str, list[Node]] = {}
    for node in nodes:
        groups.setdefault(node.workdir_id or f"node:{node.pk}", []).append(node)
    return list(groups.values())


def _protected_field(protected: dict[str, str]) -> list[list]:
    by_why: dict[str, list[str]] = {}
    for sha, why in protected.items():
        by_why.setdefault(why, []).append(sha)
    return [[why, shas] for why, shas in by_why.items()]


def trim_store_of(node: Node, store: str, limit: int, protected: dict[str, str], jobs: list[dict]) -> dict:
    """Trim the node's store (<workdir>/.ugro/objects) to limit bytes (cluster/node/cache.py op_cache_trim):
    protected (sha256 -> why) never goes, nor what was used in the last FRESH_S; jobs ({job, trees, digest, ended,
    protected}) are the job trees there, ended ones oldest first."""
    return node_request(node, "cache_trim", timeout=REQUEST_TIMEOUT_S, store=store, workdir=node.workdir,
                        limit=int(limit), protected=_protected_field(protected), jobs=jobs,
                        fresh_s=FRESH_S)  # fmt: skip


def report_of(node: Node, store: str, protected: dict[str, str], jobs: list[dict]) -> dict:
    """What the node's store holds and why (cluster/node/cache.py op_cache_report)."""
    return node_request(node, "cache_report", timeout=REQUEST_TIMEOUT_S, store=store, workdir=node.workdir,
                        protected=_protected_field(protected), jobs=jobs)  # fmt: skip
