# UGRO node cache: what a node's store (<workdir>/.ugro/objects) holds and why, and its trim to a size limit. Sent
# after transfer.py and before agent.py, exec'd together: stdlib only, Python >= 3.8, module-level names start with
# _cache_ (AgentError is agent.py's).
#
# The store keeps each object once (a file named by its sha256); a job's tree (its code copy
# <workdir>/outputs/<job>/code, a --data item at <workdir>/outputs/<job>/<DEST>) is hard links to those objects, so an
# object whose only link is the store's (st_nlink 1) is used by no tree. A trim removes, least recently used first
# (the newest of an object's atime and mtime: the ops that link an object touch it), the objects no tree uses that the
# controller did not name as needed (by a queued or running job, a service), then the trees of ended jobs the
# controller lists (oldest ended first), for objects only they held. It deletes nothing else: in a tree only the
# store's links and Python's __pycache__; a tree that holds anything the job wrote there (a checkpoint, a log), or
# that a symlink leads out of the job's directory, is left whole; a tree of a job the controller marks as needed is
# never a candidate, and a name or path that is not a job's tree refuses the request.
import fcntl
import json
import os
import stat as _cache_stat
import time

_CACHE_HEX = frozenset("0123456789abcdef")
_CACHE_LOCK = ".trim.lock"
_CACHE_OUTSIDE = "a symlink out of the job's directory"


def _cache_is_sha(name):
    return len(name) == 64 and _CACHE_HEX.issuperset(name)


def _cache_dir_bytes(path):
    total = 0
    for base, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                pass
    return total


class _CacheStore:
    """One look at a store: its objects (sha256 -> [size, links, last use, inode]), partial transfers (sha256 ->
    [bytes, last use, path]), manifests and the rest, in bytes."""

    def __init__(self, root):
        self.root = root
        self.objects, self.by_ino, self.partials = {}, {}, {}
        self.dev = None
        self.manifests = [0, 0]  # count, bytes
        self.other = 0
        try:
            entries = list(os.scandir(root))
        except FileNotFoundError:
            entries = []
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if _cache_is_sha(entry.name) and _cache_stat.S_ISREG(st.st_mode):
                self.objects[entry.name] = [st.st_size, st.st_nlink, max(st.st_atime, st.st_mtime), st.st_ino]
                self.by_ino[st.st_ino] = entry.name
                self.dev = st.st_dev
            elif entry.name == ".xfer" and _cache_stat.S_ISDIR(st.st_mode):
                self._partials(entry.path)
            elif entry.name == "manifests" and _cache_stat.S_ISDIR(st.st_mode):
                for m in os.scandir(entry.path):
                    try:
                        self.manifests[1] += m.stat(follow_symlinks=False).st_size
                        self.manifests[0] += 1
                    except OSError:
                        pass
            elif _cache_stat.S_ISDIR(st.st_mode):
                self.other += _cache_dir_bytes(entry.path)
            else:
                self.other += st.st_size

    def _partials(self, path):
        for entry in os.scandir(path):
            sha = entry.name[:64]
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not _cache_is_sha(sha):
                self.other += st.st_size
                continue
            part = self.partials.setdefault(sha, [0, 0.0, os.path.join(path, sha)])
            part[0] += st.st_size
            part[1] = max(part[1], st.st_mtime)

    def total(self):
        return (sum(o[0] for o in self.objects.values()) + sum(p[0] for p in self.partials.values())
                + self.manifests[1] + self.other)  # fmt: skip


def _cache_root(store):
    root = os.path.abspath(os.path.expanduser(str(store or "")))
    if not store or os.path.basename(root) != "objects" or os.path.basename(os.path.dirname(root)) != ".ugro":
        raise AgentError("refused: %r is not a UGRO store (<workdir>/.ugro/objects)" % (store,))  # noqa: F821
    return root


def _cache_protected(req):
    """sha256 -> why, from the request's [[why, [sha256, ...]], ...]."""
    out = {}
    for why, shas in req.get("protected") or []:
        for sha in shas:
            out.setdefault(str(sha), str(why))
    return out


def _cache_job_name(name):
    name = str(name or "")
    if not name or "/" in name or "\0" in name or name.startswith(".") or len(name) > 200:
        raise AgentError("refused: %r is not a job's name" % (name,))  # noqa: F821
    return name


def _cache_tree_path(workdir, job, rel):
    """(<workdir>/outputs/<job>/<rel>, whether it lies inside the job's directory: no symlink below it on the way);
    a name or path that is not one of a job's trees refuses the request."""
    rel = str(rel or "")
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\0" in rel or any(p in ("", ".", "..") for p in parts) or parts[0] == ".ugro":
        raise AgentError("refused: %r is not a tree in a job's directory" % (rel,))  # noqa: F821
    base = os.path.join(workdir, "outputs", _cache_job_name(job))
    path = os.path.join(base, rel)
    inside = not os.path.lexists(path) or os.path.realpath(path) == os.path.join(os.path.realpath(base), rel)
    return path, inside


def _cache_ours(rel, st, store, links):
    """Whether a file of a tree is UGRO's: a link to a store object, a symlink the code's manifest lists, or
    Python's bytecode cache."""
    if _cache_stat.S_ISLNK(st.st_mode):
        return rel in links
    if not _cache_stat.S_ISREG(st.st_mode):
        return False
    if st.st_dev == store.dev and st.st_ino in store.by_ino:
        return True
    return "__pycache__" in rel.split("/")[:-1] and rel.endswith(".pyc")


class _CacheTree:
    """A job's tree as the store sees it: the objects it links (inode -> links), its bytes, files, newest mtime,
    and the first file in it that is not UGRO's (None: the whole tree can go)."""

    def __init__(self, store, path, links):
        self.path, self.links, self.bytes, self.files, self.last, self.foreign = path, {}, 0, 0, 0.0, None
        try:
            top = os.lstat(path)
        except OSError:
            self.exists = False
            return
        self.exists = True
        if not _cache_stat.S_ISDIR(top.st_mode):
            self._file("", top, store, links)
            return
        self.last = top.st_mtime
        for base, dirs, files in os.walk(path):
            for name in files + [d for d in dirs if os.path.islink(os.path.join(base, d))]:
                full = os.path.join(base, name)
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                self._file(os.path.relpath(full, path), st, store, links)

    @classmethod
    def outside(cls, path):
        """A tree whose path leads out of its job's directory (a symlink on the way): never looked into nor touched."""
        tree = cls.__new__(cls)
        tree.path, tree.links, tree.bytes, tree.files, tree.last, tree.exists = path, {}, 0, 0, 0.0, True
        tree.foreign = _CACHE_OUTSIDE
        return tree

    def _file(self, rel, st, store, links):
        self.files += 1
        self.bytes += st.st_size
        self.last = max(self.last, st.st_mtime)
        if not _cache_ours(rel, st, store, links):
            if self.foreign is None:
                self.foreign = rel or os.path.basename(self.path)
        elif _cache_stat.S_ISREG(st.st_mode) and st.st_ino in store.by_ino:
            self.links[st.st_ino] = self.links.get(st.st_ino, 0) + 1

    def remove(self, store, links):
        """Delete what is UGRO's in the tree, then its empty directories; what else is there stays."""
        try:
            top = os.lstat(self.path)
        except OSError:
            return
        if not _cache_stat.S_ISDIR(top.st_mode):
            if _cache_ours("", top, store, links):
                os.unlink(self.path)
            return
        for base, dirs, files in os.walk(self.path, topdown=False):
            for name in files + dirs:
                full = os.path.join(base, name)
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                if _cache_stat.S_ISDIR(st.st_mode):
                    try:
                        os.rmdir(full)
                    except OSError:
                        pass
                elif _cache_ours(os.path.relpath(full, self.path), st, store, links):
                    os.unlink(full)
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def _cache_links(root, digest):
    """The symlinks a code snapshot's manifest lists (kept in the store by codesync.py), else none."""
    if not digest or not _cache_is_sha(str(digest)):
        return set()
    try:
        with open(os.path.join(root, "manifests", str(digest) + ".json")) as fh:
            return {str(link["path"]) for link in json.load(fh).get("links") or []}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _cache_trees(req, root, store, workdir):
    """(job entry, tree path relative to the job's directory, _CacheTree) of each tree the request names that exists."""
    out = []
    for job in req.get("jobs") or []:
        name = _cache_job_name(job.get("job"))
        for rel in job.get("trees") or []:
            links = _cache_links(root, job.get("digest")) if rel == "code" else set()
            path, inside = _cache_tree_path(workdir, name, rel)
            tree = _CacheTree(store, path, links) if inside else _CacheTree.outside(path)
            if tree.exists:
                out.append((job, rel, tree, links))
    return out


def _cache_free(root):
    st = os.statvfs(root if os.path.isdir(root) else os.path.dirname(os.path.dirname(root)))
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _cache_lock(root):
    """This store's trim lock (one trim of a store at a time, whichever node's agent runs it), or None if taken."""
    os.makedirs(root, exist_ok=True)
    fd = os.open(os.path.join(root, _CACHE_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _cache_writing(path):
    """Whether a transfer writes this partial object now (it holds its lock: cluster/node/transfer.py)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def op_cache_report(req):
    """What the store holds and why: its bytes and the disk's, the objects no tree uses (those a job or service
    needs apart, by why), partial transfers, each job tree the request names (its bytes, files, last change, and
    the first file in it the job wrote), and objects linked only from elsewhere."""
    root = _cache_root(req["store"])
    workdir = os.path.abspath(os.path.expanduser(str(req.get("workdir") or "~")))
    store = _CacheStore(root)
    protected = _cache_protected(req)
    trees = _cache_trees(req, root, store, workdir)
    seen = set()
    out_trees = []
    for job, rel, tree, _links in trees:
        seen.update(tree.links)
        outside = tree.foreign == _CACHE_OUTSIDE
        out_trees.append({"job": job["job"], "path": rel, "bytes": tree.bytes, "files": tree.files, "last": tree.last,
                          "foreign": None if outside else tree.foreign, "outside": outside})  # fmt: skip
    free = {"count": 0, "bytes": 0, "oldest": None, "newest": None}
    needed, elsewhere = {}, {"count": 0, "bytes": 0}
    for sha, (size, nlink, last, ino) in store.objects.items():
        if nlink == 1 and sha in protected:
            group = needed.setdefault(protected[sha], {"why": protected[sha], "count": 0, "bytes": 0})
            group["count"] += 1
            group["bytes"] += size
        elif nlink == 1:
            free["count"] += 1
            free["bytes"] += size
            free["oldest"] = last if free["oldest"] is None else min(free["oldest"], last)
            free["newest"] = last if free["newest"] is None else max(free["newest"], last)
        elif ino not in seen:
            elsewhere["count"] += 1
            elsewhere["bytes"] += size
    partials = [{"sha": sha, "bytes": p[0], "last": p[1], "writing": _cache_writing(p[2]),
                 "needed": protected.get(sha)} for sha, p in sorted(store.partials.items())]  # fmt: skip
    disk_free, disk_total = _cache_free(root)
    return {"store": root, "bytes": store.total(), "free": disk_free, "disk": disk_total,
            "objects": {"count": len(store.objects), "bytes": sum(o[0] for o in store.objects.values())},
            "unreferenced": free, "needed": sorted(needed.values(), key=lambda g: g["why"]), "elsewhere": elsewhere,
            "partials": partials, "trees": out_trees,
            "manifests": {"count": store.manifests[0], "bytes": store.manifests[1]}, "other": store.other}  # fmt: skip


def _cache_unlink_object(root, sha):
    """Remove an object still used by no tree (looked at again now); its bytes, else 0."""
    path = os.path.join(root, sha)
    try:
        st = os.lstat(path)
        if st.st_nlink != 1:
            return 0
        os.unlink(path)
    except OSError:
        return 0
    return st.st_size


def _cache_unlink_partial(root, sha):
    """Remove a partial object no transfer is writing (and its checked length); its bytes, else 0."""
    part = os.path.join(root, ".xfer", sha)
    freed = 0
    try:
        fd = os.open(part, os.O_RDONLY)
    except OSError:
        fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return 0
        for path in (part, part + ".ok"):
            try:
                freed += os.lstat(path).st_size
                os.unlink(path)
            except OSError:
                pass
    finally:
        if fd is not None:
            os.close(fd)
    return freed


def _cache_forget_manifests(root, removed):
    """Code manifests that name a removed object: they can no longer be built from the store alone."""
    folder = os.path.join(root, "manifests")
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    dropped = 0
    for entry in entries:
        try:
            with open(entry.path) as fh:
                files = json.load(fh).get("files") or []
            if any(f.get("sha256") in removed for f in files):
                os.unlink(entry.path)
                dropped += 1
        except (OSError, ValueError, AttributeError, TypeError):
            continue
    return dropped


def op_cache_trim(req):
    """Bring the store under req['limit'] bytes: objects no tree uses and req['protected'] does not name, least
    recently used first (partial transfers no transfer writes among them); then, while still over, the trees of
    req['jobs'] whose job has ended and is not marked protected (in the order given: oldest ended first), each only
    if it holds nothing the job wrote and its removal frees objects the trim then takes. Nothing used in the last
    req['fresh_s'] seconds goes (a delivery may not have placed it yet). Another trim of the same store running:
    {"busy": True}, nothing done."""
    root = _cache_root(req["store"])
    workdir = os.path.abspath(os.path.expanduser(str(req.get("workdir") or "~")))
    limit = int(req["limit"])
    if limit <= 0:
        raise AgentError("refused: a cache limit of %d bytes" % limit)  # noqa: F821
    protected = _cache_protected(req)
    for job in req.get("jobs") or []:  # every tree named checked first: a bad one refuses the request, nothing done
        for rel in job.get("trees") or []:
            _cache_tree_path(workdir, job.get("job"), rel)
    fd = _cache_lock(root)
    if fd is None:
        return {"busy": True}
    try:
        return _cache_trim(req, root, workdir, limit, protected)
    finally:
        os.close(fd)


def _cache_trim(req, root, workdir, limit, protected):
    store = _CacheStore(root)
    before = store.total()
    fresh = time.time() - float(req.get("fresh_s") or 0)
    done = {"busy": False, "before": before, "after": before, "limit": limit, "objects": 0, "partials": 0,
            "bytes": 0, "trees": [], "skipped": [], "manifests": 0}  # fmt: skip
    if before <= limit:
        return done
    over = before - limit
    # objects and partial objects no tree uses, least recently used first
    queue = [(o[2], sha, "object") for sha, o in store.objects.items()
             if o[1] == 1 and sha not in protected and o[2] < fresh]  # fmt: skip
    queue += [(p[1], sha, "partial") for sha, p in store.partials.items() if sha not in protected and p[1] < fresh]
    queue.sort()
    removed = set()
    for _last, sha, kind in queue:
        if done["bytes"] >= over:
            break
        if kind == "object":
            got = _cache_unlink_object(root, sha)
            if got:
                removed.add(sha)
                done["objects"] += 1
        else:
            got = _cache_unlink_partial(root, sha)
            done["partials"] += 1 if got else 0
        done["bytes"] += got
    if done["bytes"] < over:
        _cache_trim_trees(req, root, store, workdir, protected, over, done, removed, fresh)
    if removed:
        done["manifests"] = _cache_forget_manifests(root, removed)
    done["after"] = before - done["bytes"]
    return done


def _cache_trim_trees(req, root, store, workdir, protected, over, done, removed, fresh):
    """Trees of ended jobs, oldest ended first: planned on the scan (which objects each tree's removal leaves used by
    no tree), then only the trees that hold an object the trim takes are removed, and those objects with them."""
    ended = [j for j in req.get("jobs") or [] if j.get("ended") is not None and not j.get("protected")]
    links_left = {sha: o[1] for sha, o in store.objects.items() if sha not in removed}
    planned, freed, freed_bytes = [], [], 0
    for job, rel, tree, links in _cache_trees({"jobs": ended}, root, store, workdir):
        if done["bytes"] + freed_bytes >= over:
            break
        where = "%s/%s" % (job["job"], rel)
        if tree.foreign == _CACHE_OUTSIDE:
            done["skipped"].append([where, "leads out of the job's directory: not touched"])
            continue
        if tree.foreign is not None:
            done["skipped"].append([where, "holds %s, which the job wrote" % tree.foreign])
            continue
        planned.append((where, tree, links))
        for ino, count in tree.links.items():
            sha = store.by_ino[ino]
            if sha not in links_left:
                continue
            links_left[sha] -= count
            if links_left[sha] == 1 and sha not in protected and store.objects[sha][2] < fresh:
                freed.append(sha)
                freed_bytes += store.objects[sha][0]
    freed.sort(key=lambda sha: store.objects[sha][2])
    taken, got = [], 0
    for sha in freed:
        if done["bytes"] + got >= over:
            break
        taken.append(sha)
        got += store.objects[sha][0]
    inodes = {store.objects[sha][3] for sha in taken}
    for where, tree, links in planned:
        if inodes & set(tree.links):
            tree.remove(store, links)
            done["trees"].append(where)
    for sha in taken:
        got = _cache_unlink_object(root, sha)
        if got:
            removed.add(sha)
            done["objects"] += 1
            done["bytes"] += got


EXTRA_OPS = dict(globals().get("EXTRA_OPS") or {})
EXTRA_OPS.update({"cache_report": op_cache_report, "cache_trim": op_cache_trim})
