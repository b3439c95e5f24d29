# UGRO node transfer: the one path by which bytes reach a node's store (<workdir>/.ugro/objects/<sha256>) -- a
# dataset's files, model weights, checkpoint copies, the code's objects. Sent after codesync.py and before
# agent.py, exec'd together: stdlib only, Python >= 3.8, module-level names start with _xfer_ (AgentError,
# ugro_workdir_id and _SyncCopy are the other files').
#
# Objects travel in chunks (each checked against its sha256 as it completes) along a chain: the controller, or a
# node that holds them, sends to the first node's listener; each node writes what it lacks into its store and
# passes every byte on to the next node as it reads it, so each byte leaves its source once however many nodes
# take it, and the nodes' links carry it in a pipeline. An object being received is a part file
# (<store>/.xfer/<sha256>) whose verified length is kept beside it (<sha256>.ok): a transfer cut off (a node
# dropped, the controller restarted) resumes from the chunks already held. An object enters the store whole
# (moved there once every chunk checked) or not at all.
#
# A listener takes one connection that begins with its token (random, given to the controller over the node's
# own SSH link, per transfer); it binds every address of the node, since the node before it in the chain is
# another machine. What travels between nodes is not encrypted (a home LAN); each chunk is checked on arrival.
import fcntl
import hashlib
import hmac
import json
import os
import socket
import threading
import time

_XFER_ACCEPT_S = 120.0  # how long a listener waits for its connection
_XFER_STEP_S = 300.0  # a stream's every read or write
_XFER_TOKEN_S = 10.0
_XFER_PIECE = 1 << 20
_XFER_HEX = frozenset("0123456789abcdef")
_XFER_EMPTY = hashlib.sha256(b"").hexdigest()
_xfer_tasks = {}  # id -> {"done": bool, "result": ...}: sends and stagings that run on a thread of this agent
_xfer_lock = threading.Lock()


class _XferRefused(Exception):
    """A stream that is not what UGRO sends, or a chunk whose bytes are not its sha256."""


def _xfer_sha(sha):
    if not isinstance(sha, str) or len(sha) != 64 or not _XFER_HEX.issuperset(sha):
        raise AgentError("not a sha256: %r" % (sha,))  # noqa: F821 (agent.py's)
    return sha


def _xfer_root(store):
    root = os.path.abspath(os.path.expanduser(store))
    os.makedirs(os.path.join(root, ".xfer"), exist_ok=True)
    return root


def _xfer_part(root, sha):
    return os.path.join(root, ".xfer", sha)


def _xfer_held(root, sha, size, chunk):
    """The bytes of an object this store holds verified: its size when whole, else the part's checked length
    (a whole number of chunks), 0 when there is nothing."""
    obj = os.path.join(root, sha)
    try:
        if os.stat(obj).st_size == size:
            return size
    except OSError:
        pass
    if size == 0:  # nothing to send: made here when it is what it says
        if sha != _XFER_EMPTY:
            return -1
        with open(obj, "wb"):
            pass
        os.chmod(obj, 0o444)
        return 0
    part = _xfer_part(root, sha)
    try:
        with open(part + ".ok") as fh:
            ok = int(fh.read().strip() or 0)
        have = os.stat(part).st_size
    except (OSError, ValueError):
        return 0
    held = min(ok, have, size)
    return held if held == size else held - held % chunk


def _xfer_free(root):
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def op_xfer_have(req):
    """For each object [sha256, size]: the bytes held (its size: whole); the free space where the store is; and
    the id of the node's working directory (nodes that share one share the store)."""
    root = _xfer_root(req["store"])
    chunk = int(req.get("chunk") or 8 << 20)
    held = [_xfer_held(root, _xfer_sha(sha), int(size), chunk) for sha, size in req.get("objects") or []]
    answer = {"held": held, "free": _xfer_free(root)}
    if req.get("workdir"):
        answer["workdir_id"] = ugro_workdir_id(req["workdir"])  # noqa: F821 (probe.py's)
    return answer


class _XferObject:
    """One object of a stream, as this node takes it: the bytes past what it holds are written to its part and
    each chunk checked as it completes; whole, it is moved into the store."""

    def __init__(self, root, spec, chunk):
        self.root, self.chunk = root, chunk
        self.sha, self.size, self.offset = _xfer_sha(spec["sha"]), int(spec["size"]), int(spec.get("offset") or 0)
        self.sums = spec.get("chunks") or []
        if self.size > chunk and len(self.sums) != -(-self.size // chunk):
            raise _XferRefused("object %s: %d chunk sums for %d bytes" % (self.sha[:12], len(self.sums), self.size))
        self.error = None
        self.fd = None
        self.held = _xfer_held(root, self.sha, self.size, chunk)
        if self.held == self.size:
            return
        if self.held < self.offset:  # the stream starts past what is here: a gap (retaken next round)
            self.error = "its stream starts at byte %d, %d held here" % (self.offset, self.held)
            return
        part = _xfer_part(root, self.sha)
        self.fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            self.fd, self.error = None, "another transfer is writing it here"
            return
        os.ftruncate(self.fd, self.held)
        self.okfd = os.open(part + ".ok", os.O_RDWR | os.O_CREAT, 0o644)
        self.hash = hashlib.sha256()
        self.whole = hashlib.sha256() if self.held == 0 else None

    def take(self, pos, data):
        """Bytes data at pos of the object (the stream's order): what is past the held bytes is written."""
        if self.fd is None:
            return
        end = pos + len(data)
        if end <= self.held:
            return
        if pos < self.held:
            data, pos = data[self.held - pos :], self.held
        view = memoryview(data)
        while view:
            boundary = (pos // self.chunk + 1) * self.chunk
            piece = view[: boundary - pos]
            self.hash.update(piece)
            if self.whole is not None:
                self.whole.update(piece)
            os.pwrite(self.fd, piece, pos)
            pos += len(piece)
            view = view[len(piece) :]
            if pos == boundary or pos == self.size:
                self._checked(pos)
                if self.fd is None:
                    return
        self.held = pos

    def _checked(self, pos):
        index = (pos - 1) // self.chunk
        if self.sums:
            ok = self.hash.hexdigest() == self.sums[index]
        else:  # one chunk: the object's own sha256
            ok = self.hash.hexdigest() == self.sha
        self.hash = hashlib.sha256()
        if not ok:
            self.error = "chunk %d of object %s arrived corrupted" % (index, self.sha[:12])
            self.close(truncate=index * self.chunk)
            return
        os.ftruncate(self.okfd, 0)
        os.pwrite(self.okfd, b"%d" % pos, 0)
        self.held = pos
        if pos == self.size:
            if self.whole is not None and self.whole.hexdigest() != self.sha:
                self.error = "object %s arrived with another sha256" % self.sha[:12]
                self.close(truncate=0)
                return
            os.fchmod(self.fd, 0o444)
            part = _xfer_part(self.root, self.sha)
            os.replace(part, os.path.join(self.root, self.sha))
            self.close()
            try:
                os.unlink(part + ".ok")
            except OSError:
                pass

    def close(self, truncate=None):
        if self.fd is None:
            return
        if truncate is not None:
            os.ftruncate(self.fd, truncate)
            os.ftruncate(self.okfd, 0)
            os.pwrite(self.okfd, b"%d" % truncate, 0)
        os.close(self.fd)
        os.close(self.okfd)
        self.fd = None

    def result(self):
        if self.error:
            return self.error
        if self.held != self.size:
            return "object %s cut off at byte %d of %d" % (self.sha[:12], self.held, self.size)
        return None


def _xfer_sendall(sock, data):
    """sendall without SIGPIPE (the agent keeps SIGPIPE's default, which would end it when a peer is gone): EPIPE
    is an OSError here."""
    view = memoryview(data)
    while view:
        view = view[sock.send(view, socket.MSG_NOSIGNAL) :]


def _xfer_connect(hop):
    """A connection to the next node's listener, its token and stream header sent."""
    sock = socket.create_connection((hop["host"], int(hop["port"])), timeout=_XFER_TOKEN_S)
    sock.settimeout(_XFER_STEP_S)
    return sock


def _xfer_header(objects, chunk, rest):
    head = {"objects": objects, "chunk": chunk, "rest": rest[1:]}
    data = json.dumps(head).encode()
    return rest[0]["token"].encode() + b"\n" + b"%d\n" % len(data) + data


class _XferDownstream:
    """The rest of the chain after this node: every byte is passed on as it is read; a next node that cannot be
    reached or goes away is reported for it and the ones after it, and this node's own receipt goes on."""

    def __init__(self, objects, chunk, rest, source):
        self.rest, self.sock, self.failed = rest, None, None
        if not rest:
            return
        try:
            self.sock = _xfer_connect(rest[0])
            _xfer_sendall(self.sock, _xfer_header(objects, chunk, rest))
        except OSError as exc:
            self._fail("%s cannot reach %s:%s: %s" % (source, rest[0]["host"], rest[0]["port"], exc))

    def _fail(self, why):
        self.failed = why
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def send(self, data):
        if self.sock is None:
            return
        try:
            _xfer_sendall(self.sock, data)
        except OSError as exc:
            self._fail("the stream to %s broke: %s" % (self.rest[0]["name"], exc))

    def results(self):
        """Each later node's result: {name: None (ok) or why}."""
        if not self.rest:
            return {}
        answer = None
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_WR)
                buf = b""
                while not buf.endswith(b"\n"):
                    got = self.sock.recv(65536)
                    if not got:
                        break
                    buf += got
                answer = json.loads(buf.decode() or "null")
            except (OSError, ValueError) as exc:
                self._fail("no answer from %s: %s" % (self.rest[0]["name"], exc))
            finally:
                if self.sock is not None:
                    self.sock.close()
        if not isinstance(answer, dict):
            why = self.failed or "no answer from %s" % self.rest[0]["name"]
            return {hop["name"]: why for hop in self.rest}
        return {hop["name"]: answer.get(hop["name"], "no answer") for hop in self.rest}


def _xfer_read(stream, size, what):
    data = stream.read(size)
    if len(data) != size:
        raise _XferRefused("the stream ended %s" % what)
    return data


def _xfer_receive(root, name, stream):
    """Take one stream (after its token): header, then each object's bytes from its offset; this node's result
    and each later node's, {name: None or why}."""
    line = stream.readline(20)
    if not line.strip().isdigit():
        raise _XferRefused("a stream without its header")
    head = json.loads(_xfer_read(stream, int(line), "inside its header"))
    chunk, specs, rest = int(head["chunk"]), head["objects"], head.get("rest") or []
    down = _XferDownstream(specs, chunk, rest, name)
    errors = []
    try:
        for spec in specs:
            obj = _XferObject(root, spec, chunk)
            pos = obj.offset
            try:
                while pos < obj.size:
                    data = stream.read(min(_XFER_PIECE, obj.size - pos))
                    if not data:
                        raise _XferRefused("the stream ended inside object %s at byte %d" % (obj.sha[:12], pos))
                    down.send(data)
                    obj.take(pos, data)
                    pos += len(data)
            finally:
                obj.close()
            why = obj.result()
            if why:
                errors.append(why)
    except (_XferRefused, OSError, ValueError) as exc:
        errors.insert(0, str(exc))
    results = down.results()
    results[name] = "; ".join(errors[:3]) or None
    return results


def op_xfer_listen(req):
    """Take one stream for this node's store on a port of every address of this node, in a thread of this agent;
    the answer (the port and the token the stream must begin with) goes to the controller only."""
    root = _xfer_root(req["store"])
    token = os.urandom(24).hex().encode() + b"\n"
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        srv.bind((req.get("bind") or "0.0.0.0", 0))
        srv.listen(8)
    except OSError:
        srv.close()
        raise
    name = str(req.get("name") or "node")
    threading.Thread(target=_xfer_serve, args=(srv, token, root, name), name="ugro-xfer", daemon=True).start()
    return {"port": srv.getsockname()[1], "token": token.strip().decode()}


def _xfer_serve(srv, token, root, name):
    deadline = time.monotonic() + _XFER_ACCEPT_S
    conn = stream = None
    try:
        while conn is None:
            srv.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.settimeout(_XFER_TOKEN_S)
            stream = conn.makefile("rb")
            try:
                given = stream.read(len(token))
            except OSError:
                given = b""
            if not hmac.compare_digest(given, token):
                stream.close()
                conn.close()
                conn = None
    finally:
        srv.close()
    conn.settimeout(_XFER_STEP_S)
    try:
        try:
            results = _xfer_receive(root, name, stream)
        except Exception as exc:  # the thread answers whatever happened
            results = {name: "%s: %s" % (type(exc).__name__, exc)}
        _xfer_sendall(conn, json.dumps(results).encode() + b"\n")
        conn.shutdown(socket.SHUT_WR)
        while stream.read(1 << 20):
            pass
    except OSError:
        pass
    finally:
        stream.close()
        conn.close()


def _xfer_task(fn, *args):
    tid = os.urandom(8).hex()
    _xfer_tasks[tid] = {"done": False, "result": None}

    def run():
        try:
            result = {"ok": True, "value": fn(*args)}
        except Exception as exc:
            result = {"ok": False, "error": "%s" % exc if isinstance(exc, AgentError) else  # noqa: F821
                      "%s: %s" % (type(exc).__name__, exc)}  # fmt: skip
        _xfer_tasks[tid].update(done=True, result=result)

    threading.Thread(target=run, name="ugro-xfer-task", daemon=True).start()
    return {"task": tid}


def op_xfer_task(req):
    """A send or a staging this agent runs: {"done": False} meanwhile, then its result once (forgotten after)."""
    task = _xfer_tasks.get(str(req.get("task")))
    if task is None:
        raise AgentError("no transfer task %s here (the agent was restarted?)" % req.get("task"))  # noqa: F821
    if not task["done"]:
        return {"done": False}
    del _xfer_tasks[str(req["task"])]
    if not task["result"]["ok"]:
        raise AgentError(task["result"]["error"])  # noqa: F821
    return {"done": True, "result": task["result"]["value"]}


def _xfer_send(root, specs, chunk, rest, name):
    """This node as the chain's source: each object's bytes from its offset, read from the store."""
    down = _XferDownstream(specs, chunk, rest, name)
    for spec in specs:
        if down.sock is None:
            break
        sha, size, pos = _xfer_sha(spec["sha"]), int(spec["size"]), int(spec.get("offset") or 0)
        with open(os.path.join(root, sha), "rb") as fh:
            fh.seek(pos)
            while pos < size and down.sock is not None:
                data = fh.read(min(_XFER_PIECE, size - pos))
                if not data:
                    raise AgentError("object %s in this store is shorter than %d" % (sha[:12], size))  # noqa: F821
                down.send(data)
                pos += len(data)
    return down.results()


def op_xfer_send(req):
    """Send objects this store holds whole along a chain of listeners (req['rest']: name, host, port, token of
    each), on a thread; op_xfer_task says when it is done and each node's result."""
    root = _xfer_root(req["store"])
    return _xfer_task(_xfer_send, root, req["objects"], int(req["chunk"]), req["rest"], str(req.get("name") or ""))


def _xfer_hash(path, chunk):
    whole, sums, size = hashlib.sha256(), [], 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                break
            size += len(block)
            whole.update(block)
            sums.append(hashlib.sha256(block).hexdigest())
    return whole.hexdigest(), size, (sums if size > chunk else [])


def _xfer_keep(full, obj, sha):
    """A file of this node kept in its store as object sha: a hard link when no one may write the file (its bytes
    cannot change under the store's name), else a copy (in the kernel; a reflink where the filesystem has them),
    checked again against sha (a file written meanwhile is refused)."""
    import shutil

    tmp = "%s.stage-%s-%d" % (os.path.join(os.path.dirname(obj), ".xfer", sha), socket.gethostname(), os.getpid())
    try:
        if os.stat(full).st_mode & 0o222:
            raise OSError("writable: copied")
        os.link(full, tmp)
    except OSError:
        shutil.copyfile(full, tmp)
        if _xfer_hash(tmp, 8 << 20)[0] != sha:
            os.unlink(tmp)
            raise AgentError("%s changed while it was read" % full)  # noqa: F821
        os.chmod(tmp, 0o444)
    os.replace(tmp, obj)


def _xfer_stage(root, path, chunk, limit):
    """A file or directory of this node taken into its store (hard links, a copy across filesystems): its
    manifest, each file with its sha256 and chunk sums."""
    src = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(src):
        names = [""]
    elif os.path.isdir(src):
        names = []
        for base, dirs, files in os.walk(src):
            dirs.sort()
            names += [os.path.relpath(os.path.join(base, f), src) for f in sorted(files)]
    else:
        raise AgentError("%s does not exist on this node" % path)  # noqa: F821
    out, total = [], 0
    for name in names:
        full = os.path.join(src, name) if name else src
        if os.path.islink(full):
            continue
        total += os.path.getsize(full)
        if limit and total > limit:
            raise AgentError("%s holds more than %d bytes" % (path, limit))  # noqa: F821
        sha, size, sums = _xfer_hash(full, chunk)
        obj = os.path.join(root, sha)
        if not os.path.exists(obj):
            _xfer_keep(full, obj, sha)
        mode = os.stat(full).st_mode & 0o777
        out.append({"path": name, "sha256": sha, "size": size, "mode": mode, "chunks": sums})
    return {"files": out, "links": [], "file": names == [""]}


def op_xfer_stage(req):
    """Take a path of this node into its store, on a thread (hashing tens of GB takes minutes); op_xfer_task
    gives the manifest."""
    root = _xfer_root(req["store"])
    return _xfer_task(_xfer_stage, root, req["path"], int(req["chunk"]), int(req.get("limit") or 0))


def op_xfer_place(req):
    """Put a manifest's files at req['dest'] from the store: a file (one entry of path '') linked there, or a
    directory built beside and moved into place whole (codesync.py _SyncCopy); one already there as the
    manifest says is kept. Each file is a hard link to the store's object (read-only)."""
    store, dest = req["store"], os.path.abspath(os.path.expanduser(req["dest"]))
    files = req["files"]
    if req.get("copy"):
        return _xfer_place_copies(_xfer_root(store), dest, files)
    if len(files) == 1 and files[0]["path"] == "":
        f = files[0]
        obj = os.path.join(_xfer_root(store), _xfer_sha(f["sha256"]))
        _sync_touch(obj)  # noqa: F821 (codesync.py's)
        try:
            if os.path.samefile(obj, dest):
                return {"files": 1, "kept": True}
        except OSError:
            pass
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = "%s.ugro-part-%s-%d" % (dest, socket.gethostname(), os.getpid())
        try:
            os.link(obj, tmp)
        except FileNotFoundError:
            raise AgentError("%s: object %s is not in the store" % (dest, f["sha256"][:12]))  # noqa: F821
        os.replace(tmp, dest)
        return {"files": 1, "kept": False}
    if _sync_built(store, dest, files, []):  # noqa: F821 (codesync.py's)
        for f in files:
            _sync_touch(_sync_object(store, f["sha256"]))  # noqa: F821
        return {"files": len(files), "kept": True}
    copy = _SyncCopy(store, dest, files)  # noqa: F821
    try:
        copy.finish([])
    except BaseException:
        copy.abandon()
        raise
    return {"files": copy.files, "kept": False}


def _xfer_place_copies(root, dest, files):
    """The files at dest as writable copies of the store's objects (a checkpoint a resumed job may write over in
    place: a hard link would let it change the store's object), made beside and moved into place whole; a dest
    that holds the same bytes already is kept."""
    import shutil

    single = len(files) == 1 and files[0]["path"] == ""

    def same(path, f):
        try:
            return os.path.getsize(path) == int(f["size"]) and _xfer_hash(path, 8 << 20)[0] == f["sha256"]
        except OSError:
            return False

    if all(same(dest if single else os.path.join(dest, f["path"]), f) for f in files):
        return {"files": len(files), "kept": True}
    part = "%s.ugro-part-%s-%d" % (dest, socket.gethostname(), os.getpid())
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        for f in files:
            obj = os.path.join(root, _xfer_sha(f["sha256"]))
            target = part if single else os.path.join(part, _sync_rel(f["path"]))  # noqa: F821 (codesync.py's)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            try:
                shutil.copyfile(obj, target)
            except FileNotFoundError:
                raise AgentError("%s: object %s is not in the store" % (f["path"] or dest, f["sha256"][:12]))  # noqa: F821
            os.chmod(target, 0o644)
        if os.path.isdir(dest) and not single:
            old = part + ".old"
            os.rename(dest, old)
            os.rename(part, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(part, dest)
    except BaseException:
        if os.path.isdir(part):
            shutil.rmtree(part, ignore_errors=True)
        elif os.path.lexists(part):
            os.unlink(part)
        raise
    return {"files": len(files), "kept": False}


EXTRA_OPS = dict(globals().get("EXTRA_OPS") or {})
EXTRA_OPS.update({"xfer_have": op_xfer_have, "xfer_listen": op_xfer_listen, "xfer_send": op_xfer_send,
                  "xfer_task": op_xfer_task, "xfer_stage": op_xfer_stage, "xfer_place": op_xfer_place})  # fmt: skip
