# UGRO node environments (docs/envs.md): a job's Python environment, built on this node from a lock file with
# uv, in <workdir>/.ugro/envs/<key> (key: the lock's sha256, the Python version and the platform; the controller
# computes it). Sent after transfer.py and before agent.py, exec'd together: stdlib only, Python >= 3.8,
# module-level names start with _env_ (AgentError, _xfer_* and _sync_* are the other files').
#
# The wheels and uv itself come through the node's store (transfer.py: objects by sha256); nothing is fetched
# from the network here (uv runs with --no-index, offline, never downloading a Python). An environment is built
# aside (<key>.part-<host>-<pid>) and moved into place whole once its record (.ugro-env.json) is written in it:
# a build cut off midway leaves a part, never an environment; the part is removed by the next build of the key.
#
# uv's own cache lives beside the store (<workdir>/.ugro/uv-cache): each wheel is unpacked there once per node and
# every environment's files are hard links to it. uv knows a local wheel by its path and its ctime, so each wheel
# is read from one fixed link per sha256 (<workdir>/.ugro/uv-wheels/<sha256>/<file>, made once, never touched
# after). Builds hold <workdir>/.ugro/uv-cache.lock shared; the trim (op_env_cache_trim) takes it alone, so it never
# removes the cache under a build.
import fcntl
import gzip
import json
import os
import shutil
import socket
import stat as _env_stat
import subprocess
import sysconfig
import time
import urllib.request
import zipfile

_ENV_RECORD = ".ugro-env.json"  # in a whole environment: what it was built from (written last, before the move)
_ENV_USED = ".ugro-env-used"  # its mtime: the last launch that used it
_ENV_BUILD_S = 3600.0
_ENV_CACHE = "uv-cache"  # beside envs/ and the store: uv's cache (UV_CACHE_DIR)
_ENV_WHEELS = "uv-wheels"  # <sha256>/<wheel's file name>: the one path uv knows each wheel by
_ENV_CACHE_LOCK = "uv-cache.lock"


def _env_root(workdir):
    return os.path.join(os.path.abspath(os.path.expanduser(workdir)), ".ugro", "envs")


def _env_ugro(workdir):
    return os.path.dirname(_env_root(workdir))


def _env_cache_lock(workdir, shared, wait=True):
    """The uv cache's lock: shared by builds, alone by the trim; its fd, or None when not had (wait=False)."""
    ugro = _env_ugro(workdir)
    os.makedirs(ugro, exist_ok=True)
    fd = os.open(os.path.join(ugro, _ENV_CACHE_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        return None
    return fd


def _env_wheel_link(ugro, obj, sha, name):
    """The wheel's fixed path (<ugro>/uv-wheels/<sha256>/<name>), linked to the store's object once: uv's cache
    knows a local wheel by its path and ctime, and a new link would change the ctime and unpack it again."""
    folder = os.path.join(ugro, _ENV_WHEELS, sha)
    path = os.path.join(folder, name)
    if os.path.isfile(path):
        return path
    if not os.path.isfile(obj):
        raise AgentError("%s (object %s) is not in the store" % (name, sha[:12]))  # noqa: F821
    os.makedirs(folder, exist_ok=True)
    tmp = "%s.part-%s-%d" % (path, socket.gethostname(), os.getpid())
    try:
        os.link(obj, tmp)
    except OSError:
        shutil.copyfile(obj, tmp)
    if os.path.isfile(path):  # another build linked it meanwhile: keep that one (its ctime is what uv knows)
        os.unlink(tmp)
    else:
        os.replace(tmp, path)
    return path


def _env_key(key):
    if not isinstance(key, str) or len(key) != 64 or not _XFER_HEX.issuperset(key):  # noqa: F821 (transfer.py's)
        raise AgentError("not an environment key: %r" % (key,))  # noqa: F821 (agent.py's)
    return key


def _env_platform():
    """The wheel platform tags this node takes, most specific first (manylinux_2_X from its glibc)."""
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    if plat.startswith("linux_"):
        arch = plat[len("linux_") :]
        try:
            libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
        except (ValueError, OSError):
            libc = ""
        if libc.startswith("glibc "):
            major, minor = (int(x) for x in libc.split()[1].split(".")[:2])
            # every manylinux tag this glibc runs, newest first (pip takes only the tags it is given)
            tags = ["manylinux_%d_%d_%s" % (major, m, arch) for m in range(minor, 4, -1)]
            legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
            tags += ["%s_%s" % (legacy[m], arch) for m in (17, 12, 5) if m <= minor]
            return tags + [plat]
    return [plat]


def _env_installed(env):
    """{normalized name: version} of the distributions in an environment's site-packages."""
    out = {}
    for site in _env_sites(env):
        for entry in os.listdir(site):
            if not entry.endswith(".dist-info"):
                continue
            name, version = _env_meta(os.path.join(site, entry, "METADATA"))
            if name:
                out[_env_norm(name)] = version
    return out


def _env_sites(env):
    lib = os.path.join(env, "lib")
    try:
        pys = sorted(d for d in os.listdir(lib) if d.startswith("python"))
    except OSError:
        return []
    return [p for p in (os.path.join(lib, d, "site-packages") for d in pys) if os.path.isdir(p)]


def _env_meta(path):
    name = version = ""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    break
                if line.startswith("Name:"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("Version:"):
                    version = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name, version


def _env_norm(name):
    return "".join("-" if c in "_." else c for c in name.lower())


def _env_state(env):
    """An environment as the controller records it: its packages [name, version, sha256 of the wheel it came
    from ('' when none of the wheels it was built from has that name and version)], its python, its size."""
    with open(os.path.join(env, _ENV_RECORD)) as fh:
        record = json.load(fh)
    wheels = {(w["name"], w["version"]): w["sha256"] for w in record.get("wheels") or []}
    installed = _env_installed(env)
    return {"packages": sorted([n, v, wheels.get((n, v), "")] for n, v in installed.items()),
            "python": os.path.join(env, "bin", "python"), "built": record.get("built")}  # fmt: skip


def _env_whole(env):
    return os.path.isfile(os.path.join(env, _ENV_RECORD))


def op_env_info(req):
    """This node's Python (the interpreter named, else the agent's) and platform tags, its working directory's
    id, and for each key asked whether its environment is here whole (then its packages, marked used now)."""
    python = str(req.get("python") or "")
    if python:
        found = shutil.which(os.path.expanduser(python))
        if not found:
            raise AgentError("no python %s on this node" % python)  # noqa: F821
        out = subprocess.run([found, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, timeout=30)  # fmt: skip
        if out.returncode != 0:
            raise AgentError("%s does not run: %s" % (python, out.stderr.decode(errors="replace")[-200:]))  # noqa: F821
        version = out.stdout.decode().strip()
    else:
        import sys

        found, version = sys.executable, "%d.%d" % sys.version_info[:2]
    root = _env_root(req["workdir"])
    os.makedirs(root, exist_ok=True)  # (and the working directory: its id is written there)
    envs = {}
    for key in req.get("keys") or []:
        env = os.path.join(root, _env_key(key))
        if _env_whole(env):
            _sync_touch(os.path.join(env, _ENV_USED))  # noqa: F821 (codesync.py's)
            if not os.path.exists(os.path.join(env, _ENV_USED)):
                open(os.path.join(env, _ENV_USED), "w").close()
            envs[key] = _env_state(env)
    return {"python": found, "version": version, "platforms": _env_platform(), "envs": envs,
            "workdir_id": ugro_workdir_id(req["workdir"])}  # fmt: skip  # noqa: F821 (probe.py's)


def _env_uv(root, store, uv):
    """The uv binary from the store: the object itself (an executable, gzipped or not), or taken out of uv's
    wheel (a node whose platform is not the controller's), kept at <envs>/.uv/<sha256>/uv."""
    sha = _xfer_sha(uv["sha256"])  # noqa: F821
    dest = os.path.join(root, ".uv", sha, "uv")
    if os.path.isfile(dest):
        return dest
    obj = os.path.join(os.path.abspath(os.path.expanduser(store)), sha)
    if not os.path.isfile(obj):
        raise AgentError("uv (object %s) is not in the store" % sha[:12])  # noqa: F821
    tmp = "%s.part-%s-%d" % (dest, socket.gethostname(), os.getpid())
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if uv.get("wheel"):
        with zipfile.ZipFile(obj) as zf:
            names = [n for n in zf.namelist() if n.endswith(".data/scripts/uv")]
            if not names:
                raise AgentError("uv's wheel %s holds no uv binary" % uv.get("name"))  # noqa: F821
            with zf.open(names[0]) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out)
    elif uv.get("gzip"):  # the controller's binary, gzipped for the trip
        with gzip.open(obj, "rb") as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    else:
        shutil.copyfile(obj, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)
    return dest


def _env_clear_parts(root, key):
    """Parts of this key left by builds that are not running (a build cut off midway)."""
    host = socket.gethostname()
    for entry in os.listdir(root):
        if not entry.startswith(key + ".part-"):
            continue
        owner, _, pid = entry[len(key) + 6 :].rpartition("-")
        if owner == host and pid.isdigit():
            try:
                os.kill(int(pid), 0)
                continue  # a build of this host still running
            except ProcessLookupError:
                pass
            except OSError:
                continue
        elif time.time() - os.stat(os.path.join(root, entry)).st_mtime < _ENV_BUILD_S:
            continue  # another host's (a shared workdir), maybe still building
        shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def _env_run(argv, env, what):
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, env=env, timeout=_ENV_BUILD_S)
    except subprocess.TimeoutExpired:
        raise AgentError("%s took over %d s" % (what, _ENV_BUILD_S)) from None  # noqa: F821
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
        for mark in ("╰─▶", "×", "error:"):
            lines = [ln.replace(mark, "").strip() for ln in lines]
        # uv's error as one line: what failed and why (its 'Because PACKAGE ...' names the package)
        text = " ".join(ln for ln in lines if ln) or "exit %d" % proc.returncode
        raise AgentError("%s failed: %s" % (what, text[:500]))  # noqa: F821


def _env_build(req):
    root = _env_root(req["workdir"])
    key = _env_key(req["key"])
    env_dir = os.path.join(root, key)
    if _env_whole(env_dir):
        return dict(_env_state(env_dir), kept=True)
    os.makedirs(root, exist_ok=True)
    _env_clear_parts(root, key)
    store = req["store"]
    uv = _env_uv(root, store, req["uv"])
    part = "%s.part-%s-%d" % (env_dir, socket.gethostname(), os.getpid())
    t0 = time.time()
    lock = _env_cache_lock(req["workdir"], shared=True)  # the trim does not remove uv's cache under a build
    try:
        os.makedirs(part)
        wheels = os.path.join(part, ".wheels")
        os.makedirs(wheels)
        obj_root = os.path.abspath(os.path.expanduser(store))
        ugro = _env_ugro(req["workdir"])
        lines = []
        for w in req["wheels"]:
            name = os.path.basename(str(w["file"]))
            if not name.endswith(".whl") or name.startswith("."):
                raise AgentError("not a wheel's name: %r" % name)  # noqa: F821
            sha = _xfer_sha(w["sha256"])  # noqa: F821
            # (the object is not touched: its ctime is the fixed link's; linked there, no store trim takes it)
            path = _env_wheel_link(ugro, os.path.join(obj_root, sha), sha, name)
            os.utime(os.path.dirname(path))  # the wheel's last use (the trim's order); its file keeps its ctime
            lines.append("%s @ file://%s\n" % (w["name"], urllib.request.pathname2url(path)))
        reqs = os.path.join(wheels, "requirements.txt")
        with open(reqs, "w") as fh:
            fh.write("".join(lines))
        # uv's own cache beside the store: each wheel unpacked once per node, and every environment's files hard
        # links to it (uv's default on Linux), so a second environment with the same torch costs links, not
        # another GB written
        env = dict(os.environ, UV_CACHE_DIR=os.path.join(ugro, _ENV_CACHE), UV_OFFLINE="1",
                   UV_PYTHON_DOWNLOADS="never", UV_NO_CONFIG="1", NO_COLOR="1")  # fmt: skip
        env.pop("VIRTUAL_ENV", None)
        venv = os.path.join(part, "env")
        _env_run([uv, "venv", "--quiet", "--relocatable", "--python", req["python"], venv], env,
                 "creating the environment")  # fmt: skip
        _env_run([uv, "pip", "install", "--quiet", "--python", os.path.join(venv, "bin", "python"), "--no-index",
                  "-r", reqs],
                 env, "installing the packages")  # fmt: skip
        record = {"key": key, "built": time.time(), "seconds": round(time.time() - t0, 3),
                  "wheels": [{"name": _env_norm(w["name"]), "version": w["version"], "sha256": w["sha256"]}
                             for w in req["wheels"]]}  # fmt: skip
        with open(os.path.join(venv, _ENV_RECORD), "w") as fh:
            json.dump(record, fh)
        open(os.path.join(venv, _ENV_USED), "w").close()
        try:
            os.rename(venv, env_dir)
        except OSError:
            if not _env_whole(env_dir):  # not another build's, moved there first
                raise
    finally:
        shutil.rmtree(part, ignore_errors=True)
        os.close(lock)
    return dict(_env_state(env_dir), kept=False, seconds=round(time.time() - t0, 3))


def op_env_build(req):
    """Build the environment req['key'] from the store's wheels (req['wheels']: file, name, version, sha256) and
    uv (req['uv']), on a thread (op_xfer_task says when it is done): its packages, or the build's one line."""
    return _xfer_task(_env_build, req)  # noqa: F821 (transfer.py's)


def _env_size(path):
    total = 0
    for base, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(base, f)).st_blocks * 512
            except OSError:
                pass
    return total


def op_env_list(req):
    """The environments here: key, size, last use, whole or a part (a build running or cut off)."""
    root = _env_root(req["workdir"])
    out = []
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        entries = []
    for entry in entries:
        path = os.path.join(root, entry)
        if entry.startswith(".") or not os.path.isdir(path):
            continue
        whole = _env_whole(path)
        try:
            used = os.stat(os.path.join(path, _ENV_USED)).st_mtime
        except OSError:
            used = os.stat(path).st_mtime
        item = {"key": entry, "whole": whole, "bytes": _env_size(path), "used": used}
        if whole:
            with open(os.path.join(path, _ENV_RECORD)) as fh:
                item["packages"] = len(json.load(fh).get("wheels") or [])
        out.append(item)
    return {"envs": out, "root": root}


def op_env_remove(req):
    """Remove the environments named (whole ones not used since req['before'], when given): what was removed."""
    root = _env_root(req["workdir"])
    before = req.get("before")
    removed = []
    for key in req.get("keys") or []:
        path = os.path.join(root, _env_key(key))
        if not _env_whole(path):
            continue
        try:
            used = os.stat(os.path.join(path, _ENV_USED)).st_mtime
        except OSError:
            used = 0
        if before is not None and used >= float(before):
            continue
        gone = "%s.gone-%s-%d" % (path, socket.gethostname(), os.getpid())
        os.rename(path, gone)  # out of use at once, whole; deleted after
        shutil.rmtree(gone, ignore_errors=True)
        removed.append(key)
    return {"removed": removed}


def _env_cache_held(ugro):
    """The bytes uv's cache alone keeps: its files no environment links (one link: the cache's), and the wheels
    it links from the store (each keeps its store object from the store's trim)."""
    total, seen = 0, set()
    for sub, alone in ((_ENV_CACHE, True), (_ENV_WHEELS, False)):
        for base, _dirs, files in os.walk(os.path.join(ugro, sub)):
            for name in files:
                try:
                    st = os.lstat(os.path.join(base, name))
                except OSError:
                    continue
                if st.st_ino in seen or not _env_stat.S_ISREG(st.st_mode) or (alone and st.st_nlink > 1):
                    continue
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


def _env_uv_here(ugro):
    """The newest uv binary the builds here were given (<envs>/.uv/<sha256>/uv), or None."""
    base = os.path.join(ugro, "envs", ".uv")
    found = []
    try:
        for sha in os.listdir(base):
            path = os.path.join(base, sha, "uv")
            if os.path.isfile(path) and os.access(path, os.X_OK):
                found.append((os.stat(path).st_mtime, path))
    except OSError:
        pass
    return max(found)[1] if found else None


def op_env_cache_trim(req):
    """Bring uv's cache beside the store (uv-cache, and the wheels' fixed links, uv-wheels) under req['limit']
    bytes of what it alone keeps: `uv cache prune` first (entries no longer reachable), then, still over, the whole
    cache moved aside and deleted (the environments keep their files: hard links; the next build unpacks again).
    Only when no build runs here: else {"busy": True}, nothing done."""
    ugro = _env_ugro(req["workdir"])
    limit = int(req["limit"])
    if limit <= 0:
        raise AgentError("refused: a uv cache limit of %d bytes" % limit)  # noqa: F821
    if not any(os.path.isdir(os.path.join(ugro, d)) for d in (_ENV_CACHE, _ENV_WHEELS)):
        return {"busy": False, "before": 0, "after": 0, "limit": limit, "pruned": False, "removed": False}
    fd = _env_cache_lock(req["workdir"], shared=False, wait=False)
    if fd is None:
        return {"busy": True}
    gone = []
    try:
        before = after = _env_cache_held(ugro)
        done = {"busy": False, "before": before, "limit": limit, "pruned": False, "removed": False}
        uv = _env_uv_here(ugro) if before > limit else None
        if uv and os.path.isdir(os.path.join(ugro, _ENV_CACHE)):
            env = dict(os.environ, UV_CACHE_DIR=os.path.join(ugro, _ENV_CACHE), UV_OFFLINE="1", UV_NO_CONFIG="1",
                       NO_COLOR="1")  # fmt: skip
            try:
                proc = subprocess.run([uv, "cache", "prune", "--quiet"], stdin=subprocess.DEVNULL,
                                      capture_output=True, env=env, timeout=600)  # fmt: skip
                done["pruned"] = proc.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                pass
            after = _env_cache_held(ugro)
        if after > limit:
            for sub in (_ENV_CACHE, _ENV_WHEELS):
                path = os.path.join(ugro, sub)
                if os.path.isdir(path):
                    aside = "%s.gone-%s-%d" % (path, socket.gethostname(), os.getpid())
                    os.rename(path, aside)  # out of use at once, whole; deleted after the lock is let go
                    gone.append(aside)
            done["removed"] = True
            after = 0
        done["after"] = after
    finally:
        os.close(fd)
    for aside in gone:
        shutil.rmtree(aside, ignore_errors=True)
    return done


EXTRA_OPS = dict(globals().get("EXTRA_OPS") or {})
EXTRA_OPS.update({"env_info": op_env_info, "env_build": op_env_build, "env_list": op_env_list,
                  "env_remove": op_env_remove, "env_cache_trim": op_env_cache_trim})  # fmt: skip
