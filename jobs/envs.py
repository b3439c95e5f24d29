"""The job's Python environment on every node (docs/envs.md): `--packages FILE` names a lock (a pinned
requirements.txt, a uv.lock beside its pyproject.toml, or a pylock.toml); before pre-flight every node of the
attempt gets that environment in <workdir>/.ugro/envs/<key> (key: the lock's sha256, the node's Python version
and platform), built once per node (once per shared working directory) and kept, and the ranks start with its
torchrun.

The controller fetches each wheel once into its own cache (<DATA_DIR>/envs/wheels, with pip and its
configuration: the nodes need no internet access), for each Python version and platform its nodes have; the
wheels and uv itself travel by jobs/transfer.py (by sha256, only what a node lacks, node to node), and each node
builds with uv, offline, aside, moved into place whole (cluster/node/envs.py). The packages each node then holds
(names, versions, the wheels' sha256) are recorded with the job, and a job whose nodes differ does not start.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

from cluster.fanout import node_request, on_each
from cluster.models import ClusterSettings, Node

from . import transfer
from .data import hash_file
from .limits import parse_duration
from .models import Job, JobCode
from .sync import check_source, node_store, one_per_workdir

REQUEST_TIMEOUT_S = 60.0
BUILD_TIMEOUT_S = 3600.0
DOWNLOAD_TIMEOUT_S = 3600.0
DEFAULT_TTL_S = 14 * 86400
# uv's cache on a node (<workdir>/.ugro/uv-cache and the wheels it links, cluster/node/envs.py) is held under this
# share of the node's cache limit (what it alone keeps: unpacked files no environment links, and its wheels)
UV_CACHE_SHARE = 0.25
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9._,\s-]*\])?\s*===?\s*([A-Za-z0-9.+!_-]+)\s*(;.*)?$")
_WHEEL = re.compile(r"^([^-]+)-([^-]+)-(?:\d[^-]*-)?[^-]+-[^-]+-[^-]+\.whl$")


class EnvError(ValueError):
    """An environment that cannot be had: one line naming the node and the package where there is one."""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Lock:
    file: str  # the path given
    format: str  # requirements, uv.lock, pylock
    pins: list[list[str]]  # [name, version, marker, hashes (space-separated sha256:...)]
    sha256: str = ""

    def __post_init__(self) -> None:
        if not self.sha256:
            self.sha256 = hashlib.sha256(self.requirements().encode()).hexdigest()

    def requirements(self, hashes: bool = True) -> str:
        """The pins as pip and uv read them."""
        out = []
        for name, version, marker, sums in self.pins:
            line = f"{name}=={version}" + (f" ; {marker}" if marker else "")
            if hashes and sums:
                line += "".join(f" --hash={h}" for h in sums.split())
            out.append(line)
        return "\n".join(out) + "\n"

    def as_dict(self) -> dict:
        return {"file": self.file, "format": self.format, "sha256": self.sha256, "pins": self.pins}

    @classmethod
    def of(cls, d: dict) -> Lock:
        return cls(d["file"], d["format"], [list(p) for p in d["pins"]], d["sha256"])


def read_lock(path: str) -> Lock:
    """A lock file read and checked: every package pinned to one version; EnvError in one line."""
    real = os.path.realpath(os.path.expanduser(path))
    if not os.path.isfile(real):
        raise EnvError(f"--packages {path}: no such file on the controller")
    name = os.path.basename(real)
    try:
        text = Path(real).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise EnvError(f"--packages {path}: cannot read it: {exc}") from None
    if name == "uv.lock":
        pins, fmt = _requirements(_uv_export(real, path), path), "uv.lock"
    elif name.endswith(".toml") and (name == "pylock.toml" or name.startswith("pylock.")):
        pins, fmt = _pylock(text, path), "pylock"
    else:
        pins, fmt = _requirements(text, path), "requirements"
    if not pins:
        raise EnvError(f"--packages {path}: names no package")
    seen = set()
    for p in pins:
        if norm(p[0]) in seen and not p[2]:
            raise EnvError(f"--packages {path}: {p[0]} is named twice")
        seen.add(norm(p[0]))
    return Lock(path, fmt, pins)


def _requirements(text: str, path: str) -> list[list[str]]:
    pins = []
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        sums = " ".join(re.findall(r"--hash[=\s]+(sha256:[0-9a-fA-F]{64})", line))
        line = re.sub(r"\s*--hash[=\s]+\S+", "", line).strip()
        if not line:
            continue
        if line.startswith("-"):
            raise EnvError(f"--packages {path}: {line.split()[0]} is not taken: a lock names pinned packages only "
                           "(the index is the controller's pip configuration)")  # fmt: skip
        m = _PIN.match(line)
        if not m or "*" in m.group(3):
            raise EnvError(f"--packages {path}: {line[:80]!r} is not pinned (a lock names each package as "
                           "NAME==VERSION)")  # fmt: skip
        pins.append([m.group(1), m.group(3), (m.group(4) or "").lstrip(";").strip(), sums])
    return pins


def _pylock(text: str, path: str) -> list[list[str]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise EnvError(f"--packages {path}: not TOML: {exc}") from None
    pins = []
    for pkg in data.get("packages") or []:
        name, version = pkg.get("name"), pkg.get("version")
        if not name or not version:
            raise EnvError(f"--packages {path}: package {name or '?'} has no version (a lock pins each package)")
        sums = " ".join(f"sha256:{w['hashes']['sha256']}" for w in pkg.get("wheels") or []
                        if (w.get("hashes") or {}).get("sha256"))  # fmt: skip
        pins.append([str(name), str(version), str(pkg.get("marker") or ""), sums])
    return pins


def _uv_export(real: str, path: str) -> str:
    project = os.path.dirname(real)
    if not os.path.isfile(os.path.join(project, "pyproject.toml")):
        raise EnvError(f"--packages {path}: a uv.lock needs its pyproject.toml beside it")
    try:
        out = subprocess.run([uv_binary(), "export", "--frozen", "--no-hashes", "--no-emit-project",
                              "--no-header", "--format", "requirements-txt", "--directory", project],
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, UV_OFFLINE="1", NO_COLOR="1"))  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EnvError(f"--packages {path}: uv export failed: {exc}") from None
    if out.returncode != 0:
        last = ([ln for ln in out.stderr.splitlines() if ln.strip()] or [f"exit {out.returncode}"])[-1]
        raise EnvError(f"--packages {path}: uv export failed: {last.strip()[:300]}")
    return out.stdout


def check(value: str, cs: ClusterSettings) -> Lock | None:
    """The job's lock (its --packages, else the cluster's training.packages), read now: the job runs the lock as
    it was at launch. 'none': no environment. EnvError in one line."""
    value = (value or str((cs.training or {}).get("packages") or "")).strip()
    if not value or value == "none":
        return None
    real = os.path.realpath(os.path.expanduser(value))
    try:
        check_source(os.path.dirname(real), cs)
    except ValueError as exc:
        raise EnvError(str(exc).replace("--sync", "--packages")) from None
    return read_lock(value)


def check_cluster_value(value) -> None:
    """cluster.yaml's training.packages, read at import: a path (the file is read at each launch)."""
    if not isinstance(value, str) or not value.strip() or "\n" in value:
        raise ValueError("must be the path of a lock file on the controller, e.g. ~/project/requirements.txt")


def uv_binary() -> str:
    try:
        import uv

        return uv.find_uv_bin()
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not os.path.isfile(found):
        raise EnvError("uv is not installed on the controller (pip install uv; bin/setup installs it)")
    return found


def uv_version() -> str:
    out = subprocess.run([uv_binary(), "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.split()[1] if out.returncode == 0 and len(out.stdout.split()) > 1 else ""


# -- the controller's cache ----------------------------------------------------------------------------------


def cache_dir() -> Path:
    return Path(settings.DATA_DIR) / "envs" / "wheels"


@dataclass
class Wheel:
    file: str  # its path in the controller's cache
    name: str
    version: str
    sha256: str
    size: int
    chunks: list[str] = field(default_factory=list)
    mtime_ns: int | None = None

    def obj(self) -> transfer.Obj:
        return transfer.Obj(self.sha256, self.size, self.chunks, self.file, self.mtime_ns)

    def spec(self) -> dict:
        return {"file": os.path.basename(self.file), "name": norm(self.name), "version": self.version,
                "sha256": self.sha256}  # fmt: skip


def wheel_pin(filename: str) -> tuple[str, str] | None:
    """(normalized name, version) of a wheel's file name, or None for a name that is not a wheel's."""
    m = _WHEEL.match(filename)
    return (norm(m.group(1)), m.group(2)) if m else None


def _wheel(path: str) -> Wheel:
    m = _WHEEL.match(os.path.basename(path))
    if not m:
        raise EnvError(f"{os.path.basename(path)} is not a wheel's name")
    h = hash_file(path)
    return Wheel(path, m.group(1), m.group(2), h["sha256"], h["size"], h["chunks"], h["mtime_ns"])


def download(text: str, version: str, platforms: list[str], what: str) -> list[Wheel]:
    """The wheels of a requirements text for Python `version` on `platforms`, fetched once into the cache (pip
    download with pip's own configuration; the cache is also one of its find-links). EnvError naming the
    package that has none."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    tag = version.replace(".", "")
    with tempfile.TemporaryDirectory(dir=cache.parent, prefix=".dl-") as tmp:
        reqs = os.path.join(tmp, "requirements.txt")
        Path(reqs).write_text(text)
        out_dir = os.path.join(tmp, "wheels")
        argv = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps", "--quiet",
                "--progress-bar", "off", "--disable-pip-version-check", "--python-version", version,
                "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3", "--abi", "none",
                *[a for p in platforms for a in ("--platform", p)], "--find-links", str(cache), "-d", out_dir,
                "-r", reqs]  # fmt: skip
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise EnvError(f"{what}: fetching the wheels took over {DOWNLOAD_TIMEOUT_S:.0f} s") from None
        if proc.returncode != 0:
            lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            missing = next((re.search(r"requirement (\S+)", ln) for ln in lines
                            if "Could not find a version" in ln or "No matching distribution" in ln), None)  # fmt: skip
            if missing:
                raise EnvError(f"{what}: no wheel of {missing.group(1)} for Python {version} on {platforms[0]}")
            raise EnvError(
                f"{what}: fetching the wheels failed: {(lines or [f'pip exit {proc.returncode}'])[-1][:300]}"
            )
        wheels = []
        for name in sorted(os.listdir(out_dir)):
            kept = cache / name
            if not kept.exists():
                os.replace(os.path.join(out_dir, name), kept)
            else:
                os.utime(kept)  # its last use: the controller's trim takes the least recently used first
            wheels.append(_wheel(str(kept)))
    return wheels


def _uv_obj(platform: str) -> tuple[dict, list[transfer.Obj]]:
    """uv for a node: the controller's own binary, gzipped once (38 MB -> 17 MB: uv is the one file a node's first
    environment needs beside its wheels), when the node's platform is the controller's; else uv's wheel for that
    platform (the same version), fetched once into the cache."""
    here = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    if platform == here:
        packed = _uv_gzipped()
        h = hash_file(packed)
        return ({"sha256": h["sha256"], "wheel": False, "gzip": True},
                [transfer.Obj(h["sha256"], h["size"], h["chunks"], packed, h["mtime_ns"])])  # fmt: skip
    (w,) = download(f"uv=={uv_version()}\n", "3.12", [platform], f"uv for {platform}")
    return {"sha256": w.sha256, "wheel": True, "name": os.path.basename(w.file)}, [w.obj()]


def _uv_gzipped() -> str:
    """The controller's uv binary gzipped, kept by the binary's sha256 (<DATA_DIR>/envs/uv/<sha256>.gz)."""
    binary = uv_binary()
    packed = cache_dir().parent / "uv" / f"{hash_file(binary)['sha256']}.gz"
    if not packed.exists():
        packed.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=packed.parent, prefix=".part-", delete=False) as tmp:
            with open(binary, "rb") as src, gzip.GzipFile(fileobj=tmp, mode="wb", compresslevel=6, mtime=0) as out:
                shutil.copyfileobj(src, out, 1 << 20)
        os.replace(tmp.name, packed)
    return str(packed)


# -- the launch ---------------------------------------------------------------------------------------------


def env_key(lock_sha: str, version: str, platform: str) -> str:
    return hashlib.sha256(f"{lock_sha}\0{version}\0{platform}".encode()).hexdigest()


def env_dir(node: Node, key: str) -> str:
    return f"{node.workdir.rstrip('/')}/.ugro/envs/{key}"


def prepare(job: Job, nodes: list[Node]) -> dict[int, str] | None:
    """Every node's environment for the job, built where it is not there yet: {node pk: its directory}; None when
    the job names no lock. The packages each node holds are recorded on the job's code record; EnvError in one
    line (a node with no wheel for a package, a failed build, nodes that differ): nothing has started then."""
    code = JobCode.objects.filter(job=job).first()
    if code is None or not (code.envs or {}).get("lock"):
        return None
    t0 = time.monotonic()
    lock = Lock.of(code.envs["lock"])
    infos = _info(nodes, lock)
    keys = {n.pk: env_key(lock.sha256, infos[n.pk]["version"], infos[n.pk]["platforms"][0]) for n in nodes}
    builders, sharers = one_per_workdir(nodes, {n.pk: infos[n.pk].get("workdir_id") for n in nodes})
    needy = [n for n in builders if keys[n.pk] not in infos[n.pk]["envs"]]
    groups: dict[tuple[str, tuple[str, ...]], list[Node]] = {}
    for n in needy:
        groups.setdefault((infos[n.pk]["version"], tuple(infos[n.pk]["platforms"])), []).append(n)
    sent = transfer.Delivered()
    built: dict[str, dict] = {}
    for (version, platforms), group in groups.items():
        what = ", ".join(n.name for n in group)
        wheels = download(lock.requirements(), version, list(platforms), what)
        _check_wheels(lock, wheels, what, version, platforms[0])
        uv, uv_objs = _uv_obj(platforms[-1])
        got = transfer.deliver([*uv_objs, *(w.obj() for w in wheels)], group, what="environment")
        sent.controller_bytes += got.controller_bytes
        sent.peer_bytes += got.peer_bytes
        built.update(_build(group, keys, infos, lock, wheels, uv))
    states = {}
    for n in builders:
        states[n.name] = built.get(n.name) or dict(infos[n.pk]["envs"][keys[n.pk]], kept=True)
    if sharers:  # they see the builder's directory: asked again, so that what is recorded is what they see
        again = _info(sharers, lock)
        for n in sharers:
            if keys[n.pk] not in again[n.pk]["envs"]:
                raise EnvError(f"{n.name}: its environment {keys[n.pk][:12]} is not in its working directory")
            states[n.name] = dict(again[n.pk]["envs"][keys[n.pk]], kept=True)
    nodes_rec = {n.name: {"key": keys[n.pk], "path": env_dir(n, keys[n.pk]), "python": infos[n.pk]["version"],
                          "platform": infos[n.pk]["platforms"][0], "kept": bool(states[n.name].get("kept")),
                          "seconds": states[n.name].get("seconds"), "packages": states[n.name]["packages"]}
                 for n in nodes}  # fmt: skip
    record = dict(code.envs, nodes=nodes_rec, seconds=round(time.monotonic() - t0, 3),
                  controller_bytes=sent.controller_bytes, peer_bytes=sent.peer_bytes)  # fmt: skip
    JobCode.objects.filter(pk=code.pk).update(envs=record)
    differ = differences(nodes_rec)
    if differ:
        raise EnvError(f"the nodes' environments differ: {differ}")
    return {n.pk: env_dir(n, keys[n.pk]) for n in nodes}


def _info(nodes: list[Node], lock: Lock) -> dict[int, dict]:
    """Each node's Python and platform, and its environment of this lock if it has it (keys of every platform
    asked: a node says which is its own)."""
    first = on_each(nodes, lambda n: node_request(n, "env_info", timeout=REQUEST_TIMEOUT_S, workdir=n.workdir))
    failed = [f"{n.name}: {err}" for n, _, err in first if err]
    if failed:
        raise EnvError("environment: " + "; ".join(failed))
    answers = {n.pk: a for n, a, _ in first}
    keyed = on_each(nodes, lambda n: node_request(n, "env_info", timeout=REQUEST_TIMEOUT_S, workdir=n.workdir, keys=[
        env_key(lock.sha256, answers[n.pk]["version"], answers[n.pk]["platforms"][0])]))  # fmt: skip
    failed = [f"{n.name}: {err}" for n, _, err in keyed if err]
    if failed:
        raise EnvError("environment: " + "; ".join(failed))
    return {n.pk: a for n, a, _ in keyed}


def _check_wheels(lock: Lock, wheels: list[Wheel], what: str, version: str, platform: str) -> None:
    have = {(norm(w.name), w.version) for w in wheels}
    for name, pin, marker, _ in lock.pins:
        if not marker and (norm(name), pin) not in have and not any(norm(name) == n for n, _ in have):
            raise EnvError(f"{what}: no wheel of {name}=={pin} for Python {version} on {platform}")


def _build(group: list[Node], keys: dict[int, str], infos: dict[int, dict], lock: Lock, wheels: list[Wheel],
           uv: dict) -> dict[str, dict]:  # fmt: skip
    """Each node of the group builds its environment (on a thread of its agent); EnvError naming the nodes."""
    specs = [w.spec() for w in wheels]
    pins = [[p[0], p[1]] for p in lock.pins]

    def build(n: Node) -> dict:
        task = node_request(
            n,
            "env_build",
            timeout=REQUEST_TIMEOUT_S,
            workdir=n.workdir,
            store=node_store(n),
            key=keys[n.pk],
            python=infos[n.pk]["python"],
            uv=uv,
            wheels=specs,
            pins=pins,
        )["task"]
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        while time.monotonic() < deadline:
            answer = node_request(n, "xfer_task", timeout=REQUEST_TIMEOUT_S, task=task)
            if answer["done"]:
                return answer["result"]
            time.sleep(0.2)
        raise EnvError(f"the build took over {BUILD_TIMEOUT_S:.0f} s")

    done = on_each(group, build)
    failed = [f"{n.name}: {err}" for n, _, err in done if err]
    if failed:
        raise EnvError("building the environment failed on " + "; ".join(failed))
    return {n.name: a for n, a, _ in done}


def differences(nodes: dict[str, dict]) -> str:
    """'' when every node holds the same packages (names and versions; the wheels' sha256 too between nodes of
    one Python and platform), else a line naming the first package that differs and the nodes."""
    names = sorted(nodes)
    if len(names) < 2:
        return ""
    sets = {n: {p[0]: (p[1], p[2]) for p in nodes[n]["packages"]} for n in names}
    ref = names[0]
    for other in names[1:]:
        same_platform = (nodes[ref]["python"], nodes[ref]["platform"]) == (nodes[other]["python"],
                                                                          nodes[other]["platform"])  # fmt: skip
        for pkg in sorted(set(sets[ref]) | set(sets[other])):
            a, b = sets[ref].get(pkg), sets[other].get(pkg)
            if a is None or b is None:
                has, lacks = (ref, other) if b is None else (other, ref)
                return f"{pkg} is in {has}'s ({(a or b)[0]}) and not in {lacks}'s"
            if a[0] != b[0]:
                return f"{pkg} is {a[0]} on {ref} and {b[0]} on {other}"
            if same_platform and a[1] != b[1]:
                return (f"{pkg} {a[0]} comes from another wheel on {other} ({b[1][:12] or 'none'}) than on {ref} "
                        f"({a[1][:12] or 'none'})")  # fmt: skip
    return ""


def summary(code: JobCode) -> list[str]:
    """Lines for status and the job page: the lock, and each node's environment."""
    envs = code.envs or {}
    lock = envs.get("lock")
    if not lock:
        return []
    out = [f"packages: {lock['file']} ({lock['format']}, {len(lock['pins'])} pinned, sha256 {lock['sha256'][:12]})"]
    for name, n in sorted((envs.get("nodes") or {}).items()):
        how = "kept" if n.get("kept") else f"built in {n.get('seconds') or 0:.1f}s"
        out.append(f"  env on {name}: {n['key'][:12]} (Python {n['python']}, {n['platform']}), {len(n['packages'])} "
                   f"packages, {how}")  # fmt: skip
    return out


# -- the nodes' environments --------------------------------------------------------------------------------


def ttl_s(cs: ClusterSettings | None = None) -> float:
    """paths.env_ttl: how long an environment no job used is kept (14d when not set)."""

    cs = cs or ClusterSettings.load()
    value = (cs.paths or {}).get("env_ttl")
    return float(parse_duration(str(value))) if value else DEFAULT_TTL_S


def listing(node: Node) -> list[dict]:
    """A node's environments: key, size, last use, whole, and the jobs that name it."""
    answer = node_request(node, "env_list", timeout=REQUEST_TIMEOUT_S * 2, workdir=node.workdir)
    named = _named_keys(node)
    for e in answer["envs"]:
        e["jobs"] = sorted(named.get(e["key"].split(".part-")[0], []))
    return answer["envs"]


def report(node: Node) -> dict:
    """`ugro node envs NAME`: a node's environments with size, last use and the live jobs that name them, and the
    time after which an unused one is removed; `lines` is what the command prints."""
    items = listing(node)
    ttl = ttl_s()
    lines = [f"{node.name}: {len(items)} environments in {node.workdir.rstrip('/')}/.ugro/envs, "
             f"{_size(sum(e['bytes'] for e in items))}; unused ones removed after {ttl / 86400:g} days"]  # fmt: skip
    for e in sorted(items, key=lambda e: -e["used"]):
        age = max(0.0, time.time() - e["used"])
        used = f"{age / 86400:.1f} days ago" if age >= 86400 else f"{age / 3600:.1f} h ago"
        kind = f"{e.get('packages', 0)} packages" if e["whole"] else "a part (a build running or cut off)"
        jobs = f", named by {', '.join(e['jobs'])}" if e["jobs"] else ""
        lines.append(f"  {e['key'][:12]}  {_size(e['bytes']):>9}  last used {used}  {kind}{jobs}")
    return {"node": node.name, "envs": items, "ttl_s": ttl, "lines": lines}


def _size(n: float) -> str:
    from cluster.cache import human

    return human(int(n))


def _named_keys(node: Node | None = None) -> dict[str, list[str]]:
    """Environment key -> the queued, starting or running jobs that name it (never removed)."""
    live = Job.NEEDING_STATES
    out: dict[str, list[str]] = {}
    for code in JobCode.objects.filter(job__state__in=live).exclude(envs={}).select_related("job"):
        for name, n in ((code.envs or {}).get("nodes") or {}).items():
            if node is None or name == node.name:
                out.setdefault(n["key"], []).append(code.job.name)
    return out


def trim(nodes: list[Node], cs: ClusterSettings | None = None) -> dict[str, list[str]]:
    """Remove the environments no job used for paths.env_ttl, never one a live job names: node -> keys removed."""
    before = time.time() - ttl_s(cs)
    named = _named_keys()
    out = {}
    for node in nodes:
        try:
            envs = node_request(node, "env_list", timeout=REQUEST_TIMEOUT_S * 2, workdir=node.workdir)["envs"]
            old = [e["key"] for e in envs if e["whole"] and e["used"] < before and e["key"] not in named]
            if old:
                out[node.name] = node_request(node, "env_remove", timeout=REQUEST_TIMEOUT_S * 5, workdir=node.workdir,
                                              keys=old, before=before)["removed"]  # fmt: skip
        except Exception as exc:  # a node that does not answer keeps its envs until the next trim
            out[node.name] = [f"error: {exc}"]
    return out


def trim_uv_caches(nodes: list[Node], cs: ClusterSettings | None = None) -> dict[str, dict]:
    """Hold each node's uv cache (once per shared working directory) under UV_CACHE_SHARE of the node's cache
    limit (cluster/node/envs.py op_env_cache_trim: `uv cache prune`, then the whole cache, only while no build
    runs there): node -> its answer, or {"error": why} (a node that does not answer keeps its cache until the
    next trim)."""
    from cluster import cache as limits

    cs = cs or ClusterSettings.load()
    out: dict[str, dict] = {}
    for group in limits.stores(nodes):
        node = group[0]
        try:
            limit = int(min(limits.node_limit(n, cs) for n in group) * UV_CACHE_SHARE)
            out[node.name] = node_request(node, "env_cache_trim", timeout=REQUEST_TIMEOUT_S * 10,
                                          workdir=node.workdir, limit=limit)  # fmt: skip
        except Exception as exc:
            out[node.name] = {"error": str(exc)}
    return out
