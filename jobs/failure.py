"""Why a job failed, as data: a kind from a fixed set, the first failing rank, the script's own exit code or
signal, and the one line that says what happened.

Pure functions over what the controller already has for each rank (RankFacts): torchrun's exit, the file
torchrun wrote to TORCHELASTIC_ERROR_FILE, the tail of the rank's output. No Django, no I/O.

What torch 2.13's torchrun leaves behind (recorded for real in tests/data/failures/):
- torchrun exits 1 whenever a worker fails, whatever the worker's own code. Its ChildFailedError table names
  the worker's code ("exitcode  : 3 (pid: 123)") or signal ("exitcode  : -9 (pid: 123)  (SIGKILL)",
  "traceback : Signal 9 (SIGKILL) received by PID 123"); with several workers the "Root Cause" block is the one.
- torchrun's own @record writes TORCHELASTIC_ERROR_FILE only when something raised: the worker's error file
  copied with "errorCode" (the worker's exit code) when the script's entry point used @record; torchrun's own
  exception (RendezvousTimeoutError, SignalException, ...) without "errorCode"; nothing at all when the script
  did not use @record, exited through sys.exit, or was killed by a signal.
- Worker exceptions after init_process_group are printed with a "[rankN]: " prefix on every line.
- With c10d, an agent that loses the store after its own workers succeeded logs RendezvousConnectionError
  tracebacks and still exits 0: only exit codes say whether a rank failed, never stderr.
"""

from __future__ import annotations

import json
import logging
import re
import signal as signals
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

log = logging.getLogger(__name__)

SUMMARY_MAX = 300  # one line for a CLI error, a page, an alert and a Prometheus label
LINE_MAX = 500  # the decisive line as stored
SCAN_LINE_MAX = 4096  # a line is cut to this before any pattern looks at it: a 10 MB line costs nothing
SCAN_LINES_MAX = 2000  # only the last lines of a tail are read
ERROR_FILE_MAX = 8 * 1024 * 1024  # larger is not an error file torchrun wrote


class FailureKind(StrEnum):
    """Why a job failed; recovery decides from this, never from free text."""

    OOM = "OOM"
    SCRIPT_ERROR = "SCRIPT_ERROR"
    RENDEZVOUS = "RENDEZVOUS"
    NODE_LOST = "NODE_LOST"
    KILLED = "KILLED"
    PREFLIGHT = "PREFLIGHT"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    NCCL = "NCCL"
    HANG = "HANG"
    UNKNOWN = "UNKNOWN"

    @property
    def description(self) -> str:
        """One line for a human."""
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    FailureKind.OOM: "a rank ran out of GPU (or host) memory",
    FailureKind.SCRIPT_ERROR: "the training script raised an error or exited with a non-zero code",
    FailureKind.RENDEZVOUS: "the nodes could not meet: the rendezvous timed out or its store was unreachable",
    FailureKind.NODE_LOST: "a node stopped answering while its rank ran",
    FailureKind.KILLED: "a rank was killed by a signal",
    FailureKind.PREFLIGHT: "pre-flight checks refused to start the job",
    FailureKind.CANCELLED: "the job was cancelled as asked",
    FailureKind.TIMEOUT: "the job ran past its time limit",
    FailureKind.NCCL: "a collective or communication error between ranks (NCCL, gloo)",
    FailureKind.HANG: "the job stopped printing metric lines for longer than its hang limit",
    FailureKind.UNKNOWN: "a rank failed without saying why",
}


@dataclass
class RankFacts:
    """What the controller knows about one rank once it ended (or stopped answering)."""

    index: int  # node rank
    node: str
    state: str  # "exited" | "lost" | "running"
    torchrun_rc: int | None = None  # torchrun's own exit code, from the rank wrapper
    signal: int | None = None  # the signal that ended torchrun itself, if one did
    error_file: str | None = None  # text of the rank's TORCHELASTIC_ERROR_FILE, None if torchrun wrote none
    log_tail: list[str] = field(default_factory=list)  # last ~200 lines of the rank's output, decoded
    lost_reason: str | None = None  # why the node counts as lost


@dataclass(frozen=True)
class Failure:
    """Why a job failed: kind, where, the script's own exit code or signal, and the decisive line."""

    kind: FailureKind
    rank: int | None = None
    node: str | None = None
    exit_code: int | None = None  # the script's own code, not torchrun's 1
    signal: int | None = None
    line: str | None = None
    torchrun_rc: int | None = None

    @property
    def signal_name(self) -> str | None:
        """The signal's name (SIGKILL for 9), None when there is no signal or it has no name."""
        return _signal_name(self.signal)

    def summary(self, limit: int = SUMMARY_MAX) -> str:
        """One bounded line: `OOM on rank 2 (gpu2), exit code 1: torch.OutOfMemoryError: CUDA out of memory...`."""
        text = str(self.kind)
        if self.rank is not None:
            text += f" on rank {self.rank}" + (f" ({self.node})" if self.node else "")
        elif self.node:
            text += f" on {self.node}"
        if self.exit_code is not None:
            text += f", exit code {self.exit_code}"
        if self.signal is not None:
            name = self.signal_name
            text += f", signal {self.signal}" + (f" ({name})" if name else "")
        if self.exit_code is None and self.signal is None and self.torchrun_rc not in (None, 0, 1):
            text += f", torchrun exit code {self.torchrun_rc}"  # 1 only says "something failed"
        if self.line:
            text += f": {self.line}"
        return _bound(_clean(text), limit)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (kind as its string)."""
        data = asdict(self)
        data["kind"] = str(self.kind)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Failure:
        """The inverse of to_dict; unknown kinds read as UNKNOWN."""
        try:
            kind = FailureKind(data.get("kind"))
        except ValueError:
            kind = FailureKind.UNKNOWN
        return cls(
            kind=kind,
            rank=_as_int(data.get("rank")),
            node=data.get("node") if isinstance(data.get("node"), str) else None,
            exit_code=_as_int(data.get("exit_code")),
            signal=_as_int(data.get("signal")),
            line=data.get("line") if isinstance(data.get("line"), str) else None,
            torchrun_rc=_as_int(data.get("torchrun_rc")),
        )


# --- reading one rank's output -------------------------------------------------------------------------------

# Line prefixes that say who printed, not what: torch's "[rank1]: ", torchrun --tee's "[default0]:",
# torch's Python logging ("E1123 12:17:19.488000 14291 torch/.../api.py:1008] ") and c10's C++ one.
_PREFIXES = re.compile(
    r"^(?:\[(?:rank|default)\d+\]:[ ]?"
    r"|[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]\s]+\] ?"
    r"|\[[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ [^\]]*\] ?)+"
)
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")
_TRACEBACK = "Traceback (most recent call last):"
# Noise inside C++ stack dumps that would otherwise match the patterns below
_SKIP = re.compile(r"^\s*(?:frame #\d+:|Exception raised from |The above exception|During handling of the above)")

# What a line says, from the most to the least telling (a rank's decisive line is the first of the best).
_OOM = 0  # out of memory on CUDA, HIP, MPS, XPU or the host allocator
_EXCEPTION = 1  # the exception line that ends a traceback, or an "...Error: ..." line
_WORKER_SIGNAL = 2  # torchrun saw a worker die of a signal
_NCCL = 3  # a collective library said what went wrong
_RENDEZVOUS = 4  # the rendezvous itself failed (timeout, closed, store not reachable at start)
_AGENT_SIGNAL = 5  # torchrun itself was signalled
_CONSEQUENCE = 6  # a peer or the store went away: the cause is elsewhere
_GENERIC = 7  # a line that says "error"

_OOM_RE = re.compile(
    r"\b(?:CUDA|HIP|XPU|NPU) out of memory|MPS backend out of memory|OutOfMemoryError"
    r"|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED|DefaultCPUAllocator: (?:can't allocate|not enough) memory"
)
_NCCL_RE = re.compile(
    r"NCCL error|\bnccl[A-Z]\w*Error\b|NCCL WARN|NCCL communicator|ProcessGroupNCCL|DistBackendError"
    r"|Watchdog caught collective operation timeout"
)
_RDZV_CONSEQUENCE_RE = re.compile(r"RendezvousConnectionError|The connection to the C10d store has failed")
_RDZV_RE = re.compile(
    r"Rendezvous\w*Error|RendezvousClosed|failed to join the rendezvous|DistStoreError"
    r"|server socket has failed to (?:listen|bind)"
)
_COMM_CONSEQUENCE_RE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|DistNetworkError|Failed to recv"
    r"|Connection was likely closed|recvValueWithTimeout failed|sendBytes failed"
)
_AGENT_SIGNAL_RE = re.compile(r"SignalException: Process \d+ got signal: (\d+)|Received (\d+) death signal")
_WORKER_SIGNAL_RE = re.compile(r"Signal (\d+) \((SIG\w+)\) received by PID \d+")
_ERROR_NAME_RE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)(?::|$)")
_EXCEPTION_LINE_RE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?::|$)")
_WRAPPER_RE = re.compile(r"ChildFailedError\b")
_GENERIC_RE = re.compile(r"\berror\b|\bfatal\b", re.IGNORECASE)

_ROOT_CAUSE = "Root Cause (first observed failure):"
_TABLE_EXITCODE_RE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\b")
_TABLE_TRACEBACK_RE = re.compile(r"^\s*traceback\s*:\s*(.*)$")
_FAILED_EXITCODE_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank")


@dataclass
class _Candidate:
    priority: int
    position: int
    line: str


def _prepare(lines: Any) -> list[str]:
    """The tail as clean, bounded lines: one entry per line, only the last state of a \\r progress bar."""
    out: list[str] = []
    if isinstance(lines, str | bytes):
        lines = [lines]
    try:
        items = list(lines or [])
    except TypeError:
        return out
    for item in items[-SCAN_LINES_MAX:]:
        if isinstance(item, bytes):
            item = item.decode("utf-8", "replace")
        elif not isinstance(item, str):
            continue
        for part in item.split("\n")[-SCAN_LINES_MAX:]:
            part = part[part.rfind("\r") + 1 :][:SCAN_LINE_MAX]
            part = _ANSI.sub("", part)
            out.append(_PREFIXES.sub("", part).rstrip())
    return out[-SCAN_LINES_MAX:]


def _classify(line: str, after_traceback: bool) -> int | None:
    """How telling one line is (a priority above), None if it says nothing about a failure."""
    text = line.strip()
    if not text or _SKIP.match(line) or _WRAPPER_RE.search(text):
        return None
    if _OOM_RE.search(text):
        return _OOM
    if _WORKER_SIGNAL_RE.search(text):
        return _WORKER_SIGNAL
    if _AGENT_SIGNAL_RE.search(text):
        return _AGENT_SIGNAL
    if _RDZV_CONSEQUENCE_RE.search(text):
        return _CONSEQUENCE
    if _NCCL_RE.search(text):
        return _NCCL
    if _RDZV_RE.search(text):
        return _RENDEZVOUS
    if _COMM_CONSEQUENCE_RE.search(text):
        return _CONSEQUENCE
    if (after_traceback and _EXCEPTION_LINE_RE.match(text)) or _ERROR_NAME_RE.match(text):
        return _EXCEPTION
    if _GENERIC_RE.search(text):
        return _GENERIC
    return None


def _candidates(lines: list[str], start: int = 0) -> list[_Candidate]:
    """Every telling line, skipping the frames of tracebacks (their source lines would match too)."""
    found: list[_Candidate] = []
    tb_indent: int | None = None  # inside a traceback: the indentation its exception line will have
    for i, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if line.endswith(_TRACEBACK):  # also torchrun's table: "  traceback : Traceback (...)", lines indented alike
            tb_indent = indent
            continue
        after_traceback = False
        if tb_indent is not None:
            if not line.strip() or indent > tb_indent:
                continue  # a frame, its source line or a caret line
            after_traceback, tb_indent = True, None
        priority = _classify(line, after_traceback)
        if priority is not None:
            found.append(_Candidate(priority, start + i, line.strip()))
    return found


def _best(candidates: list[_Candidate]) -> _Candidate | None:
    return min(candidates, key=lambda c: (c.priority, c.position), default=None)


# --- torchrun's error file -----------------------------------------------------------------------------------


def parse_error_file(text: str | bytes | None) -> dict[str, Any]:
    """What torchrun wrote to TORCHELASTIC_ERROR_FILE, never raising on what it did not write.

    Keys (each None when absent or malformed): message (the exception, `Type: text`, may span lines),
    traceback (its Python call stack), error_code (the worker's exit code: present only when torchrun copied a
    worker's error file, i.e. the script used @record), timestamp (seconds, the writer's clock: do not compare
    across nodes), source ("worker" when error_code is there, else "torchrun": torchrun's own exception).
    """
    result: dict[str, Any] = {"message": None, "traceback": None, "error_code": None, "timestamp": None, "source": None}
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if not isinstance(text, str) or not text.strip() or len(text) > ERROR_FILE_MAX:
        return result
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return result
    if not isinstance(data, dict):
        return result
    message = data.get("message")
    if isinstance(message, dict):
        extra = message.get("extraInfo") if isinstance(message.get("extraInfo"), dict) else {}
        result["message"] = message.get("message") if isinstance(message.get("message"), str) else None
        result["traceback"] = extra.get("py_callstack") if isinstance(extra.get("py_callstack"), str) else None
        result["timestamp"] = _as_int(extra.get("timestamp"))
        result["error_code"] = _as_int(message.get("errorCode"))
    elif isinstance(message, str):  # the newer flat format: {"message": "...", "timestamp": ...}
        result["message"] = message
        result["timestamp"] = _as_int(data.get("timestamp"))
        result["error_code"] = _as_int(data.get("errorCode"))
    else:
        return result
    if result["message"] is not None or result["traceback"] is not None:
        result["source"] = "worker" if result["error_code"] is not None else "torchrun"
    return result


# --- one rank, then the job ----------------------------------------------------------------------------------

# Which failure is the cause and which a consequence (lower wins; among equals, the lowest rank). A rank whose
# own script raised, ran out of memory or was killed is a cause; a lost node comes next; torchrun killed from
# outside (UGRO's own teardown does that to the survivors) or a silent failure after; ranks that only saw
# their peers, the store or the collective library go away come last.
_TIER_CAUSE, _TIER_LOST, _TIER_WEAK, _TIER_COMM, _TIER_CONSEQUENCE = range(5)
# A worker ended by one of these was most likely stopped, not crashed (UGRO's teardown signals every process of
# the job, workers included): weak. SIGKILL stays a cause (the kernel's OOM killer sends it).
_STOP_SIGNALS = {int(s) for s in (signals.SIGTERM, signals.SIGINT, signals.SIGHUP, signals.SIGUSR1, signals.SIGUSR2)}
# Signals that come from outside the process; the others (SIGABRT, SIGSEGV...) come from the process itself,
# often at exit after an exception was printed: then the exception says why.
_EXTERNAL_SIGNALS = _STOP_SIGNALS | {int(signals.SIGKILL)}


@dataclass
class _Verdict:
    tier: int
    failure: Failure


def _rank_verdict(facts: RankFacts) -> _Verdict | None:
    """This rank's own story, or None if it did not fail (still running, or exited 0)."""
    node = _bound(_clean(str(facts.node)), LINE_MAX) if facts.node is not None else None
    where = {"rank": _as_int(facts.index), "node": node, "torchrun_rc": _as_int(facts.torchrun_rc)}
    if facts.state == "lost":
        line = _bound(_clean(str(facts.lost_reason or "")), LINE_MAX) or "node stopped answering"
        return _Verdict(_TIER_LOST, Failure(FailureKind.NODE_LOST, line=line, **where))
    if facts.state != "exited":
        return None
    rc, agent_signal = _as_int(facts.torchrun_rc), _as_int(facts.signal)
    if agent_signal is None and rc is not None and rc < 0:
        agent_signal = -rc
    if rc == 0 and agent_signal is None:
        return None  # exit codes decide, not stderr: a c10d agent that lost the store after success exits 0

    lines = _prepare(facts.log_tail)
    error = parse_error_file(facts.error_file)
    found = _candidates(lines)
    if error["message"]:  # after the log's lines: the log's fully qualified names read better
        found += _candidates(_prepare(error["message"].split("\n")), start=len(lines))
    best = _best(found)
    oom = _best([c for c in found if c.priority == _OOM])

    table_code, table_line = _root_cause(lines)
    worker_code = table_code if table_code is not None else error["error_code"]
    exit_code = worker_code if worker_code is not None and worker_code > 0 else None
    worker_signal = -worker_code if worker_code is not None and worker_code < 0 else None
    if agent_signal is None:
        agent_signal = _agent_signal(found, rc)

    def failure(tier: int, kind: FailureKind, line: str | None, **extra: Any) -> _Verdict:
        fields = {"exit_code": exit_code, "signal": worker_signal, **extra}
        return _Verdict(tier, Failure(kind, line=_bound(_clean(line), LINE_MAX) if line else None, **where, **fields))

    said = _said(best)  # what the rank's own best line makes of it, if it names a kind
    if oom is not None:
        return failure(_TIER_CAUSE, FailureKind.OOM, oom.line)
    if worker_signal in _EXTERNAL_SIGNALS:  # stopped from outside: whatever it printed before is not why
        line = table_line or _first_line(found, _WORKER_SIGNAL) or f"worker killed by signal {worker_signal}"
        return failure(_TIER_WEAK if worker_signal in _STOP_SIGNALS else _TIER_CAUSE, FailureKind.KILLED, line)
    if exit_code is not None or worker_signal is not None:  # the script failed or crashed (SIGABRT, SIGSEGV...)
        if said is not None:
            return failure(said[0], said[1], best.line)
        if worker_signal is not None:
            # gloo aborts the process (SIGABRT) once a peer goes away: then the cause is that peer's
            peer_gone = next((c for c in found if c.priority == _CONSEQUENCE), None)
            if peer_gone is not None and (gone := _said(peer_gone)) is not None:
                return failure(gone[0], gone[1], peer_gone.line)
            line = table_line or _first_line(found, _WORKER_SIGNAL) or f"worker killed by signal {worker_signal}"
            return failure(_TIER_CAUSE, FailureKind.KILLED, line)
        return failure(_TIER_CAUSE, FailureKind.SCRIPT_ERROR, best.line if best and best.priority == _GENERIC else None)
    if agent_signal is not None:  # torchrun itself was signalled, as the teardown or a user does
        line = next((c.line for c in found if c.priority == _AGENT_SIGNAL and "SignalException" in c.line), None)
        line = line or _first_line(found, _AGENT_SIGNAL) or f"torchrun killed by signal {agent_signal}"
        return failure(_TIER_WEAK, FailureKind.KILLED, line, signal=agent_signal)
    if said is not None:  # torchrun failed on its own: a rendezvous, a lost store, or a crash of its own
        return failure(said[0], said[1], best.line)
    return failure(_TIER_WEAK, FailureKind.UNKNOWN, best.line if best is not None else _last_words(lines, rc))


def _said(best: _Candidate | None) -> tuple[int, FailureKind] | None:
    """The tier and kind a rank's decisive line names on its own (None for a signal or a vague line)."""
    if best is None:
        return None
    if best.priority == _EXCEPTION:
        return _TIER_CAUSE, FailureKind.SCRIPT_ERROR
    if best.priority == _NCCL:
        return _TIER_COMM, FailureKind.NCCL
    if best.priority == _RENDEZVOUS:
        return _TIER_COMM, FailureKind.RENDEZVOUS
    if best.priority == _CONSEQUENCE:
        kind = FailureKind.RENDEZVOUS if _RDZV_CONSEQUENCE_RE.search(best.line) else FailureKind.NCCL
        return _TIER_CONSEQUENCE, kind
    return None


def _root_cause(lines: list[str]) -> tuple[int | None, str | None]:
    """The worker's exit code (negative: a signal) and message from torchrun's ChildFailedError table."""
    start = max((i for i, line in enumerate(lines) if line.strip() == _ROOT_CAUSE), default=None)
    code: int | None = None
    message: str | None = None
    if start is not None:
        for line in lines[start + 1 : start + 12]:
            if code is None and (m := _TABLE_EXITCODE_RE.match(line)):
                code = int(m.group(1))
            elif m := _TABLE_TRACEBACK_RE.match(line):
                message = m.group(1).strip() if _WORKER_SIGNAL_RE.search(m.group(1)) else None
                break
    if code is None:  # the table fell out of the tail: torchrun's "failed (exitcode: N)" log line says it too
        codes = [int(m.group(1)) for line in lines if (m := _FAILED_EXITCODE_RE.search(line))]
        code = codes[0] if codes else None
    return code, message


def _agent_signal(found: list[_Candidate], rc: int | None) -> int | None:
    for c in found:
        if c.priority == _AGENT_SIGNAL and (m := _AGENT_SIGNAL_RE.search(c.line)):
            return int(m.group(1) or m.group(2))
    if rc is not None and 128 < rc < 128 + 65:  # a shell or `conda run` between the wrapper and torchrun
        return rc - 128
    return None


def _first_line(found: list[_Candidate], priority: int) -> str | None:
    return next((c.line for c in found if c.priority == priority), None)


def _last_words(lines: list[str], rc: int | None) -> str:
    last = next((line.strip() for line in reversed(lines) if line.strip()), None)
    if last:
        return last
    return "no output and no exit code" if rc is None else f"torchrun exited with code {rc} and printed nothing"


def explain(ranks: list[RankFacts]) -> Failure | None:
    """The root cause of a job's failure from its ranks' facts, None when no rank failed (all exited 0, or
    still running). No clocks are compared across nodes: a cause outranks a consequence, then the lowest rank
    wins. Never raises: a rank whose facts cannot be read counts as UNKNOWN."""
    return explain_now(ranks)[0]


def explain_now(ranks: list[RankFacts]) -> tuple[Failure | None, bool]:
    """explain(), and whether that explanation is settled. It is not while every rank that failed only saw a peer
    or the store go away (a consequence) and another rank still runs: that rank's own end, not seen yet, may be
    the cause (a worker killed on one node is seen by its peers on others before its own torchrun reports it)."""
    verdicts = _verdicts(ranks)
    if not verdicts:
        return None, True
    first = min(verdicts, key=lambda v: (v.tier, v.failure.rank is None, v.failure.rank or 0))
    running = any(getattr(facts, "state", None) == "running" for facts in ranks or [])
    return first.failure, not (running and first.tier == _TIER_CONSEQUENCE)


def _verdicts(ranks: list[RankFacts]) -> list[_Verdict]:
    verdicts: list[_Verdict] = []
    for facts in ranks or []:
        try:
            verdict = _rank_verdict(facts)
        except Exception:  # an explanation must never stop the job from ending
            log.exception("could not explain rank %r", getattr(facts, "index", None))
            node = getattr(facts, "node", None)
            rank = _as_int(getattr(facts, "index", None))
            node = _clean(str(node)) if node is not None else None
            verdict = _Verdict(_TIER_WEAK, Failure(FailureKind.UNKNOWN, rank=rank, node=node or None))
        if verdict is not None:
            verdicts.append(verdict)
    return verdicts


# --- small helpers -------------------------------------------------------------------------------------------


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,18}\s*", value):
        return int(value)
    return None


def _signal_name(number: int | None) -> str | None:
    if number is None:
        return None
    try:
        return signals.Signals(number).name
    except ValueError:
        return None


def _clean(text: str) -> str:
    """Printable, valid UTF-8, one line."""
    text = text.encode("utf-8", "replace").decode("utf-8", "replace")  # lone surrogates from binary output
    text = _ANSI.sub("", text)
    return " ".join(_CONTROL.sub(" ", text).split())


def _bound(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(0, limit - 3)].rstrip() + "..."
