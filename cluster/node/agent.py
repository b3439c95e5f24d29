# UGRO node agent. Its source travels over the SSH link and runs under the node's own python;
# nothing is installed on the node. Stdlib only, Python >= 3.8 (no __future__ imports: this file is
# concatenated after others and exec'd). It speaks JSON lines: one request in, one response out.
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

AGENT_VERSION = 1
MAX_TAIL_BYTES = 4 * 1024 * 1024
MAX_TAIL_WAIT_MS = 5000
TAIL_POLL_S = 0.01


class AgentError(Exception):
    """A request that cannot be carried out; its message goes back to the controller verbatim."""


def _expand(path):
    return os.path.abspath(os.path.expanduser(path)) if path else path


def _write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


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
    }


def op_start(req):
    """Start argv detached (own session, survives the link) with output appended to req['log']."""
    argv = [str(a) for a in req["argv"]]
    cwd = _expand(req.get("cwd") or "~")
    log_path = _expand(req["log"])
    exit_path = _expand(req["exit_file"])
    if not os.path.isdir(cwd):
        raise AgentError("working directory %s does not exist on this node" % cwd)
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
    argv[0] = _resolve_executable(argv[0], env)
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    if os.path.exists(exit_path):
        os.unlink(exit_path)
    rfd, wfd = os.pipe()
    child = os.fork()
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
                os.write(wfd, json.dumps({"error": "could not start %s: %s" % (argv[0], exc)}).encode())
                os._exit(1)
            os.write(wfd, json.dumps({"pid": proc.pid, "started": time.time()}).encode())
            os.close(wfd)
            os.close(logfd)
            rc = proc.wait()
            _write_atomic(exit_path, json.dumps({"rc": rc, "ended": time.time()}))
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
        raise AgentError("the rank wrapper died before starting %s" % argv[0])
    return result


def _read_exit(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


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

    wait_ms (optional, at most MAX_TAIL_WAIT_MS): a long poll. If no log has grown and no rank has
    exited, wait up to that long (checking every TAIL_POLL_S) before answering, so a follower
    hears of a new line within milliseconds without asking over and over.
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
        out.append({
            "key": item.get("key"),
            "size": size,
            "data": base64.b64encode(data).decode("ascii"),
            "eof": size is None or offset + len(data) >= size,
            "exit": exit_info,
        })
    return {"files": out}


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
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              cwd=_expand(req.get("cwd") or "~"), env=env,
                              timeout=float(req.get("timeout", 30)))
    except subprocess.TimeoutExpired:
        return {"rc": 124, "stdout": "", "stderr": "timed out"}
    except OSError as exc:
        return {"rc": 126, "stdout": "", "stderr": str(exc)}
    return {"rc": proc.returncode,
            "stdout": proc.stdout[-65536:].decode("utf-8", "replace"),
            "stderr": proc.stderr[-65536:].decode("utf-8", "replace")}


def op_stat(req):
    """Which of the given paths exist (files or directories) on this node."""
    return {"exists": {p: os.path.exists(_expand(p)) for p in req["paths"]}}


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


OPS = {
    "hello": op_hello,
    "start": op_start,
    "tail": op_tail,
    "procs": op_procs,
    "kill": op_kill,
    "exec": op_exec,
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
