# UGRO node agent. Its source travels over the SSH link and runs under the node's own python;
# nothing is installed on the node. Stdlib only, Python >= 3.8 (no __future__ imports: this file is
# concatenated after others and exec'd). It speaks JSON lines: one request in, one response out.
import base64
import glob
import hashlib
import heapq
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib

AGENT_VERSION = 3
ZLIB_MIN_BYTES = 512
MAX_TAIL_BYTES = 4 * 1024 * 1024
MAX_TAIL_WAIT_MS = 5000
TAIL_POLL_S = 0.01
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
# A second start with the same key waits this long for the first one (another agent) to finish.
START_CLAIM_WAIT_S = 15.0
START_CLAIM_POLL_S = 0.02


class AgentError(Exception):
    """A request that cannot be carried out; its message goes back to the controller verbatim."""


def _expand(path):
    return os.path.abspath(os.path.expanduser(path)) if path else path


def _here():
    """<host>-<pid>: a name of this process unique among the nodes that may share a working directory (NFS)."""
    return "%s-%d" % (socket.gethostname(), os.getpid())


def _write_atomic(path, text):
    tmp = "%s.tmp.%s" % (path, _here())  # per process: two agents (of two nodes) may write the same record
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _boot_id():
    """This boot's id (changes when the node reboots), or None where the kernel has none."""
    try:
        with open(BOOT_ID_PATH) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _proc_start_time(pid):
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), or None if unreadable.

    A pid with the same start time is the same process: pids are reused, start times are not.
    """
    try:
        with open("/proc/%d/stat" % int(pid), "rb") as fh:
            stat = fh.read()
        # comm (field 2) may hold spaces and parentheses: the fields after it follow the last ')'
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _proc_alive(pid, start_time):
    """True while pid runs (a zombie has ended) and, when start_time is known, is that same process."""
    if not pid:
        return False
    try:
        with open("/proc/%d/stat" % int(pid), "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return False
    except OSError:
        try:  # no /proc here: the pid alone is all there is to go on
            os.kill(int(pid), 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return False
    return start_time is None or int(fields[19]) == int(start_time)


def _resolve_executable(exe, env):
    if os.sep in exe:
        path = _expand(exe)
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise AgentError("%s is not an executable file on this node" % exe)
        return path
    found = shutil.which(exe, path=env.get("PATH", os.defpath))
    if not found:
        raise AgentError("%s was not found on PATH on this node" % exe)
    return found


def op_hello(req):
    return {
        "version": AGENT_VERSION,
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": sys.platform,
        "time": time.time(),
        "boot_id": _boot_id(),
    }


def _read_json(path):
    """A record (JSON object) from path, or None when absent, half-written or not a record."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _claim(record, claim):
    """Create the start record exclusively, complete from its first byte; False if it exists."""
    tmp = "%s.claim.%s" % (record, _here())
    with open(tmp, "w") as fh:
        fh.write(json.dumps(claim))
    try:
        os.link(tmp, record)  # atomic and exclusive: of two racing agents exactly one wins
        return True
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links: O_EXCL is as exclusive, readers wait out the write
        try:
            fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(claim))
        return True
    finally:
        os.unlink(tmp)


def _start_result(rec, duplicate):
    out = {k: rec.get(k) for k in ("key", "pid", "pid_start", "wrapper_pid", "wrapper_start", "boot_id", "started")}
    out["duplicate"] = duplicate
    return out


def _repeat_start(record, key):
    """A start whose record exists: the first start's result (duplicate), its failure, or a refusal."""
    deadline = time.time() + START_CLAIM_WAIT_S
    gone_since = None
    while True:
        rec = _read_json(record)
        if rec is not None and rec.get("key") != key:
            raise AgentError(
                "start record %s belongs to start key %r, not %r: a new attempt needs new paths"
                % (record, rec.get("key"), key)
            )
        if rec is not None and rec.get("pid"):
            return _start_result(rec, True)
        if rec is not None and rec.get("error"):
            raise AgentError(rec["error"])
        now = time.time()
        if rec is not None and (
            rec.get("boot_id") != _boot_id() or not _proc_alive(rec.get("agent_pid"), rec.get("agent_start"))
        ):
            # The claiming agent is gone; its wrapper may still be about to write the record.
            gone_since = gone_since or now
            if now - gone_since >= 1.0:
                raise AgentError(
                    "the first start with key %r did not finish (its agent is gone); not starting again" % key
                )
        if now >= deadline:
            if rec is None:
                raise AgentError("start record %s is unreadable; not starting %s again" % (record, key))
            raise AgentError("the first start with key %r is still in progress" % key)
        time.sleep(START_CLAIM_POLL_S)


def op_start(req):
    """Start argv detached (own session, survives the link) with output appended to req['log'].

    With a `key` the start is idempotent: the first start creates its record (`record`, default
    exit_file + ".start") exclusively and the rank wrapper fills in the pids; a repeat of the key
    starts nothing and returns the first start's result with "duplicate": true (or its failure);
    another key over an existing record is refused.
    """
    argv = [str(a) for a in req["argv"]]
    cwd = _expand(req.get("cwd") or "~")
    log_path = _expand(req["log"])
    exit_path = _expand(req["exit_file"])
    key = req.get("key")
    if key is not None and (not isinstance(key, str) or not key):
        raise AgentError("start key must be a non-empty string, got %r" % (key,))
    record = _expand(req.get("record") or exit_path + ".start") if key is not None else None
    if record is not None and os.path.exists(record):
        return _repeat_start(record, key)
    if not os.path.isdir(cwd):
        raise AgentError("working directory %s does not exist on this node" % cwd)
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
    argv[0] = _resolve_executable(argv[0], env)
    script_index = req.get("script_index")
    if script_index is not None:
        # the same expansion `stat` applies: the file pre-flight found is the file that runs
        script = _expand(argv[script_index])
        if not os.path.isfile(script):
            raise AgentError("script %s is not a file on this node" % script)
        argv[script_index] = script
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    for directory in req.get("mkdirs") or []:  # the job's own directory (UGRO_JOB_DIR), made before it starts
        os.makedirs(_expand(directory), exist_ok=True)
    boot_id = _boot_id()
    if record is not None:
        os.makedirs(os.path.dirname(record), exist_ok=True)
        me = os.getpid()
        claim = {"key": key, "state": "starting", "agent_pid": me, "agent_start": _proc_start_time(me),
                 "boot_id": boot_id, "claimed": time.time()}  # fmt: skip
        if not _claim(record, claim):
            return _repeat_start(record, key)  # another agent won the race for this key
    try:
        if os.path.exists(exit_path):
            os.unlink(exit_path)
        rfd, wfd = os.pipe()
        child = os.fork()
    except OSError as exc:  # nothing started: say so in the record, or a repeat would wait on it
        error = "could not start %s: %s" % (argv[0], exc)
        if record is not None:
            _write_atomic(record, json.dumps({"key": key, "state": "failed", "error": error, "boot_id": boot_id}))
        raise AgentError(error)
    if child == 0:
        try:
            os.close(rfd)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            logfd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                proc = subprocess.Popen(argv, stdin=devnull, stdout=logfd, stderr=logfd, cwd=cwd, env=env)
            except OSError as exc:
                failed = {"key": key, "state": "failed", "error": "could not start %s: %s" % (argv[0], exc),
                          "boot_id": boot_id, "ended": time.time()}  # fmt: skip
                if record is not None:
                    _write_atomic(record, json.dumps(failed))
                os.write(wfd, json.dumps(failed).encode())
                os._exit(1)
            me = os.getpid()
            started = {"key": key, "state": "started", "pid": proc.pid, "pid_start": _proc_start_time(proc.pid),
                       "wrapper_pid": me, "wrapper_start": _proc_start_time(me), "boot_id": boot_id,
                       "started": time.time()}  # fmt: skip
            # The wrapper writes its own record: it holds even if the agent or the link dies now.
            if record is not None:
                _write_atomic(record, json.dumps(started))
            os.write(wfd, json.dumps(started).encode())
            os.close(wfd)
            os.close(logfd)
            rc = proc.wait()
            # rc < 0: killed by signal -rc (Popen's convention), recorded both ways
            ended = {"rc": rc, "signal": -rc if rc < 0 else None, "ended": time.time(), "key": key}
            _write_atomic(exit_path, json.dumps(ended))
        finally:
            os._exit(0)
    os.close(wfd)
    os.waitpid(child, 0)
    chunks = []
    while True:
        chunk = os.read(rfd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(rfd)
    try:
        result = json.loads(b"".join(chunks).decode() or "{}")
    except ValueError:
        result = {}
    if "error" in result:
        raise AgentError(result["error"])
    if "pid" not in result:
        error = "the rank wrapper died before starting %s" % argv[0]
        if record is not None:
            _write_atomic(record, json.dumps({"key": key, "state": "failed", "error": error, "boot_id": boot_id}))
        raise AgentError(error)
    return _start_result(result, False)


def _read_exit(path):
    return _read_json(path)


def _tail_ready(items):
    """True once a log has grown past what the caller saw (its offset, or `wait_above` when larger:
    a partial last line it has seen but not taken) or a rank's exit record exists."""
    for item in items:
        seen = max(int(item["offset"]), int(item.get("wait_above") or 0))
        try:
            if os.stat(_expand(item["path"])).st_size > seen:
                return True
        except OSError:
            pass
        if item.get("exit_file") and os.path.exists(_expand(item["exit_file"])):
            return True
    return False


def op_tail(req):
    """Bytes of each log from its offset; the exit record is read first so EOF after it is final.

    An item asking "zlib" gets its data zlib-compressed (level 1) when that is worth it ("zlib": true
    in the answer says it is).

    wait_ms (optional, at most MAX_TAIL_WAIT_MS): a long poll. If no log has grown and no rank has
    exited, wait up to that long (checking every TAIL_POLL_S) before answering, so a follower
    hears of a new line within milliseconds without asking over and over.

    release_before (optional, at most the item's offset: bytes the caller has stored already): the disk
    blocks of the log's first that many bytes are freed (`_release`); "released" in the answer says whether
    they could be.
    """
    wait = min(float(req.get("wait_ms") or 0), MAX_TAIL_WAIT_MS) / 1000.0
    if wait > 0:
        deadline = time.time() + wait
        while not _tail_ready(req["files"]) and time.time() < deadline:
            time.sleep(TAIL_POLL_S)
    out = []
    for item in req["files"]:
        path = _expand(item["path"])
        offset = int(item["offset"])
        limit = min(int(item.get("max_bytes") or MAX_TAIL_BYTES), MAX_TAIL_BYTES)
        exit_info = _read_exit(_expand(item["exit_file"])) if item.get("exit_file") else None
        data = b""
        size = None
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size > offset:
                    fh.seek(offset)
                    data = fh.read(limit)
        except FileNotFoundError:
            pass
        released = None
        if item.get("release_before") and size:
            released = _release(path, min(int(item["release_before"]), offset, size))
        packed = bool(item.get("zlib")) and len(data) >= ZLIB_MIN_BYTES
        out.append(
            {
                "key": item.get("key"),
                "size": size,
                # metric lines shrink 5-10x: fewer SSH packets for the controller to decrypt and parse
                "data": base64.b64encode(zlib.compress(data, 1) if packed else data).decode("ascii"),
                "zlib": packed,
                "eof": size is None or offset + len(data) >= size,
                "exit": exit_info,
                "released": released,
            }
        )
    return {"files": out}


def _release(path, upto):
    """Free the disk blocks of a log's first `upto` bytes (a hole: FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE):
    its size and every offset stay as they were, and its writer (O_APPEND) goes on at the end; those bytes read
    as zeros after. For a log a long-running process writes and its caller has copied: a service's engine logs a
    line per request for weeks. False where the filesystem cannot (the log then keeps its bytes)."""
    if upto <= 0:
        return True  # nothing to free
    fallocate = _fallocate()
    if fallocate is None:
        return False
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return False
    try:
        return fallocate(fd, 3, 0, int(upto)) == 0
    finally:
        os.close(fd)


_libc = []


def _fallocate():
    """libc's fallocate(2) (the process's own libc: no library search), None where there is none."""
    if not _libc:
        import ctypes

        try:
            call = ctypes.CDLL(None, use_errno=True).fallocate
            call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        except (OSError, AttributeError):
            call = None
        _libc.append(call)
    return _libc[0]


def _job_pids(tag, node):
    # ugro_tagged_procs comes from probe.py, which is always sent ahead of this file.
    return sorted(pid for pid, job, where in ugro_tagged_procs() if job == tag and where == node)  # noqa: F821


def op_procs(req):
    return {"pids": _job_pids(req["tag"], req["node"])}


def op_kill(req):
    """Signal every process whose environment carries this job's tag on this node (any session)."""
    sig = int(req.get("signal", signal.SIGTERM))
    hit = []
    for pid in _job_pids(req["tag"], req["node"]):
        try:
            os.kill(pid, sig)
            hit.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return {"pids": hit}


def _tag_table(node):
    """{tag: [pids]} of this node's processes carrying a UGRO_JOB tag (one /proc scan)."""
    table = {}
    for pid, job, where in ugro_tagged_procs():  # noqa: F821
        if job and where == node:
            table.setdefault(job, []).append(pid)
    return {job: sorted(pids) for job, pids in table.items()}


def op_tagged(req):
    """Every job tag with live processes on this node (for node name req['node']), with their pids."""
    return {"tags": _tag_table(req["node"])}


def _rank_status(item, tables, boot_now):
    exit_path = _expand(item["exit_file"])
    record = _expand(item.get("record") or exit_path + ".start")
    key = item.get("key")
    exit_info = _read_exit(exit_path)
    rec = _read_json(record)
    exists = rec is not None or os.path.exists(record)
    ours = rec is not None and (key is None or rec.get("key") == key)
    boot_then = rec.get("boot_id") if rec else None
    same_boot = ours and boot_then == boot_now
    wrapper_alive = bool(same_boot and _proc_alive(rec.get("wrapper_pid"), rec.get("wrapper_start")))
    torchrun_alive = bool(same_boot and _proc_alive(rec.get("pid"), rec.get("pid_start")))
    if exit_info is None and not wrapper_alive:
        exit_info = _read_exit(exit_path)  # the wrapper writes it just before it exits
    pids = []
    if item.get("tag"):
        node = item.get("node")
        if node not in tables:
            tables[node] = _tag_table(node)
        pids = tables[node].get(item["tag"], [])
    return {
        "key": key,
        "record": exists,
        "record_key": rec.get("key") if rec else None,
        "key_matches": ours,
        "state": rec.get("state") if ours else None,
        "error": rec.get("error") if ours else None,
        "pid": rec.get("pid") if ours else None,
        "wrapper_pid": rec.get("wrapper_pid") if ours else None,
        "exit": exit_info,
        "wrapper_alive": wrapper_alive,
        "torchrun_alive": torchrun_alive,
        "tagged_pids": pids,
        "boot_id_at_start": boot_then,
        "boot_id": boot_now,
        "rebooted": bool(ours and boot_then and boot_now and boot_then != boot_now),
    }


def op_rank_status(req):
    """What is true of each rank on this node: exit record, wrapper and torchrun alive, tagged pids, boot.

    A rank whose wrapper is dead with no exit record (or whose node rebooted) is lost. Liveness is
    read from the start record and counts only for a record of the item's key, from this boot, for a
    pid with the recorded start time.
    """
    boot_now = _boot_id()
    tables = {}
    return {"ranks": [_rank_status(item, tables, boot_now) for item in req["ranks"]]}


def op_exec(req):
    """Run a short command (no shell) and return its exit code and output, for checks."""
    argv = [str(a) for a in req["argv"]]
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
    try:
        argv[0] = _resolve_executable(argv[0], env)
    except AgentError as exc:
        return {"rc": 127, "stdout": "", "stderr": str(exc)}
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            cwd=_expand(req.get("cwd") or "~"),
            env=env,
            timeout=float(req.get("timeout", 30)),
        )
    except subprocess.TimeoutExpired:
        return {"rc": 124, "stdout": "", "stderr": "timed out"}
    except OSError as exc:
        return {"rc": 126, "stdout": "", "stderr": str(exc)}
    return {
        "rc": proc.returncode,
        "stdout": proc.stdout[-65536:].decode("utf-8", "replace"),
        "stderr": proc.stderr[-65536:].decode("utf-8", "replace"),
    }


def _env_fingerprint(python):
    """What changes when packages are installed into or removed from the env of this python: the mtimes of its
    site-packages directories (every install or removal adds or drops a *.dist-info directory there), the user
    site's, and the interpreter itself. None when no such directory is found: nothing is kept then."""
    try:
        interpreter = os.stat(os.path.realpath(python)).st_mtime_ns
    except OSError:
        return None
    root = os.path.dirname(os.path.dirname(os.path.abspath(python)))  # <env>/bin/python -> <env>
    own = [os.path.join(root, "lib", "python3*", "site-packages"),
           os.path.join(root, "lib", "python3*", "dist-packages"),
           os.path.join(root, "local", "lib", "python3*", "dist-packages")]
    user = [os.path.expanduser(os.path.join("~", ".local", "lib", "python3*", "site-packages"))]

    def marks(patterns):
        out = []
        for found in sorted(d for pattern in patterns for d in glob.glob(pattern)):
            try:
                out.append((found, os.stat(found).st_mtime_ns))
            except OSError:
                continue
        return out

    env = marks(own)
    return (python, interpreter, tuple(env + marks(user))) if env else None


_env_reports = {}  # (python, sha256 of the code) -> (fingerprint, answer)


def op_env_report(req):
    """op_exec of `python -c code` (the pre-flight's versions and installed packages), its answer kept in this
    agent while the env's packages stay as they were (_env_fingerprint): listing every distribution of a
    training env costs about 0.07 s of CPU, on every node at every launch."""
    python, code = str(req["python"]), str(req["code"])
    key = (python, hashlib.sha256(code.encode()).hexdigest())
    mark = _env_fingerprint(python)
    kept = _env_reports.get(key)
    if mark is not None and kept is not None and kept[0] == mark:
        return dict(kept[1], cached=True)
    answer = op_exec({"argv": [python, "-c", code], "timeout": req.get("timeout", 30)})
    if mark is not None and answer["rc"] == 0:
        _env_reports[key] = (mark, answer)
    return dict(answer, cached=False)


def op_free_port(req):
    """A TCP port free now on this node's address req['host'] (the kernel's pick), for a server about to
    start there (a service replica's engine); a port taken in between shows as a replica that never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((req.get("host") or "", 0))
        return {"port": sock.getsockname()[1]}


def op_interfaces(req):
    """For a node without iproute2 (`ip`): its IPv4 addresses by the name each is listed under ({name:
    ["10.0.0.2/24"]}: an interface, or an address's own label such as eth0:1, as `ip -o addr` and getifaddrs list
    them; read by the SIOCGIFCONF ioctl, each prefix by SIOCGIFNETMASK on that name: a second address without a
    label of its own is given its interface's first prefix), and the interface a packet to
    req['to'] leaves by: the name holding the source address the kernel picks for a UDP socket connected there
    (nothing is sent), with whether req['to'] is this node's own address, as `ip route get` says "local"."""
    import array
    import fcntl
    import struct

    addresses = {}
    record = 40 if struct.calcsize("P") == 8 else 32  # sizeof(struct ifreq)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        size = record * 64
        while True:  # the kernel fills at most `size` bytes: ask again with more room while it may have filled it
            buf = array.array("B", bytes(size))
            conf = struct.pack("iL", size, buf.buffer_info()[0])
            got = struct.unpack("iL", fcntl.ioctl(sock.fileno(), 0x8912, conf))[0]
            if got + record <= size or size >= record * 65536:
                break
            size *= 2
        raw = buf.tobytes()[:got]
        for i in range(0, got - record + 1, record):
            name = raw[i : i + 16].split(b"\0", 1)[0]
            addr = socket.inet_ntoa(raw[i + 20 : i + 24])
            try:
                packed = struct.pack("256s", name[:15])
                mask = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), 0x891B, packed)[20:24])
            except OSError:
                continue
            prefix = bin(struct.unpack("!I", socket.inet_aton(mask))[0]).count("1")
            addresses.setdefault(name.decode(errors="replace"), []).append("%s/%d" % (addr, prefix))
    to, source = req.get("to") or "", None
    if to:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect((to, 9))
                source = sock.getsockname()[0]
            except OSError:  # no route
                pass
    holder = {}  # each address -> the (first) interface that holds it
    for name, nets in addresses.items():
        for a in nets:
            holder.setdefault(a.split("/")[0], name)
    return {"addresses": addresses, "dev": holder.get(source), "local": to in holder or to.startswith("127.")}


def op_stat(req):
    """Which of the given paths exist (files or directories) on this node; with `programs`, where each would be
    found as `start` finds a command's first word (a path, or a name on PATH with `env` over this agent's):
    {"path": ...} or {"error": why not}."""
    out = {"exists": {p: os.path.exists(_expand(p)) for p in req.get("paths") or []}}
    if req.get("programs"):
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
        found = {}
        for name in req["programs"]:
            try:
                found[name] = {"path": _resolve_executable(str(name), env)}
            except AgentError as exc:
                found[name] = {"error": str(exc)}
        out["programs"] = found
    return out


def op_listdir(req):
    path = _expand(req["path"])
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return {"entries": []}
    entries = []
    for name in names:
        try:
            st = os.stat(os.path.join(path, name))
        except OSError:
            continue
        entries.append({"name": name, "size": st.st_size, "mtime": st.st_mtime})
    return {"entries": entries}


def _tree(path):
    """(total bytes, newest mtime, file count) of a directory tree; errors count as absent files."""
    total, newest, count = 0, 0.0, 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            total += st.st_size
            newest = max(newest, st.st_mtime)
            count += 1
    return total, newest, count


def op_checkpoints(req):
    """Checkpoint candidates: the entries of each directory in req['dirs'] and every path the globs in
    req['globs'] match (relative to req['cwd']). A directory comes with its tree's size and whether it
    holds trainer_state.json (a Hugging Face checkpoint is complete only then)."""
    cwd = _expand(req.get("cwd") or "~")
    paths = []
    for d in req.get("dirs") or []:
        d = _expand(d)
        try:
            paths += [os.path.join(d, n) for n in sorted(os.listdir(d))]
        except OSError:
            pass
    for pattern in req.get("globs") or []:
        paths += sorted(glob.glob(os.path.join(cwd, os.path.expanduser(pattern))))
    out, seen = [], set()
    for path in paths:
        if path in seen:
            continue
        seen.add(path)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if os.path.isdir(path):
            size, mtime, files = _tree(path)
            out.append(
                {
                    "path": path,
                    "dir": True,
                    "size": size,
                    "mtime": max(mtime, st.st_mtime),
                    "files": files,
                    "trainer_state": os.path.isfile(os.path.join(path, "trainer_state.json")),
                }
            )
        else:
            out.append({"path": path, "dir": False, "size": st.st_size, "mtime": st.st_mtime})
    return {"entries": out}


# Directories a discovery walk never enters: caches, environments, version control, and UGRO's own (hidden).
DISCOVER_SKIP = frozenset(("__pycache__", "node_modules", "site-packages", "venv", "env", "wandb", "mlruns"))
DISCOVER_SUFFIXES = (".ckpt", ".pt", ".pth", ".safetensors", ".bin")


def _discover_entry(path, name, st, is_dir):
    """A discovered file or directory as the controller reads it, or None for anything else."""
    if is_dir:
        if not (name.startswith("checkpoint-") and name[11:].isdigit()):
            return None
        size, mtime, files = _tree(path)
        return {
            "path": path, "kind": "checkpoint", "dir": True, "size": size, "mtime": max(mtime, st.st_mtime),
            "files": files, "trainer_state": os.path.isfile(os.path.join(path, "trainer_state.json")),
        }
    if name == "metrics.csv" or name.startswith("events.out.tfevents."):
        return {"path": path, "kind": "metrics", "dir": False, "size": st.st_size, "mtime": st.st_mtime}
    if name.endswith(DISCOVER_SUFFIXES):
        return {"path": path, "kind": "checkpoint", "dir": False, "size": st.st_size, "mtime": st.st_mtime}
    return None


def op_discover(req):
    """Metric files (metrics.csv, TensorBoard event files) and checkpoint candidates (checkpoint-N/
    directories, .ckpt/.pt/.pth/.safetensors/.bin files) under req['root'], changed at or after req['since']
    (seconds since the epoch, this node's clock). With req['record'] (the rank's start record) the time the
    rank started on this node counts instead: no clock difference between node and controller enters, so a
    file an earlier run wrote a moment before this one started is never taken for this run's.

    Bounded, so a working directory with a million files costs little: at most req['max_depth'] levels,
    req['max_entries'] directory entries and req['budget_s'] seconds; hidden directories and DISCOVER_SKIP
    are never entered, and a checkpoint-N/ directory is reported whole, not walked. The newest directory
    known is read next, at any depth (a directory's mtime moves when an entry is created in it), so what a
    run just created is reached before old trees. 'complete' is false when a bound stopped the walk."""
    root = _expand(req["root"])
    since = float(req.get("since") or 0)
    started = (_read_json(_expand(req["record"])) or {}).get("started") if req.get("record") else None
    if isinstance(started, (int, float)):
        since = float(started)
    max_depth = int(req.get("max_depth", 6))
    left = int(req.get("max_entries", 20000))
    deadline = time.monotonic() + float(req.get("budget_s", 0.5))
    found, complete = [], True
    heap = [(0.0, 0, root)]  # (-mtime, depth, path): the newest directory is read next, whatever its depth
    while heap:
        if left <= 0 or time.monotonic() > deadline:
            complete = False
            break
        _newest, depth, directory = heapq.heappop(heap)
        try:
            entries = os.scandir(directory)
        except OSError:
            continue
        for entry in entries:
            left -= 1
            if left < 0:  # a huge directory is not read to its end either
                complete = False
                break
            name = entry.name
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if is_dir and (name.startswith(".") or name in DISCOVER_SKIP):
                continue
            if st.st_mtime >= since:
                item = _discover_entry(entry.path, name, st, is_dir)
                if item is not None:
                    found.append(item)
                    continue
            if is_dir and not (name.startswith("checkpoint-") and name[11:].isdigit()):
                if depth < max_depth:
                    heapq.heappush(heap, (-st.st_mtime, depth + 1, entry.path))
                else:
                    complete = False
        entries.close()
    return {"entries": found, "complete": complete, "now": time.time()}


def op_files(req):
    """Every file under a path (the path itself when it is a file): relative name, size, sha256."""
    root = _expand(req["path"])
    if os.path.isfile(root):
        names = [""]
    elif os.path.isdir(root):
        names = []
        for base, _dirs, files in os.walk(root):
            names += [os.path.relpath(os.path.join(base, f), root) for f in files]
    else:
        raise AgentError("%s does not exist on this node" % req["path"])
    out = []
    for name in sorted(names):
        path = os.path.join(root, name) if name else root
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1024 * 1024), b""):
                digest.update(block)
        out.append({"name": name, "size": os.path.getsize(path), "sha256": digest.hexdigest()})
    return {"files": out}


CHECKPOINT_SUFFIXES = (".pt", ".pth", ".safetensors", ".bin", ".ckpt")


def _removable(path, workdir, own, globbed):
    """Whether retention may delete path: anything under the job's own directory <workdir>/outputs/<job>/ but
    the job's synced code, or under the workdir (hidden directories aside) a checkpoint-<N>/ directory, a
    checkpoint file by its suffix, or a path the job's own glob matches."""
    if path.startswith(own + os.sep):
        return path != os.path.join(own, "code")
    if not path.startswith(workdir + os.sep):
        return False
    if any(part.startswith(".") for part in os.path.relpath(path, workdir).split(os.sep)):
        return False
    name = os.path.basename(path)
    named = (name.startswith("checkpoint-") and name[11:].isdigit()) or name.endswith(CHECKPOINT_SUFFIXES)
    return named or path in globbed


def op_remove_checkpoints(req):
    """Delete checkpoints of job req['job'] that retention freed (req['paths']); only what _removable allows
    under req['workdir'] (with req['globs'], the job's checkpoint globs relative to it). One path it does not
    allow refuses the whole request in one line, nothing deleted. A path already gone is reported absent.
    Returns {"removed": {path: bytes}, "absent": [path]}."""
    workdir = os.path.normpath(_expand(req.get("workdir") or "~"))
    job = str(req.get("job") or "")
    if workdir == os.sep or not job or os.sep in job or job in (".", ".."):
        raise AgentError("refused: no job directory to delete in (workdir %r, job %r)" % (req.get("workdir"), job))
    own = os.path.join(workdir, "outputs", job)
    globbed = set()
    for pattern in req.get("globs") or []:
        globbed.update(os.path.normpath(p) for p in glob.glob(os.path.join(workdir, os.path.expanduser(pattern))))
    wanted = []
    for raw in req.get("paths") or []:
        path = os.path.normpath(_expand(str(raw)))
        if not _removable(path, workdir, own, globbed):
            raise AgentError("refused to delete %s: neither under %s/ nor a checkpoint in %s" % (raw, own, workdir))
        wanted.append((raw, path))
    removed, absent = {}, []
    for raw, path in wanted:
        if not os.path.lexists(path):
            absent.append(raw)
        elif os.path.isdir(path) and not os.path.islink(path):
            removed[raw] = _tree(path)[0]
            shutil.rmtree(path)
        else:
            removed[raw] = os.lstat(path).st_size
            os.unlink(path)
    return {"removed": removed, "absent": absent}


def op_dump_stacks(req):
    """A stack dump of every process of a job on this node: `py-spy dump` where it is installed, else
    SIGUSR1 (the reference script's faulthandler prints every thread's stack to its output)."""
    pyspy = shutil.which("py-spy")
    out = []
    for pid in _job_pids(req["tag"], req["node"]):
        if pyspy:
            try:
                proc = subprocess.run(
                    [pyspy, "dump", "--pid", str(pid)], stdin=subprocess.DEVNULL, capture_output=True, timeout=20
                )
                text = (proc.stdout + proc.stderr).decode("utf-8", "replace")[-65536:]
                out.append({"pid": pid, "how": "py-spy", "text": text})
                continue
            except (OSError, subprocess.TimeoutExpired) as exc:
                out.append({"pid": pid, "how": "py-spy", "text": "py-spy failed: %s" % exc})
        if _catches(pid, signal.SIGUSR1):
            try:
                os.kill(pid, signal.SIGUSR1)
                out.append({"pid": pid, "how": "SIGUSR1", "text": ""})
            except OSError as exc:
                out.append({"pid": pid, "how": "SIGUSR1", "text": str(exc)})
    return {"dumps": out, "py_spy": bool(pyspy)}


def _catches(pid, signum):
    """True if the process installed a handler for signum (SigCgt in /proc/<pid>/status): only then is
    it sent, since a process without one would be killed by it."""
    try:
        with open("/proc/%d/status" % pid) as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


OPS = {
    "checkpoints": op_checkpoints,
    "discover": op_discover,
    "files": op_files,
    "remove_checkpoints": op_remove_checkpoints,
    "dump_stacks": op_dump_stacks,
    "hello": op_hello,
    "start": op_start,
    "tail": op_tail,
    "procs": op_procs,
    "kill": op_kill,
    "tagged": op_tagged,
    "env_report": op_env_report,
    "rank_status": op_rank_status,
    "exec": op_exec,
    "free_port": op_free_port,
    "interfaces": op_interfaces,
    "stat": op_stat,
    "listdir": op_listdir,
}
# Other files sent before this one may add ops (e.g. the probe) through EXTRA_OPS.
OPS.update(globals().get("EXTRA_OPS", {}))


def serve(stdin, stdout):
    while True:
        line = stdin.readline()
        if not line:
            return
        if not line.endswith(b"\n"):
            return  # a request cut off by a broken link: the controller knows it was never delivered
        try:
            req = json.loads(line)
            rid = req.get("id")
        except ValueError:
            continue
        try:
            handler = OPS.get(req.get("op"))
            if handler is None:
                raise AgentError("unknown op %r" % req.get("op"))
            resp = {"id": rid, "ok": True, "result": handler(req)}
        except AgentError as exc:
            resp = {"id": rid, "ok": False, "error": str(exc)}
        except Exception as exc:  # the agent must survive any one bad request
            resp = {"id": rid, "ok": False, "error": "%s: %s" % (type(exc).__name__, exc)}
        stdout.write((json.dumps(resp) + "\n").encode())
        stdout.flush()


if __name__ == "__ugro_agent__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    serve(sys.stdin.buffer, sys.stdout.buffer)
