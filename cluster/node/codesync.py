# UGRO node code sync: a content-addressed store of the files a job's directory holds, and the job's own
# copy made from it. Sent after probe.py and before agent.py, exec'd together: stdlib only, Python >= 3.8,
# no __future__ imports, module-level names start with _sync_ (AgentError is agent.py's, looked up at run).
#
# The store (<workdir>/.ugro/objects/<sha256[:2]>/<sha256>) keeps every file once, read-only, whatever
# directory or job it came from: a file unchanged since the node's last copy is never sent again. A job's
# copy is built beside its place from hard links into the store (a copy where links cannot be made), and
# moved into place only once whole, so a rank never starts in a partial tree.
import base64
import hashlib
import json
import os
import shutil
import tempfile
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


def _sync_object(store, sha):
    return os.path.join(os.path.expanduser(store), sha[:2], _sync_sha(sha))


def _sync_manifest_path(store, digest):
    return os.path.join(os.path.expanduser(store), "manifests", _sync_sha(digest) + ".json")


def _sync_keep(store, sha, path, made=None):
    """Move a checked file into the store as object sha, read-only."""
    target = _sync_object(store, sha)
    _sync_makedirs(os.path.dirname(target), set() if made is None else made)
    os.chmod(path, 0o444)
    os.replace(path, target)


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
    if manifest is None and digest:
        try:
            with open(_sync_manifest_path(store, digest)) as fh:
                manifest = json.load(fh)
        except (OSError, ValueError):
            return {"known": False, "missing": None}
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
    with open(tmp, "w") as fh:
        json.dump({"files": manifest["files"], "links": manifest.get("links") or []}, fh)
    os.replace(tmp, path)


def op_sync_stage(req):
    """A fresh directory inside the store for a stream of objects (a tar whose members are named by their
    sha256, unpacked there by `tar` beside the agent); sync_adopt checks and keeps them."""
    store = os.path.expanduser(req["store"])
    os.makedirs(store, exist_ok=True)
    return {"dir": tempfile.mkdtemp(prefix=".stage-", dir=store)}


def op_sync_adopt(req):
    """Keep the objects a stream unpacked into a staging directory: each checked against its name (sha256)
    and expected size, made read-only and moved into the store; the staging directory is removed.
    Anything missing or wrong fails the request (what was right is kept)."""
    store = os.path.expanduser(req["store"])
    staging = os.path.realpath(os.path.expanduser(req["staging"]))
    if not staging.startswith(os.path.realpath(store) + "/.stage-"):
        raise AgentError("not a staging directory of this store: %s" % req["staging"])
    bad, kept, made = [], 0, set()
    try:
        for sha, size in sorted(req["objects"].items()):
            path = os.path.join(staging, _sync_sha(sha))
            h = hashlib.sha256()
            try:
                with open(path, "rb", buffering=0) as fh:
                    got = os.fstat(fh.fileno()).st_size
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        h.update(block)
            except OSError:
                bad.append("%s missing" % sha[:12])
                continue
            if h.hexdigest() != sha or got != int(size):
                bad.append("%s has sha256 %s" % (sha[:12], h.hexdigest()[:12]))
                continue
            _sync_keep(store, sha, path, made)
            kept += 1
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if bad:
        raise AgentError("%d objects not kept: %s" % (len(bad), ", ".join(bad[:5])))
    return {"kept": kept}


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
    for blob in req["blobs"]:
        data = base64.b64decode(blob["data"])
        sha = blob["sha256"]
        if hashlib.sha256(data).hexdigest() != sha:
            raise AgentError("checksum mismatch for object %s" % sha[:12])
        tmp = "%s.%d.ugro-part" % (_sync_object(req["store"], sha), os.getpid())
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        with open(tmp, "wb") as fh:
            fh.write(data)
        _sync_keep(req["store"], sha, tmp)
        written += len(data)
    return {"written": written}


EXTRA_OPS = dict(globals().get("EXTRA_OPS") or {})
EXTRA_OPS.update({"sync_have": op_sync_have, "sync_put": op_sync_put, "sync_stage": op_sync_stage,
                  "sync_adopt": op_sync_adopt, "sync_apply": op_sync_apply})
