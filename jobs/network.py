"""The network between a job's nodes: which interface each node's collective uses, whether the others reach it there,
how fast the collective runs between them, and what that means for a running job (docs/scaling.md).

- The interface: the node's own env wins (NCCL_SOCKET_IFNAME on GPUs, GLOO_SOCKET_IFNAME on CPUs); else the one
  its route to the master's address leaves by (`ip route get`, run through its agent). A multi-node job's ranks get
  both variables set to it unless the node's env sets them (`rank_env`).
- Reached: each node listens on its chosen address and every other node connects there; a node the others cannot
  reach is refused in one line naming its address and theirs.
- Measured (`measure`): cluster/node/netcheck.py, run by each node's own torch, all_reduce with the job's collective
  at gradient sizes for the group and each pair, recorded as a `NetCheck`. A launch's pre-flight reuses a measurement
  of the same nodes and interfaces younger than REUSE_S, and measures nothing between nodes on one machine.
- Advice (`advice`): from a multi-node job's first step lines (compute_s, sync_wait_s) and the measurement, how much
  of a step is communication and whether fewer nodes would be faster.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import combinations
from statistics import median

from django.utils import timezone

from cluster.fanout import node_request, on_each
from cluster.links import AgentRequestError, LinkError, node_file
from cluster.models import Node
from metrics.models import MetricPoint

from .models import Job, NetCheck, Rank
from .preflight import named_nodes

log = logging.getLogger(__name__)

MB = 1024 * 1024
SIZES_MB = (1, 16, 64)  # gradient buckets (DDP's default is 25 MB) up to a small model's whole gradient
PAIR_SIZE_MB = 16  # each pair is measured at the largest of the sizes up to this (and its latency)
MAX_SIZE_MB = 256
MAX_SIZES = 4
MAX_PAIRS = 28  # every pair up to 8 nodes; beyond, each node with rank 0 only
BUDGET_S = 0.25  # each figure is timed over the repeats that fit in this (at least one)
MAX_ITERS, LATENCY_ITERS = 20, 100
# The node's agent runs the measurement under its exec's own 30 s bound; the collective's timeout stays inside it.
COLLECTIVE_TIMEOUT_S = 25
MEASURE_WAIT_S = 40.0
LISTEN_S = 5.0
CONNECT_TIMEOUT_S = 3.0
REUSE_S = 6 * 3600  # a launch reuses a measurement of the same nodes and interfaces this recent
ADVICE_WINDOW_S = 300  # the advice reads the job's first minutes of step lines
CLEARLY_FASTER = 1.05  # fewer nodes are called faster only from this gain on
ADVICE_SKIP_LINES = 1  # the first line of each rank holds the warm-up (compile, first connections)
IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")
VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


class NetcheckError(ValueError):
    """A measurement that cannot be made, in one line."""


@dataclass
class Choice:
    """The interface one node's collective uses, the address it is reached at there, and why that one."""

    node: str
    interface: str
    address: str
    source: str  # "route to 10.0.0.1" or "GLOO_SOCKET_IFNAME in its env"

    def as_dict(self) -> dict:
        return {"interface": self.interface, "address": self.address, "source": self.source}


@dataclass
class Outcome:
    """What `check` found: the choices, the refusals (one line per node), notes, and the measurement (or None)."""

    choices: dict[str, Choice] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    measured: NetCheck | None = None
    reused: bool = False


def backend_for(nodes: list[Node]) -> str:
    """The collective a job on these nodes uses: NCCL when every node has a GPU, else gloo."""
    return "nccl" if nodes and all(n.gpu_count > 0 for n in nodes) else "gloo"


def _ifname_var(backend: str) -> str:
    return "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"


def parse_addresses(text: str) -> dict[str, list[ipaddress.IPv4Interface]]:
    """`ip -o -4 addr show` -> interface -> its IPv4 addresses with their prefixes. An address with a label of its
    own (`ip addr add 10.0.0.5/24 dev eth0 label eth0:1`, an alias) is listed under the label, not the interface:
    that is the name NCCL and gloo find it by (getifaddrs), and gloo binds the first address of the name it is
    given."""
    out: dict[str, list[ipaddress.IPv4Interface]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "inet":
            dev = parts[1].split("@")[0]
            label = next((p[:-1] for p in parts[4:] if p.endswith("\\")), dev)  # `ip -o` ends the label with \
            try:
                out.setdefault(label if label.startswith(dev + ":") else dev, []).append(
                    ipaddress.IPv4Interface(parts[3])
                )
            except ValueError:
                continue
    return out


def parse_route(text: str) -> tuple[str | None, bool]:
    """`ip -o route get ADDR` -> (the interface it leaves by, whether ADDR is this node's own)."""
    parts = text.split()
    dev = parts[parts.index("dev") + 1] if "dev" in parts[:-1] else None
    return dev, bool(parts) and parts[0] == "local"


def route_source(text: str) -> str | None:
    """`ip -o route get ADDR` -> the source address a packet there leaves from (None when it names none)."""
    parts = text.split()
    return parts[parts.index("src") + 1] if "src" in parts[:-1] else None


def _label_holding(dev: str, source: str | None, addresses: dict) -> str:
    """The name the route's source address is listed under when that is a label of `dev` (an alias: eth0:1), so
    that gloo binds the address the route leaves from, not dev's first; else dev."""
    try:
        ip = ipaddress.ip_address(source) if source else None
    except ValueError:
        ip = None
    labels = [n for n, nets in addresses.items() if n.startswith(dev + ":") and any(i.ip == ip for i in nets)]
    return labels[0] if ip is not None and labels else dev


def pick(node: Node, master: str, var: str, addresses: dict, route: tuple[str | None, bool],
         leaves_from: str | None = None) -> Choice | str:  # fmt: skip
    """The interface of `node` for a collective whose rank 0 is at `master` (var: the variable that names it), from
    its addresses and its route to the master (and the source address that route leaves from); a one-line refusal
    when there is none to use."""
    own = (node.env or {}).get(var)
    if own:
        name, source = own.removeprefix("="), f"{var} in its env"
        if not IFNAME.match(name):  # a pattern (^docker,lo) or a list: NCCL and gloo resolve it themselves
            return Choice(node.name, own, node.address, f"{source} (a pattern: not checked)")
        if name not in addresses:
            return f"{node.name}: interface {name} ({source}) has no IPv4 address there"
    else:
        dev, local = route
        try:
            target = ipaddress.ip_address(master)
        except ValueError:
            target = None
        if local and target is not None:  # the master is this node: the interface that holds its address
            exact = [i for i, nets in addresses.items() if any(n.ip == target for n in nets)]
            within = [i for i, nets in addresses.items() if any(target in n.network for n in nets)]
            dev = (exact or within or [dev])[0]
        elif dev:
            dev = _label_holding(dev, leaves_from, addresses)
        if not dev or dev not in addresses:
            return f"{node.name}: no interface with an IPv4 address leads to the master {master} (route: {dev})"
        name, source = dev, f"route to {master}"
    try:
        declared = ipaddress.ip_address(node.address)
    except ValueError:
        declared = None
    nets = addresses[name]
    address = node.address if declared is not None and any(declared in n.network for n in nets) else str(nets[0].ip)
    return Choice(node.name, name, address, source)


def _survey(node: Node, master: str, var: str) -> Choice | str:
    def ip(*argv: str) -> str:
        out = node_request(node, "exec", timeout=15, argv=["ip", "-o", *argv])
        if out["rc"] == 127:  # no iproute2 there: nothing to choose from; its collective picks as it would alone
            raise LookupError
        if out["rc"] != 0:
            raise NetcheckError(f"{node.name}: ip {' '.join(argv)} failed: {(out['stderr'] or '').strip()[:200]}")
        return out["stdout"]

    try:
        addresses = parse_addresses(ip("-4", "addr", "show"))
        routed = ip("route", "get", master) if not (node.env or {}).get(var) else ""
    except NetcheckError as exc:  # one line for this node; the others are still chosen
        return str(exc)
    except LookupError:
        return _survey_without_ip(node, master, var)
    return pick(node, master, var, addresses, parse_route(routed), route_source(routed))


def _survey_without_ip(node: Node, master: str, var: str) -> Choice | str:
    """A node without iproute2 (GPU containers often lack it): its agent reads the interfaces and the route."""
    try:
        out = node_request(node, "interfaces", timeout=15, to=master)
        addresses = {name: [ipaddress.IPv4Interface(a) for a in nets] for name, nets in out["addresses"].items()}
        route = (out.get("dev"), bool(out.get("local")))
    except (LinkError, AgentRequestError, KeyError, TypeError, ValueError) as exc:
        return Choice(node.name, "", node.address, f"not chosen: no `ip` command on the node ({exc})"[:200])
    found = pick(node, master, var, addresses, route)
    if isinstance(found, Choice):
        found.source += " (read by UGRO's agent: no `ip` command there)"
    return found


def _resolved(host: str) -> str | None:
    """host as an IPv4 address (a name resolved by the controller), None when it does not resolve."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        try:
            return socket.gethostbyname(host)
        except OSError:
            return None


def choose(nodes: list[Node], backend: str) -> tuple[dict[str, Choice], list[str]]:
    """Each node's interface (rank 0 first: its address is the master's), and the refusals."""
    var, master = _ifname_var(backend), _resolved(nodes[0].address)
    if master is None:  # `ip route get` needs an address: no route to choose by, each collective picks its own
        why = f"not chosen: the master's name {nodes[0].address} does not resolve here"
        return {n.name: Choice(n.name, "", n.address, why) for n in nodes}, []
    choices, problems = {}, []
    for node, result, err in on_each(nodes, lambda n: _survey(n, master, var)):
        if err is not None:  # the link's own "node X: ..." lines, as pre-flight says them
            problems.append(f"{node.name}: " + str(err).removeprefix(f"node {node.name}: ").strip())
        elif isinstance(result, str):
            problems.append(result)
        else:
            choices[node.name] = result
    return choices, problems


def check_reach(nodes: list[Node], choices: dict[str, Choice]) -> list[str]:
    """Each node listens on its chosen address; every other node connects there. One line per node not reached."""
    listening = on_each(nodes, lambda n: node_request(
        n, "listen", timeout=10, address=choices[n.name].address, port=0, seconds=LISTEN_S, expect=len(nodes) - 1,
    ))  # fmt: skip
    problems, ports = [], {}
    for node, result, err in listening:
        c = choices[node.name]
        if err is not None:
            problems.append(f"{node.name}: cannot listen on {c.address} (interface {c.interface}): {err}")
        else:
            ports[node.name] = result["port"]
    if problems:
        return problems

    def connect(node: Node) -> list[tuple[str, str | None]]:
        return [(other.name, node_request(node, "port_check", timeout=CONNECT_TIMEOUT_S + 5,
                                          host=choices[other.name].address, port=ports[other.name])["error"])
                for other in nodes if other.name != node.name]  # fmt: skip

    failed: dict[str, list[str]] = {}
    for node, result, err in on_each(nodes, connect):
        for other, error in result or [(o.name, str(err)) for o in nodes if o.name != node.name]:
            if error:
                failed.setdefault(other, []).append(f"{node.name} ({choices[node.name].address}): {error}")
    for name, whom in failed.items():
        c = choices[name]
        where = f"{name}: its interface {c.interface or '-'} ({c.source}) at {c.address}"
        problems.append(f"{where} cannot be reached from " + "; ".join(whom))
    return problems


def torch_python(node: Node) -> list[str] | None:
    """The argv that starts the python of the node's training env: its torchrun command with torchrun -> python
    (/opt/venv/bin/torchrun, `conda run -n train torchrun`); None when the command does not end in torchrun."""
    argv = node.torchrun_argv
    if not argv or not (argv[-1] == "torchrun" or argv[-1].endswith("/torchrun")):
        return None
    return [*argv[:-1], argv[-1][: -len("torchrun")] + "python"]


def socket_env(node: Node, choice: Choice | None) -> dict[str, str]:
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for a node's processes: its chosen interface, each unless its env
    sets it."""
    if choice is None or not choice.interface:
        return {}
    own = node.env or {}
    return {var: choice.interface for var in VARS if var not in own}


def pairs_for(count: int) -> list[tuple[int, int]]:
    """The pairs measured apart from the group: none for two nodes (the group is the pair)."""
    if count == 2:
        return []
    pairs = list(combinations(range(count), 2))
    return pairs if len(pairs) <= MAX_PAIRS else [(0, j) for j in range(1, count)]


def check_sizes(sizes_mb: list[int] | None) -> list[int]:
    """The sizes (MB) to measure; NetcheckError in one line when out of bounds."""
    sizes = list(sizes_mb or SIZES_MB)
    if not 1 <= len(sizes) <= MAX_SIZES or not all(isinstance(s, int) and 1 <= s <= MAX_SIZE_MB for s in sizes):
        raise NetcheckError(f"sizes: 1 to {MAX_SIZES} whole numbers of MB from 1 to {MAX_SIZE_MB}, e.g. 1,16,64")
    return sorted(set(sizes))


def measure(nodes: list[Node], choices: dict[str, Choice], backend: str, sizes_mb: list[int],
            job: Job | None = None, gpus: dict[str, int] | None = None) -> NetCheck:  # fmt: skip
    """Run the measurement on every node at once (rank 0 = nodes[0]) and record it, figures or the reason none.
    gpus: the GPU each node measures with (a launch: one its job holds), else its first."""
    t0 = time.monotonic()
    names = [n.name for n in nodes]
    row = NetCheck(time=timezone.now(), nodes=names, node_set=",".join(sorted(names)), backend=backend,
                   interfaces={k: v.as_dict() for k, v in choices.items()}, job=job)  # fmt: skip
    try:
        result = _run(nodes, choices, backend, sizes_mb, gpus or {})
    except (NetcheckError, LinkError, AgentRequestError) as exc:
        row.ok, row.error = False, str(exc)[:1000]
    else:
        row.group = result["group"]
        row.pairs = [dict(p, a=names[p["a"]], b=names[p["b"]]) for p in result["pairs"]]
        if len(names) == 2:
            row.pairs = [dict(result["group"], a=names[0], b=names[1])]
    row.seconds = round(time.monotonic() - t0, 3)
    row.save()
    return row


def _run(
    nodes: list[Node], choices: dict[str, Choice], backend: str, sizes_mb: list[int], gpus: dict[str, int]
) -> dict:
    pythons = {n.name: torch_python(n) for n in nodes}
    lacking = [n.name for n in nodes if pythons[n.name] is None]
    if lacking:
        raise NetcheckError(f"{lacking[0]}: its torchrun command does not end in torchrun: no python to measure with")
    code = (node_file("netcheck.py") or b"").decode()
    master = nodes[0]
    port = node_request(master, "free_port", timeout=10, host=choices[master.name].address)["port"]
    sizes = [s * MB for s in sizes_mb]
    pair_sizes = [max([s for s in sizes if s <= PAIR_SIZE_MB * MB] or sizes[:1])]
    config = {"world": len(nodes), "backend": backend, "timeout_s": COLLECTIVE_TIMEOUT_S,
              "master": choices[master.name].address, "port": port, "sizes": sizes, "pair_sizes": pair_sizes,
              "pairs": pairs_for(len(nodes)), "budget_s": BUDGET_S, "max_iters": MAX_ITERS,
              "latency_iters": LATENCY_ITERS}  # fmt: skip

    def run(node: Node) -> dict:
        env = {str(k): str(v) for k, v in (node.env or {}).items()}
        env.update(socket_env(node, choices[node.name]))
        if backend == "nccl":
            env["CUDA_VISIBLE_DEVICES"] = str(gpus.get(node.name, 0))
        cfg = dict(config, rank=nodes.index(node), address=choices[node.name].address)
        out = node_request(node, "exec", timeout=MEASURE_WAIT_S, argv=[*pythons[node.name], "-c", code,
                                                                        json.dumps(cfg)], env=env)  # fmt: skip
        lines = (out.get("stdout") or "").strip().splitlines()
        try:
            answer = json.loads(lines[-1])
        except (ValueError, IndexError):
            detail = ((out.get("stderr") or "").strip().splitlines() or ["no output"])[-1]
            answer = {"ok": False, "error": f"exit {out.get('rc')}: {detail[:300]}"}
        return answer

    results = on_each(nodes, run)
    for node, answer, err in results:
        if err is not None:
            raise NetcheckError(f"{node.name}: {err}")
        if not answer.get("ok"):
            raise NetcheckError(f"{node.name}: the measurement failed: {answer.get('error')}")
    return results[0][1]


def on_one_machine(nodes: list[Node]) -> bool:
    """Whether the nodes share one machine (every address a loopback one): no link between them to measure."""
    try:
        return all(ipaddress.ip_address(n.address).is_loopback for n in nodes)
    except ValueError:
        return False


def recent(nodes: list[Node], choices: dict[str, Choice], backend: str) -> NetCheck | None:
    """A measurement of the same nodes, backend and interfaces younger than REUSE_S, if any."""
    since = timezone.now() - timedelta(seconds=REUSE_S)
    want = {k: v.as_dict() for k, v in choices.items()}
    rows = NetCheck.objects.filter(node_set=",".join(sorted(n.name for n in nodes)), backend=backend, ok=True,
                                   time__gte=since)  # fmt: skip
    return next((r for r in rows.order_by("-time")[:20] if r.interfaces == want), None)


def check(nodes: list[Node], sizes_mb: list[int] | None = None, job: Job | None = None,
          reuse: bool = False, gpus: dict[str, int] | None = None) -> Outcome:  # fmt: skip
    """Interfaces chosen, reachability checked, then measured (reuse: a recent measurement serves, and nodes on one
    machine are not measured). Refusals are in `problems`; nothing is measured while there are any."""
    out = Outcome()
    backend = backend_for(nodes)
    out.choices, out.problems = choose(nodes, backend)
    if out.problems:
        return out
    out.problems = check_reach(nodes, out.choices)
    if out.problems:
        return out
    if reuse:
        found = recent(nodes, out.choices, backend)
        if found is not None:
            out.measured, out.reused = found, True
            return out
        if on_one_machine(nodes):
            out.notes.append("the nodes share one machine: the network between them was not measured")
            return out
    out.measured = measure(nodes, out.choices, backend, check_sizes(sizes_mb), job, gpus)
    if not out.measured.ok:
        out.notes.append(f"the network was not measured: {out.measured.error}")
    return out


def netcheck(names: list[str], sizes_mb: list[int] | None = None) -> tuple[list[Node], Outcome]:
    """`ugro netcheck`: the named (default: every enabled) nodes, rank 0 a master when there is one, measured now.
    NetcheckError in one line for an unknown node, fewer than two nodes or bad sizes."""
    sizes = check_sizes(sizes_mb)
    try:
        chosen = named_nodes(names)
    except ValueError as exc:
        raise NetcheckError(str(exc)) from None
    if len(chosen) < 2:
        raise NetcheckError("netcheck needs two nodes or more: the network is between them")
    return chosen, check(chosen, sizes)


def for_launch(job: Job, ranks: list[Rank]) -> list[str]:
    """A multi-node job's pre-flight part: each rank's node told its interface (`node.socket_choice`, read by
    rank_env), refusals returned, the network measured unless a recent measurement serves."""
    nodes = [r.node for r in ranks]
    if len(nodes) < 2:
        return []
    held = {r.node.name: r.gpu_indices[0] for r in ranks if r.gpu_indices}
    out = check(nodes, job=job, reuse=True, gpus=held)
    for node in nodes:
        node.socket_choice = out.choices.get(node.name)
    for note in out.notes:
        log.warning("job %s pre-flight: %s", job.name, note)
    return out.problems


# -- the figures, in words --------------------------------------------------------------------------------------


def rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e9:.3g} Gbit/s"


def summary(row: NetCheck) -> list[str]:
    """The measurement in lines: the group at each size, then each pair."""
    if not row.ok:
        return [f"not measured: {row.error}"]
    lines = []
    group = row.group or {}
    sizes = ", ".join(f"{s['bytes'] // MB} MB {rate(s['busbw'])}" for s in group.get("sizes", []))
    lines.append(f"group of {len(row.nodes)} ({row.backend}): bus bandwidth {sizes}; "
                 f"latency {group.get('latency_us', 0):.0f} us")  # fmt: skip
    for p in row.pairs:
        size = p["sizes"][-1]
        lines.append(f"{p['a']} <-> {p['b']}: {rate(size['busbw'])} at {size['bytes'] // MB} MB, "
                     f"latency {p['latency_us']:.0f} us")  # fmt: skip
    return lines


def last_pairs() -> list[dict]:
    """The latest measured figures of every pair of enabled nodes, for the topology page: [{a, b, busbw, size_mb,
    latency_us, time, backend}], slowest first."""
    names = set(Node.objects.filter(enabled=True).values_list("name", flat=True))
    seen: dict[frozenset, dict] = {}
    for row in NetCheck.objects.filter(ok=True).order_by("-time")[:200]:
        for p in row.pairs:
            key = frozenset((p["a"], p["b"]))
            if key in seen or not key <= names or not p.get("sizes"):
                continue
            size = p["sizes"][-1]
            seen[key] = {"a": p["a"], "b": p["b"], "busbw": size["busbw"], "rate": rate(size["busbw"]),
                         "size_mb": size["bytes"] // MB, "latency_us": round(p["latency_us"]), "time": row.time,
                         "backend": row.backend}  # fmt: skip
    return sorted(seen.values(), key=lambda p: p["busbw"])


# -- advice on a running job -------------------------------------------------------------------------------------


@dataclass
class Advice:
    """A multi-node job's step split, and the node count its figures say is fastest."""

    nodes: int
    step_s: float
    compute_s: float
    comm_s: float
    best: int
    speedup: float  # the best count's samples/s over this run's
    busbw: float | None
    sentence: str


def _ring(k: int) -> float:
    return 2 * (k - 1) / k


def estimate(n: int, compute_s: float, comm_s: float, busbw: dict[int, float] | None = None) -> dict[int, float]:
    """Samples/s at each node count k <= n relative to one rank's per-step batch: k / (compute + comm_k), where the
    all-reduce moves 2(k-1)/k of the gradient over the bus bandwidth measured for k nodes (the group's where k's own
    is not known): comm_k = comm_n * ring(k)/ring(n) * busbw_n/busbw_k, none on one node."""
    busbw = busbw or {}
    out = {}
    for k in range(1, n + 1):
        comm = 0.0 if k == 1 else comm_s * _ring(k) / _ring(n)
        if k > 1 and busbw.get(n) and busbw.get(k):
            comm *= busbw[n] / busbw[k]
        out[k] = k / (compute_s + comm)
    return out


def _job_network(job: Job, names: list[str]) -> NetCheck | None:
    key = ",".join(sorted(names))
    return job.netchecks.filter(ok=True).order_by("-time").first() or (
        NetCheck.objects.filter(node_set=key, ok=True).order_by("-time").first()
    )


def advise(job: Job) -> Advice | None:
    """The advice for a multi-node job from its current attempt's first minutes of step lines (per step: the
    slowest rank's compute_s + sync_wait_s is the step; the least any rank waits is the exchange itself, the rest
    is waiting for a slower rank); None for a one-node job or before two logged intervals of every rank."""
    names = list(job.ranks.order_by("index").values_list("node__name", flat=True))
    if len(names) < 2:
        return None
    points = list(
        MetricPoint.objects.filter(
            job=job, attempt=job.attempt, name__in=("compute_s", "sync_wait_s"), superseded=False
        )
        .order_by("id")
        .values_list("rank", "step", "name", "value", "time")[:5000]
    )
    if not points:
        return None
    until = points[0][4] + timedelta(seconds=ADVICE_WINDOW_S)
    steps: dict[int, dict[int, dict[str, float]]] = {}
    for rank, step, name, value, when in points:
        if when <= until and step is not None:
            steps.setdefault(step, {}).setdefault(rank, {})[name] = value
    full = [s for s in sorted(steps) if len(steps[s]) >= len(names)
            and all(len(v) == 2 for v in steps[s].values())][ADVICE_SKIP_LINES:]  # fmt: skip
    if not full:
        return None
    step_s = median(max(v["compute_s"] + v["sync_wait_s"] for v in steps[s].values()) for s in full)
    comm_s = median(min(v["sync_wait_s"] for v in steps[s].values()) for s in full)
    compute_s = max(step_s - comm_s, 1e-9)
    n = len(names)
    row = _job_network(job, names)
    busbw: dict[int, float] = {}
    if row is not None and row.group.get("sizes"):
        busbw[n] = row.group["sizes"][-1]["busbw"]
        if row.pairs and n > 2:
            busbw[2] = max(p["sizes"][-1]["busbw"] for p in row.pairs)
    rates = estimate(n, compute_s, comm_s, busbw)
    best = max(rates, key=lambda k: (rates[k], -k))  # a tie goes to fewer nodes
    speedup = rates[best] / rates[n]
    share = comm_s / step_s if step_s > 0 else 0.0
    measured = f" over a measured {rate(busbw[n])} bus bandwidth" if n in busbw else " (network not measured)"
    head = (f"communication is {share:.0%} of a {step_s:.3g} s step ({comm_s:.3g} s exchanging gradients"
            f"{measured}, {compute_s:.3g} s computing, on {n} nodes)")  # fmt: skip
    if best < n and speedup >= CLEARLY_FASTER:
        tail = f"{best} node{'s' if best > 1 else ''} would be faster: about {speedup:.2f}x the samples/s of {n}"
    elif best < n:  # within the estimate's own error: not worth giving up nodes for
        tail = (f"fewer nodes would be about as fast ({best} node{'s' if best > 1 else ''}: about {speedup:.2f}x "
                "the samples/s)")  # fmt: skip
    else:
        nxt = rates[n - 1] / rates[n]
        tail = f"fewer nodes would not be faster ({n - 1} node{'s' if n > 2 else ''}: about {nxt:.2f}x the samples/s)"
    return Advice(n, step_s, compute_s, comm_s, best, speedup, busbw.get(n), f"{head}; {tail}.")


def advice(job: Job) -> str:
    """The advice sentence for the job page and `status`; '' where there is none (yet)."""
    found = advise(job)
    return found.sentence if found else ""


def report(nodes: list[Node], out: Outcome) -> dict:
    """What `ugro netcheck` (the command, the API, the client) says: ok, the lines to print, the figures."""
    row = out.measured
    lines = [f"{name}: interface {c.interface or '-'} at {c.address} ({c.source})" for name, c in out.choices.items()]
    lines += [f"note: {note}" for note in out.notes]
    if row is not None:
        lines += summary(row)
        if out.reused:
            lines.append(f"(measured at {row.time:%Y-%m-%d %H:%M:%S}, reused)")
    figures = None
    if row is not None:
        figures = {"time": row.time.isoformat(), "backend": row.backend, "ok": row.ok, "error": row.error,
                   "seconds": row.seconds, "group": row.group, "pairs": row.pairs}  # fmt: skip
    return {"ok": not out.problems and (row is None or row.ok), "nodes": [n.name for n in nodes],
            "problems": out.problems, "notes": out.notes, "lines": lines,
            "interfaces": {k: c.as_dict() for k, c in out.choices.items()}, "netcheck": figures}  # fmt: skip
