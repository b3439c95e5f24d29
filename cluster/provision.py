"""Adding a node by probing it (`ugro node add [USER@]HOST[:PORT]`) and refreshing what was found (`ugro node probe`).

`add_node` reads the host key the machine offers (shown and pinned: the agent's connection is then held to it),
starts UGRO's agent there with the first Python >= 3.8 it finds, and surveys the machine through requests the agent
already serves: its `probe` (GPUs through NVML else nvidia-smi, RAM, the working directory's free disk) and one `exec`
of SURVEY_CODE below (CPUs, the node's addresses, and the Python interpreters on PATH and in the usual environment
folders, each running the pre-flight's VERSION_CODE side by side: torch, CUDA and NCCL read without importing
torch). The controller's own route to the node comes from `ip route get` here. Only then is the node recorded
(cluster.models.Node, what was found in Node.probed); any refusal is one line and records nothing.

Nothing typed reaches a shell: the target is parsed and checked here, the agent's bootstrap quotes its Python path,
and every command is an argv list.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import socket
import subprocess
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from . import links
from .gpus import gpu_text, record_readings
from .links import AgentRequestError, Endpoint, LinkError, NodeLink, fetch_host_key, fingerprint
from .models import ClusterSettings, Node
from .names import check_name
from .versions import VERSION_CODE

DEFAULT_WORKDIR = "~/ugro"  # a node's working directory when neither --workdir nor paths.project_base says one
# The Pythons tried for UGRO's agent, in order: the node's python3 on its login PATH, then the usual places
AGENT_PYTHONS = ("python3", "/usr/bin/python3", "/usr/local/bin/python3")
MIN_PYTHON = (3, 8)
MAX_PYTHONS = 16  # interpreters read for versions (one short process each)
SURVEY_TIMEOUT_S = 35.0  # the link's wait for the survey; the agent bounds its command by 30 s
HOST_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})$")  # a DNS name or an IPv4 address
TARGET_HELP = "[USER@]HOST[:PORT], e.g. alice@10.0.0.5 or gpu-box:2222"

# Run on the node by the agent's Python (>= 3.8), with the working directory as its argument: creates that directory
# (the ranks start there), then prints one JSON object. Fixed code: nothing typed is part of it.
SURVEY_CODE = r"""
import glob, json, os, platform, re, subprocess, sys
workdir = os.path.abspath(os.path.expanduser(sys.argv[1]))
created = not os.path.isdir(workdir)
error = None
try:
    os.makedirs(workdir, exist_ok=True)
except OSError as exc:
    created, error = False, "%s: %s" % (workdir, exc.strerror or exc)
model = ""
try:
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Hardware", "Model", "cpu model") and value.strip():
                model = value.strip()
                break
except OSError:
    pass
home = os.path.expanduser("~")
found, seen = [], set()
def add(path, kind):
    if len(found) >= %(max)d or not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return
    root = os.path.dirname(os.path.dirname(path))  # a venv is its folder; any other python its real file
    key = os.path.realpath(root) if os.path.exists(os.path.join(root, "pyvenv.cfg")) else os.path.realpath(path)
    if key in seen:
        return
    seen.add(key)
    torchrun = os.path.join(os.path.dirname(path), "torchrun")
    found.append({"path": path, "kind": kind,
                  "torchrun": torchrun if os.access(torchrun, os.X_OK) else ""})
add(sys.executable, "agent")
for pattern in (os.path.join(workdir, ".venv*"), os.path.join(home, ".venv*"), os.path.join(home, "venv*")):
    for env in sorted(glob.glob(pattern)):
        add(os.path.join(env, "bin", "python"), "venv")
conda = []
for base in ("miniconda3", "anaconda3", "miniforge3", "mambaforge", ".conda"):
    root = os.path.join(home, base)
    if os.path.isdir(os.path.join(root, "envs")):
        conda += sorted(glob.glob(os.path.join(root, "envs", "*")))
try:
    with open(os.path.join(home, ".conda", "environments.txt")) as fh:
        conda += [line.strip() for line in fh if line.strip()]
except OSError:
    pass
for env in conda:
    add(os.path.join(env, "bin", "python"), "conda")
name_re = re.compile(r"^python3(\.[0-9]+)?$")
for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
    try:
        names = sorted(os.listdir(folder or "."))
    except OSError:
        continue
    for name in names:
        if name_re.match(name):
            add(os.path.join(folder, name), "path")
def versions(item):  # the pre-flight's VERSION_CODE (argv[2]) run by each python, side by side
    try:
        proc = subprocess.run([item["path"], "-c", sys.argv[2]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=25, cwd=home)
        got = json.loads(proc.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        item["broken"] = True  # it does not run (a pyenv shim with no version behind it)
        return
    item.update((k, got.get(k)) for k in ("python", "torch", "cuda", "nccl"))
    item["packages"] = len(got.get("packages") or [])
    if got.get("error") and "No module named torch" not in got["error"]:
        item["error"] = str(got["error"])[:300]
from concurrent.futures import ThreadPoolExecutor
with ThreadPoolExecutor(8) as pool:
    list(pool.map(versions, found))
addrs = []
try:
    out = subprocess.run(["ip", "-o", "addr"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         timeout=5).stdout.decode("utf-8", "replace")
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("inet", "inet6"):
            addrs.append([parts[1], parts[3]])
except (OSError, subprocess.SubprocessError):
    addrs = None
print(json.dumps({"workdir": workdir, "created": created, "error": error, "cpus": os.cpu_count(),
                  "cpu_model": model, "arch": platform.machine(), "pythons": found, "addrs": addrs}))
""".replace("%(max)d", str(MAX_PYTHONS))


class ProvisionError(ValueError):
    """Adding or probing a node was refused; str() is the one line that says why (nothing was recorded)."""


@dataclass
class Target:
    user: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user + '@' if self.user else ''}{host}:{self.port}"


@dataclass
class Result:
    node: str
    lines: list[str]
    probed: dict[str, Any]
    changed: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"node": self.node, "lines": self.lines, "changed": self.changed, "probed": self.probed}


def parse_target(text: str) -> Target:
    """[USER@]HOST[:PORT] (an IPv6 address in brackets when a port follows); ProvisionError when any part is unsafe."""
    text = (text or "").strip()
    user, at, rest = text.rpartition("@")
    if not at:
        user, rest = "", text
    port = 22
    if rest.startswith("["):
        host, close, tail = rest[1:].partition("]")
        if not close or (tail and not tail.startswith(":")):
            raise ProvisionError(f"target {text!r} is not {TARGET_HELP}")
        port_text = tail[1:] if tail else ""
    elif rest.count(":") == 1:
        host, _, port_text = rest.partition(":")
    else:
        host, port_text = rest, ""
    if port_text:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ProvisionError(f"port {port_text!r} of {text!r} is not a number from 1 to 65535")
        port = int(port_text)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not HOST_RE.match(host) or ".." in host:
            raise ProvisionError(
                f"host {host!r} of {text!r} is not a DNS name or an IP address ({TARGET_HELP})"
            ) from None
    if user:
        try:
            check_name(user, "user")
        except ValueError as exc:
            raise ProvisionError(str(exc)) from None
    return Target(user, host, port)


def default_workdir() -> str:
    return str((ClusterSettings.load().paths or {}).get("project_base") or DEFAULT_WORKDIR)


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text or "")[:2])


def _open_agent(ep: Endpoint, pythons: tuple[str, ...] | list[str]) -> tuple[NodeLink, dict[str, Any]]:
    """A private link (not the pool's: the node is not recorded yet) to an agent started with the first of `pythons`
    that runs it, and its hello. Refused in one line when the node cannot be reached or has no Python >= 3.8."""
    missing = []
    for python in pythons:
        link = NodeLink(dataclasses.replace(ep, python=python), links.CONNECT_TIMEOUT_S)
        try:
            hello = link.request("hello", timeout=links.CONNECT_TIMEOUT_S)
        except LinkError as exc:
            link.close()
            if str(exc).startswith("agent failed to start") or str(exc).startswith("cannot start the agent"):
                missing.append(f"{python}: {str(exc).rpartition(': ')[2]}")
                continue
            raise ProvisionError(str(exc)) from None
        if _version_tuple(hello.get("python", "")) < MIN_PYTHON:
            link.close()
            missing.append(f"{python} is {hello.get('python')}")
            continue
        return link, hello
    raise ProvisionError(f"{ep.describe()} has no Python >= 3.8 to run UGRO's agent ({'; '.join(missing)}); "
                         "install python3 there")  # fmt: skip


def _route(address: str) -> dict[str, Any]:
    """How the controller reaches `address`: `ip route get` here (an argv, never a shell)."""
    try:
        ip = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as exc:
        return {"address": address, "error": f"cannot resolve {address}: {exc.strerror or exc}"}
    out: dict[str, Any] = {"address": ip}
    try:
        proc = subprocess.run(["ip", "route", "get", ip], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError) as exc:
        return dict(out, error=f"ip route get: {exc}")
    words = proc.stdout.split()
    for key, name in (("dev", "controller_dev"), ("src", "controller_src"), ("via", "via")):
        if key in words[:-1]:
            out[name] = words[words.index(key) + 1]
    if proc.returncode:
        out["error"] = (proc.stderr.strip().splitlines() or [f"ip route get exit {proc.returncode}"])[-1]
    return out


def _node_interface(ip: str, addrs: list | None) -> str:
    """The node's interface holding `ip` (or, failing that, whose network contains it: 127.0.0.2 is lo's)."""
    try:
        want = ipaddress.ip_address(ip)
    except ValueError:
        return ""
    holder = ""
    for iface, cidr in addrs or []:
        try:
            net = ipaddress.ip_interface(cidr)
        except ValueError:
            continue
        if net.ip == want:
            return str(iface)
        if not holder and want in net.network:
            holder = str(iface)
    return holder


def survey(link: NodeLink, workdir: str, gpu_reader: str = "auto") -> dict[str, Any]:
    """What the machine behind `link` has (Node.probed's form); ProvisionError in one line when it cannot be read."""
    try:
        hello = link.request("hello", timeout=links.CONNECT_TIMEOUT_S)
        sample = link.request("probe", timeout=30, gpu_reader=gpu_reader or "auto", workdir=workdir)
        python = hello["executable"]
        # the agent bounds the command by its own 30 s; the link waits a little longer
        out = link.request("exec", timeout=SURVEY_TIMEOUT_S, argv=[python, "-c", SURVEY_CODE, workdir, VERSION_CODE])
        try:
            found = json.loads(out["stdout"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            detail = (out["stderr"].strip().splitlines() or [f"exit {out['rc']}"])[-1]
            raise ProvisionError(f"{link.ep.describe()}: cannot survey the machine with {python}: {detail}") from None
        if found.get("error"):
            raise ProvisionError(f"{link.ep.describe()}: cannot create its working directory {found['error']}")
        listed = found.get("pythons") or []
        pythons = [{k: v for k, v in p.items() if k != "broken"} for p in listed if not p.get("broken")]
        broken = [p["path"] for p in listed if p.get("broken")]
    except (LinkError, AgentRequestError) as exc:
        said = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ProvisionError(said if link.ep.name in said else f"{link.ep.describe()}: {said}") from None
    gpus = [{k: g.get(k) for k in ("index", "name", "mem_total_mb", "uuid", "driver")}
            for g in sample.get("gpus") or [] if isinstance(g, dict)]  # fmt: skip
    route = _route(link.ep.address) if link.ep.transport == "ssh" else {"address": link.ep.address, "local": True}
    if route.get("address"):
        route["node_interface"] = _node_interface(route["address"], found.get("addrs"))
    # the environment ranks start in: a venv (the working directory's first), then a conda env, then one on PATH
    rank = {"venv": 0, "conda": 1}
    usable = sorted((p for p in pythons if p.get("torch") and p.get("torchrun") and not p.get("error")),
                    key=lambda p: rank.get(p["kind"], 2))  # fmt: skip
    return {
        "at": timezone.now().isoformat(timespec="seconds"),
        "hostname": hello.get("hostname", ""),
        "agent_python": python,
        "gpus": gpus,
        "gpu_source": sample.get("gpu_source"),
        "gpu_error": sample.get("gpu_error"),
        "cpus": found.get("cpus"),
        "cpu_model": found.get("cpu_model") or "",
        "arch": found.get("arch") or "",
        "ram_gb": round(sample["ram_total_mb"] / 1024, 1) if sample.get("ram_total_mb") else None,
        "disk_free_gb": sample.get("disk_free_gb"),
        "workdir": found.get("workdir"),
        "workdir_created": bool(found.get("created")),
        "workdir_id": sample.get("workdir_id") or "",
        "pythons": pythons,
        "pythons_broken": broken,
        "torchrun": usable[0]["torchrun"] if usable else "",
        "route": route,
    }


def _env_text(p: dict[str, Any]) -> str:
    parts = [str(p.get("python") or "?")]
    if p.get("torch"):
        parts.append(f"torch {p['torch']}")
        parts.append(f"CUDA {p['cuda']}" if p.get("cuda") else "CPU only")
        if p.get("nccl"):
            parts.append(f"NCCL {p['nccl']}")
    elif p.get("error"):
        parts.append(f"torch does not read: {p['error']}")
    if _version_tuple(str(p.get("python") or "")) and _version_tuple(str(p["python"])) < MIN_PYTHON:
        parts.append("too old for UGRO's agent")
    return ", ".join(parts)


def facts(probed: dict[str, Any]) -> dict[str, str]:
    """What was found, label -> text: what `node probe` compares (the disk's free space, which always moves, is left
    out) and what the lines show."""
    gpus = probed.get("gpus") or []
    if gpus:
        counts: dict[str, int] = {}
        for g in gpus:
            mb = g.get("mem_total_mb") or 0
            label = f"{g.get('name') or 'GPU'}{f' {mb / 1024:.0f} GB' if mb else ''}"
            counts[label] = counts.get(label, 0) + 1
        gpu = ", ".join(f"{n}× {label}" for label, n in counts.items()) + f" ({probed.get('gpu_source')})"
    else:
        gpu = "none found" + (f" ({probed['gpu_error']})" if probed.get("gpu_error") else "")
    out = {"GPUs": gpu}
    cpu = f"{probed.get('cpus') or '?'}× {probed.get('cpu_model') or 'CPU'}"
    out["CPUs"] = f"{cpu} ({probed['arch']})" if probed.get("arch") else cpu
    if probed.get("ram_gb"):
        out["RAM"] = f"{probed['ram_gb']:g} GB"
    for p in probed.get("pythons") or []:
        out[f"python {p['path']}"] = _env_text(p) + ("; runs UGRO's agent" if p.get("kind") == "agent" else "")
    out["torchrun"] = probed.get("torchrun") or "none found (no environment with torch and torchrun)"
    route = probed.get("route") or {}
    if route.get("local"):
        out["route"] = "this machine (local transport)"
    elif route.get("error") and not route.get("controller_dev"):
        out["route"] = f"{route.get('address')}: {route['error']}"
    else:
        via = f" via {route['via']}" if route.get("via") else ""
        src = f", source {route['controller_src']}" if route.get("controller_src") else ""
        there = route.get("node_interface") or "not found"
        out["route"] = (f"{route.get('address')} from the controller's {route.get('controller_dev') or '?'}{via}{src}; "
                        f"the node's interface: {there}")  # fmt: skip
    return out


def _lines(name: str, probed: dict[str, Any]) -> list[str]:
    lines = [f"{name}: {label}: {text}" for label, text in facts(probed).items()]
    if probed.get("disk_free_gb") is not None:
        made = " (created)" if probed.get("workdir_created") else ""
        lines.insert(3, f"{name}: disk: {probed['disk_free_gb']:g} GB free under {probed.get('workdir')}{made}")
    return lines


def _gpu_fields(probed: dict[str, Any]) -> dict[str, Any]:
    gpus = probed.get("gpus") or []
    first = next((g for g in gpus if g.get("name")), {})
    mb = first.get("mem_total_mb") or 0
    return {"gpu_count": len(gpus), "gpu_model": str(first.get("name") or "")[:100],
            "gpu_vram_gb": round(float(mb) / 1024, 1) if mb else 0.0}  # fmt: skip


def add_node(
    target: str, name: str = "", key_path: str = "", workdir: str = "", expect_fingerprint: str = ""
) -> Result:
    """Connect to `target`, pin its host key, survey it and record it as node `name` (default: the host as typed).
    ProvisionError in one line, with nothing recorded, when anything is refused."""
    where = parse_target(target)
    name = name or where.host
    try:
        check_name(name, "node name")
    except ValueError as exc:
        raise ProvisionError(f"{exc} (choose one with --name)") from None
    taken = Node.objects.filter(name=name).first()
    if taken is not None:
        raise ProvisionError(f"node name {name!r} is taken (by {taken.address}:{taken.ssh_port}); choose another "
                             "with --name")  # fmt: skip
    same = Node.objects.filter(address=where.host, ssh_port=where.port, transport=Node.Transport.SSH).first()
    if same is not None:
        raise ProvisionError(f"{where.host}:{where.port} is already node {same.name} (`ugro node probe {same.name}` "
                             "reads it again)")  # fmt: skip
    if key_path and not os.path.isfile(os.path.expanduser(key_path)):
        raise ProvisionError(f"key {key_path} is not a file on the controller")
    workdir = workdir or default_workdir()
    if "\n" in workdir or "\0" in workdir or len(workdir) > 500:
        raise ProvisionError("the working directory must be one line of at most 500 characters")
    ep = Endpoint(name=name, address=where.host, port=where.port, user=where.user, key_path=key_path,
                  known_hosts=settings.UGRO["KNOWN_HOSTS"])  # fmt: skip
    try:
        key = fetch_host_key(ep, links.CONNECT_TIMEOUT_S)
    except LinkError as exc:
        raise ProvisionError(str(exc)) from None
    offered = fingerprint(key)
    if expect_fingerprint and expect_fingerprint.strip() != offered:
        raise ProvisionError(f"{ep.describe()} offers host key {offered}, not {expect_fingerprint.strip()}; "
                             "nothing was recorded")  # fmt: skip
    try:
        expected, source = links._expected_keys(ep, "")  # a known_hosts entry for it must match
    except LinkError as exc:
        raise ProvisionError(str(exc)) from None
    if expected and key not in [links.key_line(k) for k in expected]:
        raise ProvisionError(links._changed_key_message(ep, key, [links.key_line(k) for k in expected], source))
    link, hello = _open_agent(dataclasses.replace(ep, host_key=key), AGENT_PYTHONS)
    try:
        probed = survey(link, workdir)
    finally:
        link.close()
    node = Node(
        name=name, hostname=str(hello.get("hostname") or "")[:255], address=where.host, ssh_port=where.port,
        user=where.user, key_path=key_path, transport=Node.Transport.SSH, agent_python=probed["agent_python"][:255],
        workdir=workdir, workdir_id=probed.get("workdir_id") or "", torchrun_command=probed["torchrun"] or "torchrun",
        host_key=key, host_key_source="node add" if source == "first use" else source,
        host_key_pinned_at=timezone.now(), probed=probed, order=_next_order(), **_gpu_fields(probed),
    )  # fmt: skip
    try:
        node.full_clean()
        with transaction.atomic():
            node.save()
    except ValidationError as exc:
        raise ProvisionError(f"node {name}: {'; '.join(exc.messages)}") from None
    except IntegrityError:
        raise ProvisionError(f"node name {name!r} was taken meanwhile; choose another with --name") from None
    record_readings({name: probed["gpus"]}, [node])
    lines = [f"{name}: host key {offered} ({key.split()[0]}) pinned"] + _lines(name, probed)
    if not probed["torchrun"]:
        lines.append(f"{name}: set its torchrun (cluster.yaml torchrun:, or admin) before it trains: docs/nodes.md")
    lines.append(f"node {name} added ({where}, {gpu_text(node, node.gpus.all())}, working directory {workdir})")
    return Result(name, lines, probed)


def _next_order() -> int:
    last = Node.objects.order_by("-order").values_list("order", flat=True).first()
    return 0 if last is None else min(last + 1, 1_000_000)


def probe_node(node: Node) -> Result:
    """Survey a recorded node again and update what was found (GPUs, its environments' versions, the torchrun UGRO
    chose); `changed` says what differs from the last survey. ProvisionError in one line, nothing changed."""
    old = dict(node.probed or {})
    try:
        probed = survey(node.link(), node.workdir, node.gpu_reader)
    except ProvisionError as exc:
        raise ProvisionError(f"{node.name} was not probed: {exc}") from None
    before, after = facts(old) if old else {}, facts(probed)
    changed = [f"{label}: {before.get(label, '(none)')} -> {after.get(label, '(none)')}"
               for label in list(before) + [k for k in after if k not in before]
               if before.get(label) != after.get(label)]  # fmt: skip
    fields: dict[str, Any] = {"probed": probed}
    if probed["gpus"] or not probed.get("gpu_error") or not node.gpu_count:
        fields.update(_gpu_fields(probed))
    if probed["torchrun"] and node.torchrun_command in ("torchrun", old.get("torchrun") or "torchrun"):
        fields["torchrun_command"] = probed["torchrun"]
    if probed.get("workdir_id"):
        fields["workdir_id"] = probed["workdir_id"]
    for key, value in fields.items():
        setattr(node, key, value)
    node.save(update_fields=list(fields))
    record_readings({node.name: probed["gpus"]}, [node])
    lines = _lines(node.name, probed)
    if fields.get("gpu_count") is None and node.gpu_count:
        lines.append(f"{node.name}: GPUs not read ({probed.get('gpu_error')}): its {node.gpu_count} declared kept")
    if not old:
        lines.append(f"{node.name}: first probe recorded")
    elif changed:
        lines += [f"{node.name}: changed: {c}" for c in changed]
    else:
        lines.append(f"{node.name}: nothing changed since {old.get('at', 'the last probe')}")
    return Result(node.name, lines, probed, changed)
