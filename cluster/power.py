"""Idle nodes sleep and wake: a node's `power:` block, putting it to sleep, waking it, and watching it wake.

The model is Slurm's power saving (SuspendProgram, ResumeProgram, ResumeTimeout, a node state of its own while
it sleeps). A node's `power:` block (cluster.yaml, admin) says how:

    power:
      sleep: systemctl suspend          # run on the node through its agent (argv split like a shell, never one)
      wake: wol                         # a Wake-on-LAN magic packet ...
      mac: 3c:7c:3f:aa:bb:cc            # ... for this card
      broadcast: 192.168.1.255          # optional (255.255.255.255), and port (9)
      # or: wake_command: ipmitool -H bmc2 chassis power on    (run on the controller, argv, never a shell)
      idle_after: 30m                   # with no job, service replica or reservation that long: put to sleep
      wake_timeout: 120s                # not answering that long after a wake: DOWN, with an alert

States: an awake node (unknown, healthy, degraded) is put to sleep -> ASLEEP (no alert; the health monitor does
not probe it; `watch` records an "asleep" sample in its stead, so its history shows the gap as asleep). A wake
makes it WAKING; `watch` knocks (a TCP connect to its SSH port) every asleep and waking node on each health tick:
one that answers and says hello is awake again (woken by UGRO or by hand), is probed at once and the scheduler is
asked to start what waited for it; a waking node silent past wake_timeout is DOWN with an alert, and the health
monitor takes it from there. Which node sleeps or wakes, and when, is the scheduler's side (jobs/power.py).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import shlex
import socket
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psutil
from django.db import transaction
from django.utils import timezone

from . import alerts
from .fanout import on_each
from .links import AgentRequestError, LinkError
from .models import Alert, HealthSample, Node

log = logging.getLogger(__name__)

POWER_KEYS = ("sleep", "wake", "mac", "broadcast", "port", "wake_command", "idle_after", "wake_timeout")
IDLE_AFTER_S = 30 * 60
WAKE_TIMEOUT_S = 120
WOL_PORT = 9
WOL_BROADCAST = "255.255.255.255"
SLEEP_COMMAND_TIMEOUT_S = 30  # `systemctl suspend` returns at once; a command still running after this failed
WAKE_COMMAND_TIMEOUT_S = 60  # an IPMI or smart-plug call
KNOCK_TIMEOUT_S = 1.0
ASLEEP_SAMPLE_EVERY_S = 40.0  # as often as the monitor probes an idle node: the history has no hole
MAC_RE = re.compile(r"[0-9a-f]{2}([:-])[0-9a-f]{2}(\1[0-9a-f]{2}){4}", re.IGNORECASE)
DURATION_RE = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


class PowerError(ValueError):
    """A power block, a sleep or a wake refused or failed; `key` names the power: key at fault (for import)."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


def _duration_s(value: Any, key: str) -> int:
    """Seconds from 30m, 2h, 90s, 1h30m or a plain number of seconds."""
    if isinstance(value, int) and not isinstance(value, bool):
        seconds = value
    else:
        m = DURATION_RE.fullmatch(str(value).strip().lower())
        if not str(value).strip() or m is None or not any(m.groups()):
            raise PowerError(f"must be a duration like 30m, 2h or 90s, not {value!r}", key)
        d, h, mi, s = (int(x) if x else 0 for x in m.groups())
        seconds = ((d * 24 + h) * 60 + mi) * 60 + s
    if not 1 <= seconds <= 30 * 86400:
        raise PowerError(f"must be between 1s and 30d, not {value!r}", key)
    return seconds


def _command(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise PowerError(f"must be a command line, not {value!r}", key)
    try:
        argv = shlex.split(value)
    except ValueError as exc:
        raise PowerError(f"cannot be split into a command: {exc}", key) from None
    if not argv:
        raise PowerError("must not be empty", key)
    return value.strip()


def this_machines_addresses() -> set[str]:
    """Every name and address the controller's machine answers to by itself: its interfaces' addresses, its host
    names, localhost. (The test rig's 127.0.0.2... stand for other machines: sshd nodes each on its own address.)"""
    found = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "::", socket.gethostname().lower(), socket.getfqdn().lower()}
    for addrs in psutil.net_if_addrs().values():
        found.update(a.address.split("%")[0].lower() for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    return found


def is_this_machine(address: str, transport: str) -> bool:
    """Whether a node at this address is the controller's own machine (the local demo node is, always)."""
    if transport == Node.Transport.LOCAL:
        return True
    text = address.strip().strip("[]").lower()
    try:
        text = str(ipaddress.ip_address(text))
    except ValueError:
        pass
    return text in this_machines_addresses()


def parse_power(block: Any, address: str, transport: str) -> dict[str, Any]:
    """A node's `power:` block checked and normalised (Node.power); PowerError in one line naming the key."""
    if block is None or block == {}:
        return {}
    if not isinstance(block, dict):
        raise PowerError("must be a mapping of sleep, wake, mac, idle_after, ...")
    for key in block:
        if key not in POWER_KEYS:
            raise PowerError(f"unknown key (known: {', '.join(POWER_KEYS)})", str(key))
    if block.get("sleep") is None:
        raise PowerError("is required: the command that puts the node to sleep, e.g. systemctl suspend", "sleep")
    out: dict[str, Any] = {"sleep": _command(block["sleep"], "sleep")}
    if is_this_machine(address, transport):
        raise PowerError(f"would put the controller's own machine to sleep ({address or 'local'} is this machine); "
                         "refused", "sleep")  # fmt: skip
    wake = block.get("wake", "command" if block.get("wake_command") is not None else None)
    if wake == "wol":
        mac = block.get("mac")
        if not isinstance(mac, str) or not MAC_RE.fullmatch(mac.strip()):
            raise PowerError(f"must be a MAC address like 3c:7c:3f:aa:bb:cc, not {mac!r}", "mac")
        out.update(wake="wol", mac=mac.strip().lower().replace("-", ":"))
        broadcast = block.get("broadcast", WOL_BROADCAST)
        try:
            out["broadcast"] = str(ipaddress.IPv4Address(str(broadcast).strip()))
        except ValueError:
            raise PowerError(f"must be an IPv4 broadcast address like 192.168.1.255, not {broadcast!r}",
                             "broadcast") from None  # fmt: skip
        port = block.get("port", WOL_PORT)
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise PowerError(f"must be a UDP port 1-65535, not {port!r}", "port")
        out["port"] = port
        if block.get("wake_command") is not None:
            raise PowerError("give wake: wol with mac, or wake_command, not both", "wake_command")
    elif wake == "command":
        if block.get("wake_command") is None:
            raise PowerError("wake: command needs wake_command: the command the controller runs", "wake_command")
        out.update(wake="command", wake_command=_command(block["wake_command"], "wake_command"))
        for key in ("mac", "broadcast", "port"):
            if block.get(key) is not None:
                raise PowerError("is for wake: wol only", key)
    else:
        raise PowerError(f"must be wol (with mac:) or command (with wake_command:), not {wake!r}", "wake")
    out["idle_after_s"] = _duration_s(block.get("idle_after", IDLE_AFTER_S), "idle_after")
    out["wake_timeout_s"] = _duration_s(block.get("wake_timeout", WAKE_TIMEOUT_S), "wake_timeout")
    return out


def power_block(power: dict[str, Any]) -> dict[str, Any]:
    """Node.power as cluster.yaml writes it (export_cluster): parse_power's input again."""
    if not power:
        return {}
    keep = ("sleep", "wake", "mac", "broadcast", "port", "wake_command")
    out = {k: power[k] for k in keep if k in power}
    out["idle_after"] = f"{power['idle_after_s']}s"
    out["wake_timeout"] = f"{power['wake_timeout_s']}s"
    return out


def magic_packet(mac: str) -> bytes:
    """Wake-on-LAN: six 0xFF bytes, then the card's six-byte MAC sixteen times (102 bytes)."""
    if not MAC_RE.fullmatch(mac):
        raise PowerError(f"not a MAC address: {mac!r}", "mac")
    return b"\xff" * 6 + bytes.fromhex(re.sub("[:-]", "", mac)) * 16


def send_magic_packet(mac: str, broadcast: str = WOL_BROADCAST, port: int = WOL_PORT) -> None:
    """One magic packet as a UDP datagram to broadcast:port (what `wakeonlan` and `etherwake -b` send)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        s.sendto(magic_packet(mac), (broadcast, port))


AWAKE = (Node.Status.UNKNOWN, Node.Status.HEALTHY, Node.Status.DEGRADED)
ASLEEP = (Node.Status.ASLEEP, Node.Status.WAKING)


def _clock(at: datetime) -> str:
    return timezone.localtime(at).strftime("%H:%M:%S")


def _short(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]


def put_to_sleep(node: Node, why: str, still_idle: Callable[[Node], bool] | None = None) -> str:
    """Run the node's sleep command through its agent: ASLEEP. The node is marked ASLEEP first, so no scheduler
    places a job on it meanwhile, and `still_idle` (the caller's check that nothing holds it) is asked after that;
    PowerError (one line) when it cannot sleep. A command that fails leaves it awake, with a "sleep" alert naming
    the command's error."""
    argv = shlex.split(node.power.get("sleep") or "")
    if not argv:
        raise PowerError(f"{node.name} has no power: block with a sleep command")
    if is_this_machine(node.address, node.transport):
        raise PowerError(f"{node.name} is the controller's own machine: UGRO does not put it to sleep")
    if node.status not in AWAKE:
        raise PowerError(f"{node.name} is {node.status}: only an awake node is put to sleep")
    now = timezone.now()
    reason = f"asleep since {_clock(now)} ({why})"[:500]
    before = {"status": node.status, "status_reason": node.status_reason}
    if not Node.objects.filter(pk=node.pk, status=node.status).update(
        status=Node.Status.ASLEEP, status_reason=reason, power_since=now, idle_since=None
    ):
        raise PowerError(f"{node.name} changed state meanwhile; not put to sleep")
    if still_idle is not None and not still_idle(node):
        _awake_again(node, before, now)
        raise PowerError(f"{node.name} took work meanwhile; not put to sleep")
    try:
        # the agent's exec gives a command SLEEP_COMMAND_TIMEOUT_S (its default) before it counts as failed
        out = node.link().request("exec", timeout=SLEEP_COMMAND_TIMEOUT_S + 10, argv=argv)
    except (LinkError, AgentRequestError) as exc:
        if not getattr(exc, "delivered", False):
            _awake_again(node, before, now)
            raise PowerError(f"{node.name} did not take the sleep command: {exc}") from None
        out = None  # sent, and the link went as the machine did: asleep (a knock says so if not)
    if out is not None and out.get("rc") != 0:
        error = _short(out.get("stderr")) or _short(out.get("stdout")) or f"exit {out.get('rc')}"
        message = f"{node.name} did not go to sleep: {shlex.join(argv)} exited {out.get('rc')}: {error}"
        _awake_again(node, before, timezone.now())  # idle again from now: tried after another idle spell
        alerts.open_alert(node, "sleep", Alert.Severity.WARNING, message)
        raise PowerError(message)
    Node.objects.filter(pk=node.pk, status=Node.Status.ASLEEP).update(
        breaker={}, health_checks=[], poll_lease_until=None
    )
    node.link().close()  # a sleeping machine answers nothing: the next request connects afresh after the wake
    alerts.resolve(node.alerts.filter(key="sleep", resolved_at__isnull=True))
    _asleep_sample(node, now)
    node.refresh_from_db()
    log.info("%s put to sleep (%s)", node.name, why)
    return reason


def _awake_again(node: Node, before: dict[str, str], idle_since: datetime) -> None:
    Node.objects.filter(pk=node.pk, status=Node.Status.ASLEEP).update(**before, power_since=None, idle_since=idle_since)
    node.refresh_from_db()


def wake(node: Node, why: str) -> str:
    """Send the node's wake (its magic packet, or its wake command on the controller): WAKING from now. A wake
    command that fails leaves the node DOWN with an alert naming its error. PowerError in one line."""
    power = node.power or {}
    if not power:
        raise PowerError(f"{node.name} has no power: block: UGRO cannot wake it")
    if node.status == Node.Status.WAKING:
        return node.status_reason
    if node.status not in (Node.Status.ASLEEP, Node.Status.DOWN):  # DOWN: a wake that timed out, tried again
        raise PowerError(f"{node.name} is {node.status}, not asleep")
    now = timezone.now()
    reason = f"waking since {_clock(now)} ({why})"[:500]
    if not Node.objects.filter(pk=node.pk, status=node.status).update(
        status=Node.Status.WAKING, status_reason=reason, power_since=now
    ):
        node.refresh_from_db()
        return node.status_reason  # another worker woke it, or it woke itself
    try:
        if power.get("wake") == "wol":
            send_magic_packet(power["mac"], power.get("broadcast", WOL_BROADCAST), power.get("port", WOL_PORT))
        else:
            argv = shlex.split(power["wake_command"])
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=WAKE_COMMAND_TIMEOUT_S,
                                  check=False)  # fmt: skip
            if done.returncode != 0:
                error = _short(done.stderr.decode("utf-8", "replace")) or f"exit {done.returncode}"
                raise OSError(f"{shlex.join(argv)} exited {done.returncode}: {error}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        _went_down(node, f"the wake failed: {exc}")
        raise PowerError(f"{node.name}: the wake failed: {exc}") from None
    node.refresh_from_db()
    log.info("%s waking (%s)", node.name, why)
    return reason


def _went_down(node: Node, why: str) -> None:
    from .health import Breaker  # the monitor's own breaker: open, so it knocks and backs off as for any DOWN node

    breaker = Breaker()
    breaker.trip(time.time())
    Node.objects.filter(pk=node.pk).update(
        status=Node.Status.DOWN, status_reason=why[:500], health_score=0, breaker=breaker.to_dict(), power_since=None,
        health_checks=[{"name": "reachable", "severity": "critical", "detail": why[:300]}],
    )  # fmt: skip
    alerts.open_alert(node, "down", "critical", f"{node.name} is DOWN: {why}")


def _asleep_sample(node: Node, at: datetime) -> None:
    HealthSample.objects.create(node=node, time=at, ok=False, status=Node.Status.ASLEEP, error="asleep")
    Node.objects.filter(pk=node.pk).update(last_poll_at=at)


_awake_hooks: list[Callable[[list[Node]], None]] = []


def on_awake(hook: Callable[[list[Node]], None]) -> None:
    """Let an app above (jobs, at ready()) hear of nodes that woke: the scheduler starts what waited for them."""
    if hook not in _awake_hooks:
        _awake_hooks.append(hook)


def _knock(node: Node) -> bool:
    try:
        socket.create_connection((node.address, node.ssh_port), timeout=KNOCK_TIMEOUT_S).close()
    except OSError:
        return False
    try:
        node.link().heard_again()
        node.reach()  # the SSH port answers while a machine boots: awake once its agent says hello
    except (LinkError, AgentRequestError):
        return False
    return True


def watch(now: datetime | None = None) -> list[str]:
    """One look at the asleep and waking nodes (each health tick): knocked, woken ones probed and handed on, the
    ones past their wake timeout DOWN, the asleep ones' history kept. Returns a line per change."""
    from .monitor import poll_once  # the monitor module skips asleep nodes and calls nothing here

    now = now or timezone.now()
    sleepers = list(Node.objects.filter(enabled=True, status__in=ASLEEP, transport=Node.Transport.SSH))
    if not sleepers:
        return []
    lines, woke = [], []
    for node, answered, _err in on_each(sleepers, _knock):
        if answered:
            since = node.power_since or now
            how = "woke" if node.status == Node.Status.WAKING else "is awake (woken outside UGRO)"
            with transaction.atomic():
                if not Node.objects.filter(pk=node.pk, status=node.status).update(
                    status=Node.Status.UNKNOWN, status_reason="", power_since=None, idle_since=now, breaker={}
                ):
                    continue
            lines.append(f"{node.name} {how} after {int((now - since).total_seconds())} s")
            woke.append(node)
        elif (
            node.status == Node.Status.WAKING
            and node.power_since is not None
            and ((now - node.power_since).total_seconds() >= (node.power or {}).get("wake_timeout_s", WAKE_TIMEOUT_S))
        ):
            limit = (node.power or {}).get("wake_timeout_s", WAKE_TIMEOUT_S)
            if Node.objects.filter(pk=node.pk, status=Node.Status.WAKING).exists():
                _went_down(node, f"did not wake within {limit} s")
                lines.append(f"{node.name} did not wake within {limit} s: DOWN")
        elif node.last_poll_at is None or (now - node.last_poll_at).total_seconds() >= ASLEEP_SAMPLE_EVERY_S:
            _asleep_sample(node, now)
    if woke:
        poll_once([Node.objects.get(pk=n.pk) for n in woke], force=True)
        for hook in _awake_hooks:
            hook(woke)
    for line in lines:
        log.info("%s", line)
    return lines
