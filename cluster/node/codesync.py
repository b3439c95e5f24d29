# UGRO node code sync: a content-addressed store of the files a job's directory holds, and the job's own
# copy made from it. Sent after probe.py and before agent.py, exec'd together: stdlib only, Python >= 3.8,
# no __future__ imports, module-level names start with _sync_ (AgentError is agent.py's, looked up at run).
#
# The store (<workdir>/.ugro/objects/<sha256>) keeps every file once, read-only, whatever directory or job
# it came from: a file unchanged since the node's last copy is never sent again. Flat: 256 <sha256[:2]>
# directories would cost a cold copy 256 more inodes (a 2,000-file tree: an eighth more). A job's copy is built
# beside its place and moved into place only once whole, so a rank never starts in a partial tree. An object
# that comes inside the request that builds the copy (its blobs) is written once, at its path in the copy, and
# linked into the store only once its bytes are checked: in the store whole or not at all, and one inode and
# two directory entries per file, as a copy plus a store needs at the least. Every other file of the copy
# is a hard link to the store's object; larger objects reach the store by the one transfer path (transfer.py).
import base64
import errno
import hashlib
import json
import os
import shutil
import stat as _sync_stat
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


def _sync_touch(path):
    """Mark an object used now (its mtime): a store over its limit is trimmed least recently used first (cache.py)."""
    try:
        os.utime(path)
    except OSError:  # another user's object in a shared store: it keeps its time
        pass


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


# a named part file (an object replaced in the store, or an earlier receiver's): .part-<host>-<pid>-<sha256>
# (a store on a shared filesystem may be written from several nodes: only this host's processes are known here)
_SYNC_PART = ".part-"


def _sync_part_name(sha):
    return "%s%s-%d-%s" % (_SYNC_PART, os.uname().nodename, os.getpid(), sha)


def _sync_rmtree(path):
    shutil.rmtree(path, ignore_errors=True)


# a job's copy being built: <dest>.ugro-part-<host>-<pid>-<n>, one per builder, so that two nodes building the
# same directory (a shared workdir the controller did not group) never write in one tree
_SYNC_COPY_PART = ".ugro-part"
_sync_copies = [0]


def _sync_sweep_parts(dest):
    """Remove the copies of dest that builders gone left: this host's of processes that no longer run, and
    the earlier code's '<dest>.ugro-part' (another host's are left to it)."""
    parent, name = os.path.split(dest)
    mine = "%s%s-%s-" % (name, _SYNC_COPY_PART, os.uname().nodename)
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in entries:
        if entry == name + _SYNC_COPY_PART:
            _sync_rmtree(os.path.join(parent, entry))
        elif entry.startswith(mine):
            pid_n = entry[len(mine) :].split("-")  # <pid>-<n> (more parts: another host whose name begins as ours)
            if len(pid_n) != 2 or not (pid_n[0].isdigit() and pid_n[1].isdigit()):
                continue
            try:
                os.kill(int(pid_n[0]), 0)
                continue  # its builder still runs
            except ProcessLookupError:
                _sync_rmtree(os.path.join(parent, entry))
            except OSError:
                continue


class _SyncCopy:
    """A job's copy, built in '<dest>.ugro-part-<host>-<pid>-<n>' and moved into place only whole (a rank never
    starts in a partial tree). A file whose object comes with the copy is written there, at its path, and once
    its bytes are checked the store keeps it too (a hard link: one inode for both, the next copy of it travels
    no more); any other file is a hard link to the store's object (a copy where links cannot be made)."""

    def __init__(self, store, dest, files):
        self.store = os.path.expanduser(store)
        self.dest = os.path.expanduser(dest).rstrip("/")
        _sync_copies[0] += 1
        self.part = "%s%s-%s-%d-%d" % (self.dest, _SYNC_COPY_PART, os.uname().nodename, os.getpid(), _sync_copies[0])
        self.wanted = {}  # sha256 -> the files of those bytes not in the copy yet
        for f in files:
            self.wanted.setdefault(f["sha256"], []).append(f)
        os.makedirs(self.store, exist_ok=True)
        os.makedirs(os.path.dirname(self.dest), exist_ok=True)
        _sync_sweep_parts(self.dest)  # what failed or killed copies left
        os.mkdir(self.part)
        self.made = {self.part}
        self.files = self.bytes = 0

    def path(self, rel):
        target = os.path.join(self.part, _sync_rel(rel))
        _sync_makedirs(os.path.dirname(target), self.made)
        return target

    def create(self, sha, size):
        """(fd, path, files) for object sha, come with the copy: a new file at the first path of the files of
        those bytes, read-only (objects are), for its bytes."""
        group = self.wanted.pop(sha, None)
        if group is None or int(group[0]["size"]) != size:
            raise AgentError("object %s is not a file of this copy (or came twice)" % sha[:12])
        target = self.path(group[0]["path"])
        mode = 0o555 if int(group[0].get("mode", 0o644)) & 0o111 else 0o444
        return os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode), target, group

    def created(self, target, sha, size, group):
        """A file create() made, written and checked: kept in the store, and linked at the group's other paths
        (files with the same bytes)."""
        obj = os.path.join(self.store, sha)
        try:
            os.link(target, obj)
        except FileExistsError:
            if os.stat(obj).st_size != size:  # a bad one (cut short by older code): replaced
                part = os.path.join(self.store, _sync_part_name(sha))
                os.link(target, part)
                os.replace(part, obj)
        except OSError:  # links not allowed there: the copy is whole, the store sends it again next time
            pass
        for f in group[1:]:
            os.link(target, self.path(f["path"]))
        self.files += len(group)
        self.bytes += size * len(group)

    def link(self, f):
        """A file whose object the store holds already."""
        rel = f["path"]
        target = self.path(rel)
        obj = _sync_object(self.store, f["sha256"])
        try:
            present = os.stat(obj).st_size == int(f["size"])
        except OSError:
            present = False
        if not present:
            raise AgentError("%s: object %s is not in the store" % (rel, f["sha256"][:12]))
        if int(f.get("mode", 0o644)) & 0o111:
            os.chmod(obj, 0o555)
        _sync_touch(obj)
        try:
            os.link(obj, target)
        except OSError:  # another filesystem, or links not allowed: a copy
            shutil.copyfile(obj, target)
            os.chmod(target, int(f.get("mode", 0o644)) & 0o777)
        self.files += 1
        self.bytes += int(f["size"])

    def finish(self, links):
        """Link the files whose objects did not come with the copy from the store, add the symlinks (each
        pointing inside the tree), and move the copy into place."""
        for group in self.wanted.values():
            for f in group:
                self.link(f)
        for link in links:
            rel = _sync_rel(link["path"])
            pointed = os.path.normpath(os.path.join(os.path.dirname(rel), str(link["target"])))
            if os.path.isabs(str(link["target"])) or pointed == ".." or pointed.startswith("../"):
                raise AgentError("%s: a symlink out of the tree (to %s)" % (rel, link["target"]))
            os.symlink(link["target"], self.path(rel))
        old = None
        if os.path.lexists(self.dest):
            old = "%s.ugro-old-%s" % (self.dest, self.part.rsplit(_SYNC_COPY_PART + "-", 1)[1])
            try:
                os.rename(self.dest, old)
            except FileNotFoundError:  # another builder of this directory moved it first
                old = None
        try:
            os.rename(self.part, self.dest)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # another builder of the same directory put its copy (of the same manifest) in place first
            _sync_rmtree(self.part)
        if old:
            _sync_rmtree(old)

    def abandon(self):
        _sync_rmtree(self.part)


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
    """_sync_have's answer, with the id of the node's workdir when asked (req['workdir']): nodes that answer the
    same id share that directory, and the controller builds their copy once (jobs/sync.py push)."""
    answer = _sync_have(req)
    if req.get("workdir"):
        answer["workdir_id"] = ugro_workdir_id(req["workdir"])  # noqa: F821 (probe.py's, sent before this file)
    return answer


def _sync_have(req):
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


def _sync_save_manifest(store, digest, data):
    """Keep a manifest (its JSON, bytes) under its digest: the next copy of it is one small request."""
    path = _sync_manifest_path(store, digest)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = "%s.%s.%d.tmp" % (path, os.uname().nodename, os.getpid())  # nodes sharing a store may write it at once
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _sync_built(store, dest, files, links):
    """Whether dest holds this manifest's copy already: each file the store's object itself (a hard link to it:
    its bytes), each symlink as listed. Files the job added there do not count."""
    dest = os.path.expanduser(dest).rstrip("/")
    try:
        if not _sync_stat.S_ISDIR(os.lstat(dest).st_mode):
            return False
        for f in files:
            there = os.lstat(os.path.join(dest, _sync_rel(f["path"])))
            obj = os.stat(_sync_object(store, f["sha256"]))
            if (there.st_ino, there.st_dev) != (obj.st_ino, obj.st_dev) or obj.st_size != int(f["size"]):
                return False
        for link in links:
            if os.readlink(os.path.join(dest, _sync_rel(link["path"]))) != str(link["target"]):
                return False
    except OSError:
        return False
    return True


def op_sync_apply(req):
    """Build the job's copy at req['dest'] (_SyncCopy): every file of the manifest (given, or the one
    sync_have was given, or saved by digest), its mode, and its symlinks. A few small objects may come inside
    the request ('blobs', each checked against its sha256 first): a change of a file or two costs no transfer.
    An object missing from the store, or a blob whose bytes are not its name, fails the request and leaves
    dest as it was. A copy of the same manifest at dest is kept as it is (_sync_built): a resume's."""
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
    links = manifest.get("links") or []
    if not req.get("blobs") and _sync_built(store, req["dest"], manifest["files"], links):
        # a resumed job's copy, of the same snapshot: kept, with what the job wrote in it (checkpoints, logs)
        for f in manifest["files"]:
            _sync_touch(_sync_object(store, f["sha256"]))
        return {"files": len(manifest["files"]), "bytes": sum(int(f["size"]) for f in manifest["files"]), "kept": True}
    copy = _SyncCopy(store, req["dest"], manifest["files"])
    try:
        for blob in req.get("blobs") or []:
            data = base64.b64decode(blob["data"])
            sha = _sync_sha(blob["sha256"])
            if hashlib.sha256(data).hexdigest() != sha:
                raise AgentError("checksum mismatch for object %s" % sha[:12])
            fd, target, group = copy.create(sha, len(data))
            try:
                _sync_write_all(fd, data)
            finally:
                os.close(fd)
            copy.created(target, sha, len(data), group)
        copy.finish(links)
    except BaseException:
        copy.abandon()
        raise
    if digest and not saved:  # every object is there now: the next sync of this tree is one small request
        data = json.dumps({"files": manifest["files"], "links": manifest.get("links") or []})
        _sync_save_manifest(store, digest, data.encode())
    return {"files": copy.files, "bytes": copy.bytes}


EXTRA_OPS = dict(globals().get("EXTRA_OPS") or {})
EXTRA_OPS.update({"sync_have": op_sync_have, "sync_apply": op_sync_apply})

