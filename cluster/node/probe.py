# UGRO node probe: health readings and network checks, added to the agent as extra ops.
# Sent before agent.py and exec'd together with it under the node's own python, so: stdlib only,
# Python >= 3.8 syntax, no __future__ imports, and every module-level helper name starts with
# _probe_ so it cannot collide with (or be replaced by) a name defined in agent.py.
# AgentError is defined later (in agent.py), so it is only ever looked up when an op runs.
import csv
import json
import os
import shutil
import socket
import struct
import subprocess
import threading
import time

PROBE_CMD_MAX = 200
PROBE_SMI_TIMEOUT_S = 10.0
PROBE_LISTEN_MAX_S = 600.0
PROBE_PEER_CLOSE_S = 1.0
PROBE_CPU_SAMPLE_S = 0.1
# Jiffies (all CPUs, USER_HZ 100) in about 0.1 s: fewer make a meaningless CPU percentage.
PROBE_CPU_MIN_JIFFIES = 10 * (os.cpu_count() or 1)
PROBE_SMI_FIELDS = "index,name,uuid,utilization.gpu,memory.used,memory.total,temperature.gpu,power.draw,driver_version"
PROBE_GPU_KEYS = (
    "index",
    "name",
    "uuid",
    "util_percent",
    "mem_used_mb",
    "mem_total_mb",
    "temp_c",
    "power_w",
    "driver",
    "energy_mj",
)
# CPU package energy (RAPL): readable by root only on most kernels since 5.10 (CVE-2020-8694); then not measured.
PROBE_RAPL_ROOT = "/sys/class/powercap"
PROBE_RAPL_ZONES_MAX = 16

# The agent is long-lived: CPU use is the delta since the previous probe's /proc/stat reading.
_probe_cpu_last = None
_probe_cpu_value = None
# NVML stays initialised between probes (nvmlInit is slow on GPUs without persistence mode).
_probe_nvml = None
# Listening sockets of the `listen` op, closed in forked children (see _probe_after_fork).
_probe_listeners = set()
_probe_listeners_lock = threading.Lock()


def _probe_fail(message):
    """Raise the agent's AgentError when running inside the agent, a plain Exception otherwise."""
    raise globals().get("AgentError", Exception)(message)


def _probe_expand(path):
    return os.path.abspath(os.path.expanduser(path or "~"))


# -- system ---------------------------------------------------------------------------------


def _probe_cpu_times():
    """(busy, total) jiffies from the aggregate line of /proc/stat; guest time is inside user."""
    with open("/proc/stat") as fh:
        fields = fh.readline().split()
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    total = sum(values)
    return total - idle, total


def _probe_cpu_percent():
    """Busy % since the previous probe; a short sample on the first, the last value if too recent."""
    global _probe_cpu_last, _probe_cpu_value
    try:
        now = _probe_cpu_times()
        last = _probe_cpu_last
        if last is not None and now[1] - last[1] < PROBE_CPU_MIN_JIFFIES and _probe_cpu_value is not None:
            # Probes moments apart: too few ticks to measure; keep the baseline and last value.
            return _probe_cpu_value
        if last is None or now[1] - last[1] < PROBE_CPU_MIN_JIFFIES:
            last = now
            time.sleep(PROBE_CPU_SAMPLE_S)
            now = _probe_cpu_times()
        _probe_cpu_last = now
        total = now[1] - last[1]
        if total <= 0:
            return None
        _probe_cpu_value = round(100.0 * (now[0] - last[0]) / total, 1)
        return _probe_cpu_value
    except (OSError, ValueError, IndexError):
        return None


def _probe_meminfo():
    """(ram_percent, ram_total_mb) from /proc/meminfo; MemAvailable, or its estimate on old kernels."""
    info = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    info[key] = int(parts[0])  # kB
    except (OSError, ValueError):
        return None, None
    total = info.get("MemTotal")
    if not total:
        return None, None
    avail = info.get("MemAvailable")
    if avail is None:
        avail = info.get("MemFree", 0) + info.get("Buffers", 0) + info.get("Cached", 0)
    return round(100.0 * (total - avail) / total, 1), round(total / 1024.0, 1)


def _probe_disk(workdir):
    """(disk_percent, disk_free_gb) like df: used / (used + available to non-root), GiB free."""
    path = _probe_expand(workdir)
    # A workdir not created yet still lives on the filesystem of its nearest existing parent.
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return None, None
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    avail = st.f_bavail * st.f_frsize
    if used + avail <= 0:
        return None, None
    return round(100.0 * used / (used + avail), 1), round(avail / float(1 << 30), 2)


def _probe_uptime():
    try:
        with open("/proc/uptime") as fh:
            return round(float(fh.read().split()[0]), 1)
    except (OSError, ValueError, IndexError):
        return None


def _probe_load():
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


# -- GPUs -----------------------------------------------------------------------------------


def _probe_smi_value(raw, kind):
    """One nvidia-smi CSV cell; bracketed values ([N/A], [Not Supported], ...) become None."""
    raw = raw.strip()
    if not raw or raw.startswith("[") or raw in ("N/A", "Unknown"):
        return None
    if kind == "str":
        return raw
    try:
        number = float(raw)
    except ValueError:
        return None
    return int(number) if kind == "int" else round(number, 2)


def parse_nvidia_smi_csv(text):
    """GPU dicts from `nvidia-smi --query-gpu=<PROBE_SMI_FIELDS> --format=csv,noheader,nounits`."""
    kinds = ("int", "str", "str", "int", "int", "int", "int", "float", "str")
    gpus = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if not row or not "".join(row).strip():
            continue
        if len(row) == len(kinds) - 1:  # the fields before driver_version was asked for
            row = row + [""]
        if len(row) != len(kinds):
            raise ValueError("unexpected nvidia-smi line: %r" % ", ".join(row))
        gpu = dict.fromkeys(PROBE_GPU_KEYS)  # nvidia-smi has no energy counter: energy_mj stays None
        for key, kind, raw in zip(PROBE_GPU_KEYS, kinds, row):
            gpu[key] = _probe_smi_value(raw, kind)
        gpus.append(gpu)
    return gpus


def _probe_nvml_call(fn, *args):
    """One NVML reading; a field this GPU does not support reads as None."""
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported and friends: only this field is unknown
        return None


def _probe_text(value):
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _probe_read_nvml():
    global _probe_nvml
    if _probe_nvml is None:
        try:
            import pynvml
        except ImportError as exc:
            raise RuntimeError("pynvml is not importable (%s)" % exc)
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            raise RuntimeError("NVML did not initialise (%s)" % (exc or type(exc).__name__))
        _probe_nvml = pynvml
    nv = _probe_nvml
    try:
        gpus = []
        driver = _probe_text(_probe_nvml_call(nv.nvmlSystemGetDriverVersion))
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            util = _probe_nvml_call(nv.nvmlDeviceGetUtilizationRates, h)
            mem = _probe_nvml_call(nv.nvmlDeviceGetMemoryInfo, h)
            temp = _probe_nvml_call(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            power = _probe_nvml_call(nv.nvmlDeviceGetPowerUsage, h)  # milliwatts
            # millijoules since the driver loaded (Volta and later); None where the GPU has no counter
            energy = _probe_nvml_call(nv.nvmlDeviceGetTotalEnergyConsumption, h)
            gpus.append(
                {
                    "index": i,
                    "name": _probe_text(_probe_nvml_call(nv.nvmlDeviceGetName, h)),
                    "uuid": _probe_text(_probe_nvml_call(nv.nvmlDeviceGetUUID, h)),
                    "util_percent": util.gpu if util is not None else None,
                    "mem_used_mb": mem.used // (1 << 20) if mem is not None else None,
                    "mem_total_mb": mem.total // (1 << 20) if mem is not None else None,
                    "temp_c": temp,
                    "power_w": round(power / 1000.0, 2) if power is not None else None,
                    "driver": driver,
                    "energy_mj": energy,
                }
            )
        return gpus
    except Exception as exc:
        # A GPU that fell off the bus can break the whole session: start afresh next probe.
        _probe_nvml = None
        try:
            nv.nvmlShutdown()
        except Exception:  # already broken; the error below says what happened
            pass
        raise RuntimeError("NVML failed (%s)" % (exc or type(exc).__name__))


def _probe_read_smi():
    exe = shutil.which("nvidia-smi")
    if not exe:
        raise RuntimeError("nvidia-smi was not found on PATH")
    argv = [exe, "--query-gpu=" + PROBE_SMI_FIELDS, "--format=csv,noheader,nounits"]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError("nvidia-smi did not answer in %g s" % PROBE_SMI_TIMEOUT_S)
    except OSError as exc:
        raise RuntimeError("nvidia-smi could not run (%s)" % exc)
    out = proc.stdout.decode("utf-8", "replace")
    if proc.returncode != 0:
        detail = (proc.stderr.decode("utf-8", "replace") + out).strip().splitlines()
        raise RuntimeError("nvidia-smi exited %d: %s" % (proc.returncode, detail[-1] if detail else "no output"))
    return parse_nvidia_smi_csv(out)


def _probe_read_fixture(path):
    """GPU dicts from a JSON list in a file on the node: the injectable reader for tests."""
    try:
        with open(_probe_expand(path)) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise RuntimeError("cannot read GPU fixture %s (%s)" % (path, exc))
    if not isinstance(data, list) or not all(isinstance(g, dict) for g in data):
        raise RuntimeError("GPU fixture %s is not a JSON list of objects" % path)
    return [dict((k, g.get(k)) for k in PROBE_GPU_KEYS) for g in data]


def _probe_gpus(reader):
    """(gpus, gpu_source, gpu_error): gpu_source names the reader whose answer is in gpus."""
    reader = reader or "auto"
    if reader.startswith("fixture:"):
        attempts = [("fixture", lambda: _probe_read_fixture(reader[len("fixture:") :]))]
    elif reader == "auto":
        attempts = [("nvml", _probe_read_nvml), ("nvidia-smi", _probe_read_smi)]
    elif reader == "nvml":
        attempts = [("nvml", _probe_read_nvml)]
    elif reader == "nvidia-smi":
        attempts = [("nvidia-smi", _probe_read_smi)]
    else:
        _probe_fail("unknown gpu_reader %r (auto, nvml, nvidia-smi or fixture:<path>)" % reader)
    errors = []
    for source, read in attempts:
        try:
            return read(), source, None
        except RuntimeError as exc:
            errors.append(str(exc))
    return [], "none", "; ".join(errors)


# -- CPU package energy ---------------------------------------------------------------------


def _probe_read_int(path):
    with open(path) as fh:
        return int(fh.read().strip())


def _probe_rapl(root=PROBE_RAPL_ROOT):
    """(zones, error): each RAPL package zone's energy counter [{zone, energy_uj, max_uj}] (it wraps at max_uj),
    or None and why not (no RAPL, or its counters readable by root only)."""
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith("intel-rapl:") and n.count(":") == 1)
    except OSError as exc:
        return None, "no %s (%s)" % (root, exc.strerror or exc)
    if not names:
        return None, "no RAPL zones in %s" % root
    zones = []
    for name in names[:PROBE_RAPL_ZONES_MAX]:
        base = os.path.join(root, name)
        try:
            energy = _probe_read_int(os.path.join(base, "energy_uj"))
            top = _probe_read_int(os.path.join(base, "max_energy_range_uj"))
        except PermissionError:
            return None, "%s is readable by root only" % os.path.join(base, "energy_uj")
        except (OSError, ValueError) as exc:
            return None, "cannot read %s (%s)" % (base, exc)
        try:
            with open(os.path.join(base, "name")) as fh:
                label = fh.read().strip()[:40] or name
        except OSError:
            label = name
        zones.append({"zone": "%s/%s" % (name, label), "energy_uj": energy, "max_uj": top})
    return zones, None


# -- processes ------------------------------------------------------------------------------


def ugro_tagged_procs():
    """(pid, job, node) of this user's processes whose environment carries a UGRO_JOB tag.

    Shared with agent.py (sent after this file). Only processes owned by this user are read: UGRO
    starts every rank as the SSH user, and reading other users' environments is most of the cost.
    """
    me, uid = os.getpid(), os.getuid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat("/proc/" + name).st_uid != uid:
                continue
            with open("/proc/%s/environ" % name, "rb") as fh:
                env = fh.read()
        except OSError:
            continue
        if b"UGRO_JOB=" not in env:
            continue
        job = node = None
        for item in env.split(b"\0"):
            if item.startswith(b"UGRO_JOB="):
                job = item[len(b"UGRO_JOB=") :].decode("utf-8", "replace")
            elif item.startswith(b"UGRO_NODE="):
                node = item[len(b"UGRO_NODE=") :].decode("utf-8", "replace")
        yield int(name), job, node


def _probe_job_procs():
    """Processes of UGRO jobs on this node, with their command lines."""
    procs = []
    for pid, job, node in ugro_tagged_procs():
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as fh:
                cmd = fh.read(4096).rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            cmd = ""
        procs.append({"pid": pid, "job": job, "node": node, "cmd": cmd[:PROBE_CMD_MAX]})
    procs.sort(key=lambda p: p["pid"])
    return procs


# -- the working directory's id -------------------------------------------------------------

# Nodes that share a working directory (an NFS home) share one store and one copy of a job's code: they find
# the same random id in it, written once by whichever node came first. An id, not a path or an address: two
# nodes may name one directory differently, and one path may be a different directory on each node.
PROBE_WORKDIR_MARK = os.path.join(".ugro", "workdir-id")
PROBE_WORKDIR_WAIT_S = 1.0


def _probe_make_mark(mark):
    """Write a new id at mark, exclusively (of two nodes at once, one wins, the other reads its id): a hard link
    of a whole file (atomic and exclusive on NFS too), else O_CREAT|O_EXCL where links cannot be made."""
    new = "%s\n" % os.urandom(16).hex()
    tmp = "%s.%s.%d.%s" % (mark, socket.gethostname(), os.getpid(), os.urandom(4).hex())
    with open(tmp, "w") as fh:
        fh.write(new)
    try:
        os.link(tmp, mark)
    except FileExistsError:
        pass
    except OSError:
        try:
            fd = os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as fh:
            fh.write(new)
    finally:
        os.unlink(tmp)


def ugro_workdir_id(workdir):
    """The id of this working directory (32 hex digits), written there on first use; None when the directory
    does not exist or the id cannot be written or read. Shared with codesync.py (sent after this file)."""
    root = _probe_expand(workdir)
    if not os.path.isdir(root):
        return None
    mark = os.path.join(root, PROBE_WORKDIR_MARK)
    deadline = time.monotonic() + PROBE_WORKDIR_WAIT_S
    while True:
        try:
            with open(mark) as fh:
                text = fh.read().strip()
        except FileNotFoundError:
            if time.monotonic() > deadline:
                return None
            try:
                os.makedirs(os.path.dirname(mark), exist_ok=True)
                _probe_make_mark(mark)
            except OSError:
                return None
            continue
        except OSError:
            return None
        if len(text) == 32 and all(c in "0123456789abcdef" for c in text):
            return text
        if text or time.monotonic() > deadline:  # not an id, or an O_EXCL file left empty
            return None
        time.sleep(0.02)  # created by another node's O_EXCL a moment ago: its id is being written


def op_workdir_id(req):
    return {"workdir_id": ugro_workdir_id(req.get("workdir") or "~")}


# -- ops ------------------------------------------------------------------------------------


def op_probe(req):
    """Everything the controller's health check needs, in one request."""
    gpus, source, error = _probe_gpus(req.get("gpu_reader"))
    rapl, rapl_error = _probe_rapl()
    ram_percent, ram_total_mb = _probe_meminfo()
    disk_percent, disk_free_gb = _probe_disk(req.get("workdir") or "~")
    return {
        "time": time.time(),
        "hostname": socket.gethostname(),
        "uptime_s": _probe_uptime(),
        "load": _probe_load(),
        "cpu_percent": _probe_cpu_percent(),
        "ram_percent": ram_percent,
        "ram_total_mb": ram_total_mb,
        "disk_percent": disk_percent,
        "disk_free_gb": disk_free_gb,
        "gpus": gpus,
        "gpu_source": source,
        "gpu_error": error,
        "rapl": rapl,
        "rapl_error": rapl_error,
        "job_procs": _probe_job_procs(),
        "workdir_id": ugro_workdir_id(req.get("workdir") or "~"),
    }


def op_port_check(req):
    """A real TCP connect from this node to host:port."""
    timeout = float(req.get("timeout", 3))
    t0 = time.monotonic()
    try:
        conn = socket.create_connection((str(req["host"]), int(req["port"])), timeout=timeout)
    except socket.timeout:
        error = "timed out after %g s" % timeout
    except OSError as exc:
        error = exc.strerror or str(exc) or type(exc).__name__
    else:
        conn.close()
        error = None
    ms = round((time.monotonic() - t0) * 1000.0, 2)
    return {"ok": error is None, "error": error, "ms": ms}


def op_port_free(req):
    """Whether a server could bind the port now (SO_REUSEADDR, as torchrun's store does)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((str(req.get("address") or "0.0.0.0"), int(req["port"])))
    except OSError as exc:
        return {"free": False, "error": exc.strerror or str(exc)}
    finally:
        sock.close()
    return {"free": True, "error": None}


def _probe_close_listener(sock):
    with _probe_listeners_lock:
        _probe_listeners.discard(sock)
    try:
        sock.close()
    except OSError:
        pass


def _probe_after_fork():
    # A forked child (op_start's rank wrapper lives for the whole job) must not keep the
    # rendezvous port bound after the listen op closes it, or torchrun could not bind it.
    for sock in list(_probe_listeners):
        try:
            sock.close()
        except OSError:
            pass
    _probe_listeners.clear()


def _probe_close_after_peer(conn):
    """Let the peer close first, so no TIME_WAIT stays on the port torchrun binds next."""
    try:
        conn.settimeout(PROBE_PEER_CLOSE_S)
        while conn.recv(4096):
            pass
    except OSError:
        # A peer that lingers gets an abortive close (RST) instead; closing it first ourselves
        # would leave TIME_WAIT on the port, and an instant RST races the peer's connect().
        try:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    finally:
        conn.close()


def _probe_accept_loop(sock, deadline, expect):
    accepted = 0
    try:
        while expect <= 0 or accepted < expect:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(min(left, 0.25))
            try:
                conn, _ = sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            accepted += 1
            _probe_close_after_peer(conn)
    finally:
        _probe_close_listener(sock)


def op_listen(req):
    """Listen on address:port for up to `seconds` (or until `expect` connections), then close.

    Pre-flight uses it to prove workers can reach the rendezvous port before torchrun owns it.
    Binding happens here, so a port in use fails the request; accepting runs in the background.
    """
    address = str(req.get("address") or "0.0.0.0")
    seconds = min(float(req.get("seconds", 10)), PROBE_LISTEN_MAX_S)
    expect = int(req.get("expect") or 0)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, int(req["port"])))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        _probe_fail("cannot listen on %s:%s: %s" % (address, req["port"], exc.strerror or exc))
    with _probe_listeners_lock:
        _probe_listeners.add(sock)
    port = sock.getsockname()[1]
    thread = threading.Thread(
        target=_probe_accept_loop,
        args=(sock, time.monotonic() + seconds, expect),
        name="ugro-listen-%d" % port,
        daemon=True,
    )
    thread.start()
    return {"listening": True, "port": port}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_probe_after_fork)

EXTRA_OPS = {
    "probe": op_probe,
    "port_check": op_port_check,
    "port_free": op_port_free,
    "listen": op_listen,
    "workdir_id": op_workdir_id,
}
