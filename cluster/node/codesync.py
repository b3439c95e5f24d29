# UGRO node code sync: a content-addressed store of the files a job's directory holds, and the job's own
# copy made from it. Sent after probe.py and before agent.py, exec'd together: stdlib only, Python >= 3.8,
# no __future__ imports, module-level names start with _sync_ (AgentError is agent.py's, looked up at run).
#
# The store (<workdir>/.ugro/objects/<sha256>) keeps every file once, read-only, whatever directory or job
# it came from: a file unchanged since the node's last copy is never sent again. Flat: 256 <sha256[:2]>
# directories would cost a cold copy 256 more inodes (a 2,000-file tree: an eighth more). An object is
# written to an unnamed file in the store (O_TMPFILE) and linked in under its name once its bytes are checked:
# in the store whole or not at all, and nothing left behind by a receiver that fails or is killed (a named
# part file, renamed, where the filesystem has no unnamed files: NFS). A job's copy is built beside its place
# from hard links into the store (a copy where links cannot be made), and moved into place only once whole,
# so a rank never starts in a partial tree.
import hashlib
import os
import sys

if __name__ != "__ugro_sync_receive__":  # for the agent's ops; the receiver would spend 12 ms importing them
    import base64
    import json
    import shutil
    import time


_SYNC_HEX = frozenset("0123456789abcdef")


def _sync_sha(sha):
    if not isinstance(sha, str) or len(sha) != 64 or not _SYNC_HEX.issuperset(sha):
        raise AgentError("not a sha256: %r" % (sha,))
    return sha


def _sync_makedirs(path, made):
    """os.makedirs once per directory of one request (a tree of thousands of files has few directories)."""
    if path not in made:
        os.makedirs(path, exist_ok=True)
        made.add(path)


def _sync_write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _sync_object(store, sha):
    return os.path.join(os.path.expanduser(store), _sync_sha(sha))


def _sync_flatten(store):
    """Move a store of the earlier layout (<sha256[:2]>/<sha256>) to this one, once ('.flat' says done)."""
    root = os.path.expanduser(store)
    marker = os.path.join(root, ".flat")
    if os.path.exists(marker):
        return
    os.makedirs(root, exist_ok=True)
    for entry in os.scandir(root):
        if len(entry.name) == 2 and _SYNC_HEX.issuperset(entry.name) and entry.is_dir(follow_symlinks=False):
            for obj in os.scandir(entry.path):
                if len(obj.name) == 64 and _SYNC_HEX.issuperset(obj.name) and obj.is_file(follow_symlinks=False):
                    try:
                        os.replace(obj.path, os.path.join(root, obj.name))
                    except FileNotFoundError:  # another agent moved it first
                        pass
            shutil.rmtree(entry.path, ignore_errors=True)
    with open(marker, "w"):
        pass


def _sync_manifest_path(store, digest):
    return os.path.join(os.path.expanduser(store), "manifests", _sync_sha(digest) + ".json")


# a named part file, where unnamed files cannot be made: .part-<host>-<pid>-<sha256> (a store on a shared
# filesystem may be written from several nodes: only this host's processes are known here)
_SYNC_PART = ".part-"


def _sync_part_name(sha):
    return "%s%s-%d-%s" % (_SYNC_PART, os.uname().nodename, os.getpid(), sha)


class _SyncWriter:
    """Writes objects into a store: each to a new file, then kept under its name or dropped (see the top)."""

    def __init__(self, store):
        root = os.path.expanduser(store)
        os.makedirs(root, exist_ok=True)
        self.dirfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # an unnamed file is named through /proc: linkat(AT_FDCWD, "/proc/self/fd/N", ..., AT_SYMLINK_FOLLOW)
        self.unnamed = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")

    def new(self, sha):
        """(fd, part name or None) of a new read-only file for object sha."""
        if self.unnamed:
            try:
                return os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o444, dir_fd=self.dirfd), None
            except OSError:  # EOPNOTSUPP (NFS), EISDIR (a kernel before 3.11): named part files from here on
                self.unnamed = False
        part = _sync_part_name(sha)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        return os.open(part, flags, 0o444, dir_fd=self.dirfd), part

    def keep(self, fd, part, sha, size):
        """Name a written, checked file as object sha; an object already there whole is left as it is."""
        if part is not None:
            os.replace(part, sha, src_dir_fd=self.dirfd, dst_dir_fd=self.dirfd)
            return
        src = "/proc/self/fd/%d" % fd
        try:
            os.link(src, sha, dst_dir_fd=self.dirfd)  # with a dir fd: linkat, following the /proc link
        except FileExistsError:
            if os.stat(sha, dir_fd=self.dirfd).st_size == size:
                return  # another stream kept it first
            part = _sync_part_name(sha)  # a bad one (cut short): replaced
            os.link(src, part, dst_dir_fd=self.dirfd)
            os.replace(part, sha, src_dir_fd=self.dirfd, dst_dir_fd=self.dirfd)

    def drop(self, part):
        if part is not None:
            try:
                os.unlink(part, dir_fd=self.dirfd)
            except OSError:
                pass

    def put(self, sha, data):
        """Keep one object given whole (checked by the caller)."""
        fd, part = self.new(sha)
        try:
            _sync_write_all(fd, data)
            self.keep(fd, part, sha, len(data))
            part = None
        finally:
            os.close(fd)
            self.drop(part)

    def close(self):
        os.close(self.dirfd)


def _sync_sweep(store):
    """Remove what receivers killed meanwhile left: named part files of this host's processes gone, and the
    staging directories of the earlier code's receivers (an hour old: none of those still writes)."""
    root = os.path.expanduser(store)
    old = time.time() - 3600
    mine = "%s%s-" % (_SYNC_PART, os.uname().nodename)
    for entry in os.scandir(root):
        name = entry.name
        if name.startswith(mine):
            try:
                os.kill(int(name[len(mine) :].split("-", 1)[0]), 0)
                continue  # its receiver still runs
            except ProcessLookupError:
                pass
            except (ValueError, OSError):
                continue
            try:
                os.unlink(entry.path)
            except OSError:
                pass
        elif name.startswith(".stage-") and entry.is_dir(follow_symlinks=False):
            if entry.stat(follow_symlinks=False).st_mtime < old:
                shutil.rmtree(entry.path, ignore_errors=True)


def _sync_have_object(store, sha, size):
    try:
        return os.stat(_sync_object(store, sha)).st_size == size
    except OSError:
        return False


def _sync_rel(path):
    """A manifest path, checked: relative, no '..', no empty or hidden-control parts."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\0" in path:
        raise AgentError("bad path in manifest: %r" % (path,))
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise AgentError("bad path in manifest: %r" % (path,))
    return path


_sync_pending = {}  # digest -> a manifest sync_have was given, for the sync_apply that follows on this link


def op_sync_have(req):
    """Which of the manifest's objects the store lacks. With only a digest: whether the node has that
    manifest and every object it names ("known"), so an unchanged tree costs one small request."""
    store = req["store"]
    digest = req.get("digest")
    manifest = req.get("manifest")
    _sync_flatten(store)
    if manifest is None and digest:
        try:
            with open(_sync_manifest_path(store, digest)) as fh:
                manifest = json.load(fh)
        except (OSError, ValueError):
            return {"known": False, "missing": None}
    if req.get("manifest") is not None:  # objects will be sent: clear what killed receivers left first
        _sync_sweep(store)
    missing, seen = [], set()
    for f in manifest["files"]:
        sha = f["sha256"]
        if sha not in seen:
            seen.add(sha)
            if not _sync_have_object(store, sha, int(f["size"])):
                missing.append(sha)
    if digest and req.get("manifest") is not None:
        _sync_pending.clear()
        _sync_pending[digest] = manifest
    return {"known": not missing, "missing": missing}


def _sync_save_manifest(store, digest, manifest):
    path = _sync_manifest_path(store, digest)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as fh:  # dumps, then one write: json.dump writes each of its many pieces on its own
        fh.write(json.dumps({"files": manifest["files"], "links": manifest.get("links") or []}))
    os.replace(tmp, path)


class _SyncRefused(Exception):
    """A stream of objects that is not what UGRO sends, or an object whose bytes are not its name."""


def _sync_read(stream, size, what):
    data = stream.read(size)
    if len(data) != size:
        raise _SyncRefused("the stream ended %s" % what)
    return data


_SYNC_END = bytes(512)  # a tar's end: a block of zeros (two, and more may follow)
_SYNC_OCTAL = frozenset(b"01234567")


def _sync_octal(field):
    """Octal digits only (int() would take a sign, '0o' or '_')."""
    digits = field.strip(b" \0")
    if not digits or not _SYNC_OCTAL.issuperset(digits):
        raise ValueError(field)
    return int(digits, 8)


def _sync_header(head, kept):
    """(sha256, size) of a regular member's tar header, None at the end, else _SyncRefused. Not tarfile's
    parser: it costs 25 us a member."""
    if head == _SYNC_END:
        return None
    try:
        checksum, size = _sync_octal(head[148:156]), _sync_octal(head[124:136])
    except ValueError:
        raise _SyncRefused("a bad tar header after %d objects (not an octal number)" % kept)
    if checksum != sum(head) - sum(head[148:156]) + 8 * 32:  # summed with its own field as spaces
        raise _SyncRefused("a bad tar header after %d objects (bad checksum)" % kept)
    name, kind = head[:100].rstrip(b"\0").decode("utf-8", "replace"), head[156:157]
    if kind not in (b"0", b"\0") or len(name) != 64 or not _SYNC_HEX.issuperset(name) or head[345:500].strip(b"\0"):
        raise _SyncRefused("not an object of the store: %r (type %r)" % (name[:80], kind))
    return name, size


def _sync_receive(store, count, stream):
    """Keep the objects of a tar stream (jobs/sync.py TarStream: one regular member per object, named by its
    sha256) in one pass: each written to a new file in the store while it is hashed, and kept under its name
    only when its bytes are its name. Returns how many were kept; _SyncRefused at the first bad header, short
    object or wrong checksum (what was kept before it stays: each object was checked)."""
    writer = _SyncWriter(store)
    kept = 0
    try:
        while True:
            header = _sync_header(_sync_read(stream, 512, "after %d objects, before its end" % kept), kept)
            if header is None:
                break
            sha, size = header
            fd, part = writer.new(sha)
            try:
                h, left = hashlib.sha256(), size
                while left:
                    data = stream.read(min(left, 1 << 20))
                    if not data:
                        raise _SyncRefused("the stream ended inside object %s" % sha[:12])
                    h.update(data)
                    _sync_write_all(fd, data)
                    left -= len(data)
                if h.hexdigest() != sha:
                    raise _SyncRefused("object %s has sha256 %s" % (sha[:12], h.hexdigest()[:12]))
                _sync_read(stream, -size % 512, "inside object %s" % sha[:12])
                writer.keep(fd, part, sha, size)
                part = None
            finally:
                os.close(fd)
                writer.drop(part)
            kept += 1
        if stream.read().strip(b"\0"):
            raise _SyncRefused("data after the stream's end")
        if kept != count:
            raise _SyncRefused("the stream held %d objects, not %d" % (kept, count))
    finally:
        writer.close()
    return kept


def op_sync_apply(req):
    """Build the job's copy at req['dest'] from the store: every file of the manifest (given, or saved
    by digest), its mode, and its symlinks; in '<dest>.ugro-part' first, moved into place only whole.
    An object missing from the store fails the request and leaves dest as it was."""
    store = req["store"]
    digest = req.get("digest")
    manifest = req.get("manifest") or _sync_pending.get(digest)
    saved = manifest is None
    if saved:
        try:
            with open(_sync_manifest_path(store, digest)) as fh:
                manifest = json.load(fh)
        except (OSError, ValueError):
            raise AgentError("snapshot %s is not known here" % str(digest)[:12])
    dest = os.path.expanduser(req["dest"]).rstrip("/")
    part = dest + ".ugro-part"
    if os.path.lexists(part):
        shutil.rmtree(part, ignore_errors=True)
    os.makedirs(part)
    count, total, made = 0, 0, {part}
    try:
        for f in manifest["files"]:
            rel = _sync_rel(f["path"])
            target = os.path.join(part, rel)
            _sync_makedirs(os.path.dirname(target), made)
            obj = _sync_object(store, f["sha256"])
            try:
                present = os.stat(obj).st_size == int(f["size"])
            except OSError:
                present = False
            if not present:
                raise AgentError("%s: object %s is not in the store" % (rel, f["sha256"][:12]))
            if int(f.get("mode", 0o644)) & 0o111:
                os.chmod(obj, 0o555)
            try:
                os.link(obj, target)
            except OSError:  # another filesystem, or links not allowed: a copy
                shutil.copyfile(obj, target)
                os.chmod(target, int(f.get("mode", 0o644)) & 0o777)
            count += 1
            total += int(f["size"])
        for link in manifest.get("links") or []:
            rel = _sync_rel(link["path"])
            pointed = os.path.normpath(os.path.join(os.path.dirname(rel), str(link["target"])))
            if os.path.isabs(str(link["target"])) or pointed == ".." or pointed.startswith("../"):
                raise AgentError("%s: a symlink out of the tree (to %s)" % (rel, link["target"]))
            target = os.path.join(part, rel)
            _sync_makedirs(os.path.dirname(target), made)
            os.symlink(link["target"], target)
        old = None
        if os.path.lexists(dest):
            old = "%s.ugro-old-%d" % (dest, int(time.time() * 1000))
            os.rename(dest, old)
        os.rename(part, dest)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except Exception:
        shutil.rmtree(part, ignore_errors=True)
        raise
    if digest and not saved:  # every object was there: the next sync of this tree is one small request
        _sync_save_manifest(store, digest, manifest)
    return {"files": count, "bytes": total}


def op_sync_put(req):
    """Keep a few small objects sent inside the request (a change of a file or two costs no second channel),
    each checked against its sha256 first."""
    written = 0
    writer = _SyncWriter(req["store"])
    try:
        for blob in req["blobs"]:
            data = base64.b64decode(blob["data"])
            sha = _sync_sha(blob["sha256"])
            if hashlib.sha256(data).hexdigest() != sha:
                raise AgentError("checksum mismatch for object %s" % sha[:12])
            writer.put(sha, data)
            written += len(data)
    finally:
        writer.close()
    return {"written": written}


EXTRA_OPS = dict(globals().get("EXTRA_OPS") or {})
EXTRA_OPS.update({"sync_have": op_sync_have, "sync_put": op_sync_put, "sync_apply": op_sync_apply})


if __name__ == "__ugro_sync_receive__":  # run alone beside the agent, its stdin the stream (jobs/sync.py _send)
    try:
        _sync_receive(sys.argv[1], int(sys.argv[2]), sys.stdin.buffer)
    except (_SyncRefused, OSError) as exc:
        sys.stderr.write("%s\n" % exc)
        sys.exit(1)
