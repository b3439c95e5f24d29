"""cluster.yaml in the user's own format, imported into (and exported from) the database.

The format (from the user's setup guide): `cluster.{name,master_ip,master_port}`,
`nodes.<name>.{ip,user,hostname,gpu,vram_gb,rank,role}`, `training.*` (`training.sync`: a directory copied to
every node before each job, docs/sync.md), `paths.*` (`paths.sync_roots`: where on the controller it may be).
UGRO also reads optional per-node keys for what the original scripts hard-coded:
`ssh_port`, `key`, `gpus` (count), `torchrun`, `python`, `workdir`, `transport`, `enabled`, `env`,
`gpu_reader`, `cache_limit` (its store's size, docs/data.md; `paths.cache_limit` for every node, `paths.store_limit`
for the controller's), `power` (how it sleeps when idle and wakes for the queue, cluster/power.py);
and under `training:`, `script` and `args` (the script's argument template, with {model} {dataset}
{epochs} {lr} {job}) for scripts that do not take train_production.py's arguments.
A top-level `power:` block prices energy: `price_per_kwh` and a `currency` label (docs/power.md).
"""

from __future__ import annotations

import getpass
import math
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from django.db import transaction

from .cache import format_size, parse_size
from .models import ClusterSettings, Node
from .names import check_name
from .power import PowerError, parse_power, power_block

MAX_BYTES = 1 << 20  # a cluster.yaml for hundreds of nodes is a few dozen KiB
MAX_EXPANDED_NODES = 100_000  # YAML values after every alias is expanded (an alias bomb is billions)
MAX_DEPTH = 50

NODE_KEYS = {"ip", "user", "hostname", "gpu", "vram_gb", "rank", "role", "ssh_port", "key", "gpus",
             "torchrun", "python", "workdir", "transport", "enabled", "env", "gpu_reader", "cache_limit",
             "power"}  # fmt: skip
TOP_KEYS = {"cluster", "nodes", "training", "paths", "power"}
POWER_KEYS = {"price_per_kwh", "currency"}  # the top-level `power:` block: what energy costs (docs/power.md)
MAX_PRICE_PER_KWH = 1000.0
CURRENCY_RE = re.compile(r"[A-Za-z$\u00a3\u00a5\u20a0-\u20cf]{1,8}")


# `training.<key>` values an app above cluster reads, each with its check (ValueError in one line): registered by
# that app at start (jobs: `keep`, the retention default), so that an import refuses what its launches would
TRAINING_CHECKS: dict[str, Callable[[Any], object]] = {}
# `paths.<key>` values likewise (jobs: `env_ttl`, how long a node keeps an environment no job used)
PATHS_CHECKS: dict[str, Callable[[Any], object]] = {}


class ConfigError(ValueError):
    """cluster.yaml cannot be used; the message names the key (and line) at fault."""


@dataclass
class ImportSummary:
    created: list[str]
    updated: list[str]
    disabled: list[str]

    def __str__(self) -> str:
        parts = [f"{len(self.created)} created", f"{len(self.updated)} updated"]
        if self.disabled:
            parts.append(f"{len(self.disabled)} disabled (not in the file: {', '.join(self.disabled)})")
        return ", ".join(parts)


def _expand_user(value: str) -> str:
    # Only these two spellings, never a shell: the file is data, not a script.
    me = getpass.getuser()
    return value.replace("${USER}", me).replace("$USER", me).replace("$(whoami)", me)


def decode(raw: bytes) -> str:
    """The file's text; one line if it is too big or not UTF-8."""
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"cluster.yaml is {len(raw)} bytes; the limit is {MAX_BYTES} bytes")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"cluster.yaml is not UTF-8 text: byte 0x{raw[exc.start]:02x} on line {line} (save it as UTF-8)"
        ) from None


def _key_text(node: yaml.Node) -> str:
    return str(node.value) if isinstance(node, yaml.ScalarNode) else f"<{node.tag}>"


def _check_tree(root: yaml.Node | None) -> None:
    """Refuse duplicate keys (naming both lines) and documents whose aliases expand past the bounds.

    Walks the composed tree as a consumer would see it, every alias expanded, and stops as soon as
    it has seen MAX_EXPANDED_NODES values: a billion-laughs file is refused after that many steps.
    """
    if root is None:
        return
    seen = 0
    stack: list[tuple[yaml.Node, tuple[str, ...]]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        seen += 1
        if seen > MAX_EXPANDED_NODES:
            raise ConfigError(
                f"cluster.yaml expands to more than {MAX_EXPANDED_NODES} values (aliases repeated inside "
                "aliases?); refused"
            )
        if len(path) > MAX_DEPTH:
            raise ConfigError(f"cluster.yaml nests deeper than {MAX_DEPTH} levels ({'.'.join(path[:5])}...)")
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key, value in node.value:
                name = _key_text(key)
                line = key.start_mark.line + 1
                if name != "<<" and name in first:
                    where = ".".join((*path, name))
                    raise ConfigError(f"{where} is given twice (lines {first[name]} and {line}); keep one")
                first.setdefault(name, line)
                stack.append((value, (*path, name)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, (*path, str(i))) for i, item in enumerate(node.value))


class _Doc:
    """The parsed document plus line numbers for each key path, for error messages."""

    def __init__(self, text: str | bytes) -> None:
        if isinstance(text, bytes):
            text = decode(text)
        elif len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
            raise ConfigError(f"cluster.yaml is larger than {MAX_BYTES} bytes")
        try:
            self.node = yaml.compose(text, Loader=yaml.SafeLoader)
            _check_tree(self.node)
            self.data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"cluster.yaml is not valid YAML{where}: {problem}") from None
        except RecursionError:
            raise ConfigError(f"cluster.yaml nests too deeply (more than {MAX_DEPTH} levels)") from None

    def line(self, *path: str) -> int | None:
        node = self.node
        line = None
        for key in path:
            if not isinstance(node, yaml.MappingNode):
                return line
            for k, v in node.value:
                if k.value == key:
                    line, node = k.start_mark.line + 1, v
                    break
            else:
                return line
        return line

    def error(self, message: str, *path: str) -> ConfigError:
        line = self.line(*path)
        where = ".".join(path)
        return ConfigError(f"{where}: {message}" + (f" (line {line})" if line else ""))


def _get(
    doc: _Doc, mapping: dict, key: str, kind: type | tuple, path: tuple, default: Any = None, required: bool = False
) -> Any:
    if key not in mapping or mapping[key] is None:
        if required:
            raise doc.error("is required", *path, key)
        return default
    value = mapping[key]
    if kind in (int, float, (int, float)) and isinstance(value, bool):
        raise doc.error(f"must be a number, not {value!r}", *path, key)
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise doc.error(f"must be {names}, not {value!r}", *path, key)
    return value


def _size(doc: _Doc, mapping: dict, key: str, path: tuple) -> int | None:
    """A size key (cluster/cache.py parse_size: 500MB, 50GB, 1.5TB) in bytes, None when not given."""
    if mapping.get(key) is None:
        return None
    try:
        return parse_size(mapping[key])
    except ValueError as exc:
        raise doc.error(str(exc), *path, key) from None


def _power(doc: _Doc, power: dict) -> tuple[float | None, str]:
    """The top-level `power:` block: (price_per_kwh or None, currency label). One line for anything else."""
    for key in power:
        if key not in POWER_KEYS:
            raise doc.error(f"unknown key (known: {', '.join(sorted(POWER_KEYS))})", "power", str(key))
    price = _get(doc, power, "price_per_kwh", (int, float), ("power",), None)
    if price is not None and not (math.isfinite(price) and 0 <= price <= MAX_PRICE_PER_KWH):
        raise doc.error(f"must be a price per kWh from 0 to {MAX_PRICE_PER_KWH:g}, e.g. 0.30", "power", "price_per_kwh")
    currency = _get(doc, power, "currency", str, ("power",), "").strip()
    if currency and not CURRENCY_RE.fullmatch(currency):
        raise doc.error("must be a short label of letters or a currency sign, e.g. EUR or €", "power", "currency")
    return (float(price) if price is not None else None), currency


def parse_cluster_yaml(text: str | bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Validate the file fully; return (cluster settings fields, node fields). Raises ConfigError."""
    doc = _Doc(text)
    data = doc.data
    if not isinstance(data, dict):
        raise ConfigError("cluster.yaml must be a mapping with cluster:, nodes:, training:, paths:")
    for key in data:
        if key not in TOP_KEYS:
            raise doc.error(f"unknown section (expected one of {', '.join(sorted(TOP_KEYS))})", str(key))
    cluster = _get(doc, data, "cluster", dict, (), {})
    nodes = _get(doc, data, "nodes", dict, (), required=True)
    training = _get(doc, data, "training", dict, (), {})
    paths = _get(doc, data, "paths", dict, (), {})
    if not nodes:
        raise doc.error("must list at least one node", "nodes")
    price_per_kwh, currency = _power(doc, _get(doc, data, "power", dict, (), {}))

    port = _get(doc, cluster, "master_port", int, ("cluster",), 29500)
    if not 1 <= port <= 65535:
        raise doc.error("must be a port number 1-65535", "cluster", "master_port")
    master_ip = str(_get(doc, cluster, "master_ip", (str, int), ("cluster",), "")).strip()
    project_base = str(_get(doc, paths, "project_base", str, ("paths",), "~"))
    scripts_dir = _get(doc, paths, "scripts", str, ("paths",), None)
    script = _get(doc, training, "script", str, ("training",), None)
    if script is None and scripts_dir:
        script = f"{scripts_dir.rstrip('/')}/train_production.py"
    roots = _get(doc, paths, "script_roots", list, ("paths",), [])
    if not all(isinstance(r, str) and r.strip() and ".." not in r.split("/") for r in roots):
        raise doc.error("must be a list of directories (no '..'), e.g. ['{workdir}', '/opt/scripts']",
                        "paths", "script_roots")  # fmt: skip
    sync_roots = _get(doc, paths, "sync_roots", list, ("paths",), [])
    if not all(isinstance(r, str) and r.strip() and ".." not in r.split("/") for r in sync_roots):
        raise doc.error("must be a list of directories on the controller (no '..'), e.g. ['~/projects']",
                        "paths", "sync_roots")  # fmt: skip
    for key in ("cache_limit", "store_limit"):
        _size(doc, paths, key, ("paths",))
    for key, check in PATHS_CHECKS.items():
        if paths.get(key) is not None:
            try:
                check(paths[key])
            except ValueError as exc:
                raise doc.error(str(exc), "paths", key) from None
    sync_dir = _get(doc, training, "sync", str, ("training",), "")
    if sync_dir and ("\0" in sync_dir or not sync_dir.strip()):
        raise doc.error("must be a directory on the controller to copy to every node, or none", "training", "sync")
    args = _get(doc, training, "args", list, ("training",), [])
    if not all(isinstance(a, str | int | float) and not isinstance(a, bool) for a in args):
        raise doc.error("must be a list of strings, e.g. ['--model', '{model}']", "training", "args")
    settings_fields = {
        "script_args_template": [str(a) for a in args],
        "name": str(_get(doc, cluster, "name", str, ("cluster",), "UGRO cluster")),
        "master_address": master_ip,
        "rendezvous_port": port,
        "training": training,
        "paths": paths,
        "script_roots": [r.strip() for r in roots],
        "price_per_kwh": price_per_kwh,
        "currency": currency,
    }
    if script:
        settings_fields["default_script"] = script
    for key, check in TRAINING_CHECKS.items():
        if training.get(key) is not None:
            try:
                check(training[key])
            except ValueError as exc:
                raise doc.error(str(exc), "training", key) from None

    out = []
    masters = []
    for name, spec in nodes.items():
        path = ("nodes", str(name))
        try:
            check_name(str(name), "node name")
        except ValueError as exc:
            raise doc.error(str(exc), *path) from None
        if not isinstance(spec, dict):
            raise doc.error("must be a mapping of ip, user, gpu, ...", *path)
        for key in spec:
            if key not in NODE_KEYS:
                raise doc.error(f"unknown key (known: {', '.join(sorted(NODE_KEYS))})", *path, str(key))
        ip = str(_get(doc, spec, "ip", str, path, required=True)).strip()
        if not ip or any(c.isspace() for c in ip):
            raise doc.error("must be an address without spaces", *path, "ip")
        role = _get(doc, spec, "role", str, path, "worker")
        if role not in ("master", "worker"):
            raise doc.error("must be 'master' or 'worker'", *path, "role")
        if role == "master":
            masters.append(str(name))
        vram = _get(doc, spec, "vram_gb", (int, float), path, 0)
        if vram < 0:
            raise doc.error("must not be negative", *path, "vram_gb")
        gpus = _get(doc, spec, "gpus", int, path, 1 if spec.get("gpu") else 0)
        if gpus < 0:
            raise doc.error("must not be negative", *path, "gpus")
        ssh_port = _get(doc, spec, "ssh_port", int, path, 22)
        if not 1 <= ssh_port <= 65535:
            raise doc.error("must be a port number 1-65535", *path, "ssh_port")
        torchrun = _get(doc, spec, "torchrun", str, path, "torchrun")
        try:
            if not shlex.split(torchrun):
                raise ValueError("empty")
        except ValueError as exc:
            raise doc.error(f"cannot be split into a command: {exc}", *path, "torchrun") from None
        transport = _get(doc, spec, "transport", str, path, "ssh")
        if transport not in ("ssh", "local"):
            raise doc.error("must be 'ssh' or 'local'", *path, "transport")
        gpu_reader = _get(doc, spec, "gpu_reader", str, path, "auto")
        if gpu_reader not in ("auto", "nvml", "nvidia-smi") and not gpu_reader.startswith("fixture:"):
            raise doc.error("must be auto, nvml, nvidia-smi or fixture:<path>", *path, "gpu_reader")
        env = _get(doc, spec, "env", dict, path, {})
        try:
            power = parse_power(spec.get("power"), ip, transport)
        except PowerError as exc:
            raise doc.error(str(exc), *path, "power", *([exc.key] if exc.key else [])) from None
        user = _expand_user(str(_get(doc, spec, "user", str, path, "${USER}")))
        try:
            check_name(user, "user")
        except ValueError as exc:
            raise doc.error(str(exc), *path, "user") from None
        out.append({
            "name": str(name),
            "address": ip,
            "user": user,
            "hostname": str(_get(doc, spec, "hostname", str, path, str(name))),
            "gpu_model": str(_get(doc, spec, "gpu", str, path, "")),
            "gpu_vram_gb": float(vram),
            "gpu_count": gpus,
            "order": _get(doc, spec, "rank", int, path, len(out)),
            "role": role,
            "ssh_port": ssh_port,
            "key_path": str(_get(doc, spec, "key", str, path, "")),
            "torchrun_command": torchrun,
            "agent_python": str(_get(doc, spec, "python", str, path, "/usr/bin/python3")),
            "workdir": str(_get(doc, spec, "workdir", str, path, project_base)),
            "transport": transport,
            "enabled": bool(_get(doc, spec, "enabled", bool, path, True)),
            "env": {str(k): str(v) for k, v in env.items()},
            "gpu_reader": gpu_reader,
            "cache_limit": _size(doc, spec, "cache_limit", path),
            "power": power,
        })  # fmt: skip
    if len(masters) > 1:
        raise doc.error(f"more than one node has role master ({', '.join(masters)})", "nodes")
    return settings_fields, out


def import_cluster(text: str | bytes) -> ImportSummary:
    """Apply a cluster.yaml: all of it in one transaction, or nothing."""
    settings_fields, nodes = parse_cluster_yaml(text)
    created, updated = [], []
    with transaction.atomic():
        ClusterSettings.objects.update_or_create(pk=1, defaults=settings_fields)
        for fields in nodes:
            name = fields.pop("name")
            _, was_created = Node.objects.update_or_create(name=name, defaults=fields)
            (created if was_created else updated).append(name)
        listed = set(created) | set(updated)
        stale = Node.objects.filter(enabled=True).exclude(name__in=listed)
        disabled = sorted(stale.values_list("name", flat=True))
        stale.update(enabled=False)
    return ImportSummary(created, updated, disabled)


def export_cluster() -> str:
    """The cluster as cluster.yaml, in the user's format (plus UGRO's optional keys)."""
    cs = ClusterSettings.load()
    nodes: dict[str, Any] = {}
    for n in Node.objects.all():
        nodes[n.name] = {
            "ip": n.address,
            "user": n.user,
            "hostname": n.hostname or n.name,
            "gpu": n.gpu_model,
            "vram_gb": n.gpu_vram_gb if n.gpu_vram_gb % 1 else int(n.gpu_vram_gb),
            "rank": n.order,
            "role": n.role,
            "gpus": n.gpu_count,
            "ssh_port": n.ssh_port,
            "key": n.key_path,
            "torchrun": n.torchrun_command,
            "python": n.agent_python,
            "workdir": n.workdir,
            "transport": n.transport,
            "enabled": n.enabled,
            "env": n.env or {},
            "gpu_reader": n.gpu_reader or "auto",
        }
        if n.cache_limit:
            nodes[n.name]["cache_limit"] = format_size(n.cache_limit)
        if n.power:
            nodes[n.name]["power"] = power_block(n.power)
        if not n.user:  # none set: left out, so an import takes its default (the importing user), not '' (refused)
            del nodes[n.name]["user"]
    training = dict(cs.training or {})
    training.setdefault("script", cs.default_script)
    if cs.script_args_template:
        training["args"] = list(cs.script_args_template)
    doc = {
        "cluster": {"name": cs.name, "master_ip": cs.master_address, "master_port": cs.rendezvous_port},
        "nodes": nodes,
        "training": training,
        "paths": {**(cs.paths or {}), "script_roots": list(cs.script_roots)} if cs.script_roots else
        {k: v for k, v in (cs.paths or {}).items() if k != "script_roots"},
    }  # fmt: skip
    if cs.price_per_kwh is not None or cs.currency:
        doc["power"] = {"price_per_kwh": cs.price_per_kwh, "currency": cs.currency}
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
