"""Bounded caches (jobs/cache.py, cluster/cache.py, cluster/node/cache.py) on nodes whose agents are local processes:
limits read from cluster.yaml (bad ones refused), objects no tree uses trimmed least recently used first, trees of
ended jobs oldest ended first, never what a queued or running job needs nor a file a job wrote, a shared working
directory trimmed once, the controller's store, and `node disk` (manage.py, the API, the client)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command
from django.test import Client as DjangoClient
from django.utils import timezone

from tests.test_sync import local_nodes, recorded  # noqa: F401 (a fixture)
from tests.test_transfer import dataset, objects_of, store

DAY = 24 * 3600.0


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put(root: Path, data: bytes, used: float) -> str:
    """An object in a store, read-only, last used at `used` (its atime and mtime)."""
    root.mkdir(parents=True, exist_ok=True)
    digest = sha(data)
    path = root / digest
    path.write_bytes(data)
    path.chmod(0o444)
    os.utime(path, (used, used))
    return digest


def job_row(name: str, state: str, nodes: list, *, ended_days: float = 0, sync_digest: str = "",
            data: list[dict] = ()):  # fmt: skip
    """A job as the lifecycle leaves it: its code record and a rank on each node."""
    from jobs.models import Job, JobCode, Rank

    at = timezone.now() - timedelta(days=ended_days)
    job = Job.objects.create(name=name, script="train.py", state=state, state_changed_at=at, created_at=at)
    JobCode.objects.create(job=job, sync_digest=sync_digest, data=list(data))
    running = state == Job.State.RUNNING
    for i, node in enumerate(nodes):
        Rank.objects.create(job=job, node=node, index=i, active=running,
                            state=Rank.State.RUNNING if running else Rank.State.EXITED)  # fmt: skip
    return job


def deliver_data(job, nodes, src: Path, dest: str) -> list[dict]:
    """A --data item as jobs/data.py delivers it: the objects into the nodes' stores, then placed in the job's
    directory; the manifest's files."""
    from jobs import transfer
    from jobs.data import dest_on

    objs = objects_of(src, 8 << 20)
    transfer.deliver(objs, nodes)
    files = [{"path": str(Path(o.path).relative_to(src)), "sha256": o.sha, "size": o.size, "mode": 0o444}
             for o in objs]  # fmt: skip
    transfer.place(nodes, lambda n: dest_on(job, n, dest), files)
    return files


def tree_intact(root: Path, files: list[dict]) -> bool:
    return all(sha((root / f["path"]).read_bytes()) == f["sha256"] for f in files)


def tree_linked(tree: Path, files: list[dict], objects: Path) -> bool:
    """Each file of the tree is still its store object (looked at without reading it: a read is a use)."""
    return all((tree / f["path"]).stat().st_ino == (objects / f["sha256"]).stat().st_ino for f in files)


@pytest.fixture
def scene(db, settings, tmp_path):
    """One node (its store over nothing yet) holding: a running job's synced code and --data, the --data of two
    ended jobs (ended two days and one day ago, the older sharing a file with the running job's), an ended job's data
    tree in which the job wrote a file, and the objects of a queued job's data (delivered, not placed yet)."""
    from jobs import sync
    from jobs.models import Job

    settings.DATA_DIR = tmp_path / "data"
    settings.JOBS_DIR = tmp_path / "data" / "jobs"
    (node,) = local_nodes({"n0": tmp_path / "w0"})
    work = tmp_path / "w0"
    shared = os.urandom(50_000)
    run_src = dataset(tmp_path / "run", {"a.bin": 120_000, "b.bin": 80_000})
    (run_src / "shared.bin").write_bytes(shared)
    old_src = dataset(tmp_path / "old", {"x.bin": 100_000})
    (old_src / "shared.bin").write_bytes(shared)
    new_src = dataset(tmp_path / "new", {"y.bin": 90_000})
    wrote_src = dataset(tmp_path / "wrote", {"z.bin": 70_000})
    queued_src = dataset(tmp_path / "queued", {"q.bin": 60_000})
    code = tmp_path / "proj"
    dataset(code, {"train.py": 3_000})
    manifest, _ = sync.snapshot(str(code))
    digest = manifest.digest
    running = job_row("run", Job.State.RUNNING, [node], sync_digest=digest,
                      data=[{"src": str(run_src), "dest": "ds", "node": ""}])  # fmt: skip
    sync.push(running, [node])
    run_files = deliver_data(running, [node], run_src, "ds")
    old = job_row("old", Job.State.SUCCEEDED, [node], ended_days=2, data=[{"src": str(old_src), "dest": "ds"}])
    old_files = deliver_data(old, [node], old_src, "ds")
    new = job_row("new", Job.State.FAILED, [node], ended_days=1, data=[{"src": str(new_src), "dest": "ds"}])
    new_files = deliver_data(new, [node], new_src, "ds")
    wrote = job_row("wrote", Job.State.CANCELLED, [node], ended_days=3, data=[{"src": str(wrote_src), "dest": "ds"}])
    deliver_data(wrote, [node], wrote_src, "ds")
    (work / "outputs" / "wrote" / "ds" / "cache.arrow").write_bytes(b"the job's own file")
    from jobs import transfer

    queued_objs = objects_of(queued_src, 8 << 20)
    transfer.deliver(queued_objs, [node])
    queued_manifest = sync.save_manifest({"files": [{"path": Path(o.path).name, "sha256": o.sha, "size": o.size,
                                                     "mode": 0o444} for o in queued_objs]})  # fmt: skip
    job_row("queued", Job.State.QUEUED, [], data=[{"src": str(queued_src), "dest": "q", "manifest": queued_manifest}])
    for obj in store(work).iterdir():  # all of it last used days ago (what is used now is never trimmed)
        if len(obj.name) == 64:
            os.utime(obj, (time.time() - 5 * DAY, time.time() - 5 * DAY))
    return {"node": node, "work": work, "objects": store(work), "run": run_files, "old": old_files, "new": new_files,
            "shared": sha(shared), "queued": [o.sha for o in queued_objs], "code": code, "digest": digest}  # fmt: skip


def held(scene) -> int:
    from jobs import cache

    return cache.disk(scene["node"])["bytes"]


def test_sizes_are_read_as_written_and_a_bad_limit_is_refused_at_import_in_one_line(db):
    from cluster.cache import DEFAULT_CACHE_LIMIT, node_limit, parse_size, store_limit
    from cluster.config_yaml import ConfigError, export_cluster, import_cluster
    from cluster.models import Node

    assert [parse_size(v) for v in ("500MB", "50GB", "1.5TB", "64GiB", "2G")] == [
        500 * 10**6, 50 * 10**9, 1_500 * 10**9, 64 * 2**30, 2 * 10**9]  # fmt: skip
    base = "nodes:\n  n1:\n    ip: 127.0.0.2\n{node}  n2:\n    ip: 127.0.0.3\n{paths}"
    # given limits on a node, for every node and for the controller
    import_cluster(base.format(node="    cache_limit: 1.5TB\n", paths="paths:\n  cache_limit: 500MB\n"
                                                                    "  store_limit: 2GB\n"))  # fmt: skip
    n1, n2 = Node.objects.get(name="n1"), Node.objects.get(name="n2")
    assert (n1.cache_limit, node_limit(n1), node_limit(n2), store_limit()) == (1_500 * 10**9, 1_500 * 10**9,
                                                                              500 * 10**6, 2 * 10**9)  # fmt: skip
    # and the export writes them back as the import reads them
    exported = export_cluster()
    assert "cache_limit: 1500GB" in exported and "store_limit: 2GB" in exported
    import_cluster(exported)
    assert Node.objects.get(name="n1").cache_limit == 1_500 * 10**9
    # when a limit is not a size: one line naming the key and its line, nothing imported
    for node, paths, where in (("    cache_limit: 50\n", "", "nodes.n1.cache_limit"),
                               ("    cache_limit: lots\n", "", "nodes.n1.cache_limit"),
                               ("", "paths:\n  store_limit: 0GB\n", "paths.store_limit"),
                               ("", "paths:\n  cache_limit: -5GB\n", "paths.cache_limit")):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            import_cluster(base.format(node=node, paths=paths))
        assert str(err.value).startswith(where + ": must be") and "\n" not in str(err.value)
        assert Node.objects.get(name="n1").cache_limit == 1_500 * 10**9
    # and without any limit a node has the default
    import_cluster(base.format(node="", paths=""))
    assert node_limit(Node.objects.get(name="n1")) == DEFAULT_CACHE_LIMIT


def test_objects_no_tree_uses_go_least_recently_used_first_and_a_partial_being_written_stays(db, settings, tmp_path):
    import fcntl

    from jobs import cache

    settings.DATA_DIR = tmp_path / "data"
    (node,) = local_nodes({"n0": tmp_path / "w0"})
    root = store(tmp_path / "w0")
    now = time.time()
    # given four objects no tree uses: oldest, older (but read an hour ago: its atime), newer, newest
    oldest = put(root, b"a" * 1000, now - 4 * DAY)
    read = put(root, b"b" * 1000, now - 3 * DAY)
    os.utime(root / read, (now - 3600, now - 3 * DAY))
    newer = put(root, b"c" * 1000, now - 2 * DAY)
    newest = put(root, b"d" * 1000, now - DAY)
    # and two partial transfers: one left off five days ago, one a transfer writes now (it holds the part's lock)
    xfer = root / ".xfer"
    xfer.mkdir()
    (xfer / ("e" * 64)).write_bytes(b"e" * 500)
    (xfer / ("e" * 64 + ".ok")).write_text("500")
    for name in ("e" * 64, "e" * 64 + ".ok"):
        os.utime(xfer / name, (now - 5 * DAY, now - 5 * DAY))
    (xfer / ("f" * 64)).write_bytes(b"f" * 500)
    os.utime(xfer / ("f" * 64), (now - 6 * DAY, now - 6 * DAY))
    writing = os.open(xfer / ("f" * 64), os.O_RDWR)
    fcntl.flock(writing, fcntl.LOCK_EX)
    try:
        total = held({"node": node})
        # when the limit leaves room for all but about two objects
        node.cache_limit = total - 2_400
        node.save()
        (done,) = cache.trim(node)
        # then the stale partial went first, then the oldest object, then the newer (not the one read since)
        assert done.error == "" and done.answer["partials"] == 1 and done.answer["objects"] == 2
        assert not (xfer / ("e" * 64)).exists() and not (xfer / ("e" * 64 + ".ok")).exists()
        assert sorted(p.name for p in root.iterdir() if len(p.name) == 64) == sorted([read, newest])
        assert (xfer / ("f" * 64)).exists()  # being written
        assert not (root / oldest).exists() and not (root / newer).exists()
        assert done.answer["after"] <= node.cache_limit
        # and a store under its limit is left as it is
        (again,) = cache.trim(node)
        assert again.answer["bytes"] == 0 and (root / read).exists()
        # and with no room at all, an object used a minute ago stays (a delivery may not have placed it yet)
        used_now = put(root, b"g" * 1000, now - 60)
        node.cache_limit = 1
        node.save()
        (done,) = cache.trim(node)
        assert (root / used_now).exists() and not (root / read).exists() and not (root / newest).exists()
    finally:
        os.close(writing)


def test_a_cache_over_its_limit_is_trimmed_without_touching_a_running_jobs_data(scene):
    from jobs import cache

    node, work, root = scene["node"], scene["work"], scene["objects"]
    run_tree, old_tree, new_tree = (work / "outputs" / j / "ds" for j in ("run", "old", "new"))
    old_only = [f["sha256"] for f in scene["old"] if f["sha256"] != scene["shared"]]
    # given a limit the store is over by the older ended job's own objects
    node.cache_limit = held(scene) - sum(f["size"] for f in scene["old"] if f["sha256"] in old_only) + 1
    node.save()
    (done,) = cache.trim(node)
    # then only the tree of the job that ended first went, with the objects only it held
    assert done.answer["trees"] == ["old/ds"] and not old_tree.exists()
    assert all(not (root / s).exists() for s in old_only) and (root / scene["shared"]).exists()
    assert tree_linked(new_tree, scene["new"], root)
    # when the limit leaves room for nothing
    node.cache_limit = 1
    node.save()
    (done,) = cache.trim(node)
    # then every ended tree that holds only UGRO's links went, and the one the job wrote in stays whole
    assert done.answer["trees"] == ["new/ds"] and not new_tree.exists()
    assert done.answer["skipped"] == [["wrote/ds", "holds cache.arrow, which the job wrote"]]
    assert (work / "outputs" / "wrote" / "ds" / "cache.arrow").read_bytes() == b"the job's own file"
    # and the running job's data and code are as they were, each file still its store object
    assert tree_linked(run_tree, scene["run"], root) and tree_intact(run_tree, scene["run"])
    assert (work / "outputs" / "run" / "code" / "train.py").read_bytes() == (scene["code"] / "train.py").read_bytes()
    # and the queued job's objects (delivered, not placed yet) are kept for it
    assert all((root / s).exists() for s in scene["queued"])
    assert done.answer["after"] > 1  # over still: what is left is needed, and the trim says how much
    # and what a delivery still needs, given by it, is kept too
    loose = put(root, b"not placed yet" * 100, time.time() - 9 * DAY)
    (done,) = cache.trim(node, protected=[loose])
    assert (root / loose).exists() and done.answer["objects"] == 0


def test_nodes_sharing_a_working_directory_are_trimmed_once_and_the_agent_refuses_paths_outside(
    db, settings, tmp_path, recorded  # noqa: F811
):
    from cluster import cache as limits
    from cluster.fanout import node_request
    from cluster.links import AgentRequestError
    from jobs import cache

    settings.DATA_DIR = tmp_path / "data"
    a, b = local_nodes({"a": tmp_path / "shared", "b": tmp_path / "shared"})
    (c,) = local_nodes({"c": tmp_path / "own"})
    for n in (a, b):
        n.workdir_id = "1" * 32
        n.save()
    sent = recorded(limits)
    # when the three nodes' caches are trimmed
    results = cache.trim([a, b, c])
    # then the shared store is asked once, the other once
    assert sorted(op for _, op in sent) == ["cache_trim", "cache_trim"]
    assert sorted(r.nodes for r in results) == [["a", "b"], ["c"]] and all(not r.error for r in results)
    # and the agent deletes nowhere but a store and the trees of jobs' directories
    own = str(store(tmp_path / "own"))
    for where, jobs in ((str(tmp_path / "shared"), []), (own, [{"job": "..", "trees": ["ds"], "ended": 1}]),
                        (own, [{"job": "j", "trees": ["../../x"], "ended": 1}]),
                        (own, [{"job": "j", "trees": [".ugro"], "ended": 1}])):  # fmt: skip
        with pytest.raises(AgentRequestError) as err:
            node_request(c, "cache_trim", store=where, workdir=str(tmp_path / "own"), limit=1, protected=[], jobs=jobs)
        assert "refused" in str(err.value)


def test_a_tree_reached_through_a_symlink_out_of_the_jobs_directory_is_never_touched(db, settings, tmp_path):
    from jobs import cache
    from jobs.models import Job

    settings.DATA_DIR = tmp_path / "data"
    (node,) = local_nodes({"n0": tmp_path / "w0"})
    node.cache_limit = 1
    node.save()
    # given an ended job whose data tree is a symlink to a directory elsewhere holding a link to a store object
    root = store(tmp_path / "w0")
    obj = put(root, b"x" * 5000, time.time() - DAY)
    elsewhere = tmp_path / "precious"
    elsewhere.mkdir()
    os.link(root / obj, elsewhere / "kept.bin")
    (tmp_path / "w0" / "outputs" / "j").mkdir(parents=True)
    (tmp_path / "w0" / "outputs" / "j" / "ds").symlink_to(elsewhere)
    job_row("j", Job.State.SUCCEEDED, [node], ended_days=1, data=[{"src": "/x", "dest": "ds"}])
    # when the store is trimmed to nothing
    (done,) = cache.trim(node)
    # then the tree is left, and what it leads to, and so the object it links
    assert done.answer["skipped"] == [["j/ds", "leads out of the job's directory: not touched"]]
    assert (elsewhere / "kept.bin").exists() and (root / obj).exists() and done.answer["trees"] == []


def test_node_disk_shows_what_is_held_and_why_through_the_command_the_api_and_the_client(scene, monkeypatch):
    from accounts.tokens import create_token
    from ugro_client import cli

    node = scene["node"]
    node.cache_limit = 10**9
    node.save()
    operator = User.objects.create_user("olga")
    operator.groups.add(Group.objects.get(name="operator"))
    launcher = User.objects.create_user("lars")
    launcher.groups.add(Group.objects.get(name="launcher"))
    # when an operator asks through manage.py
    out = io.StringIO()
    call_command("node_disk", "n0", "--as", "olga", stdout=out)
    text = out.getvalue()
    # then the head says the size against the limit and the free disk, and each item why it is held
    assert "n0: " in text and "of its 1.0 GB limit;" in text and "free of" in text
    lines = text.splitlines()
    assert any("code of run" in ln and "kept: running job run" in ln for ln in lines)
    assert any("data of run: ds" in ln and "kept: running job run" in ln for ln in lines)
    assert any("data of old: ds" in ln and "may be trimmed (job succeeded" in ln for ln in lines)
    assert any("data of wrote: ds" in ln and "kept: holds cache.arrow, which the job wrote" in ln for ln in lines)
    assert any("objects needed, not placed" in ln and "kept: queued job queued" in ln for ln in lines)
    # and the JSON says the same per item, with sizes and last use
    out = io.StringIO()
    call_command("node_disk", "n0", "--json", "--as", "olga", stdout=out)
    report = json.loads(out.getvalue())
    by = {(i["kind"], i.get("job")): i for i in report["items"]}
    assert by[("data", "run")]["protected"] == "running job run" and by[("data", "old")]["protected"] == ""
    assert by[("data", "run")]["bytes"] == sum(f["size"] for f in scene["run"])
    assert report["limit"] == 10**9 and report["bytes"] > 0 and not report["over"]
    # and an unknown node is one line
    with pytest.raises(CommandError, match="no node named 'nope'"):
        call_command("node_disk", "nope", "--as", "olga")
    # when asked through the API: operators only
    _, op_token = create_token(operator, "ops", "operate")
    _, l_token = create_token(launcher, "cli", "launch")
    web = DjangoClient()
    denied = web.get("/api/v1/nodes/n0/disk", HTTP_AUTHORIZATION=f"Bearer {l_token}")
    assert denied.status_code == 403 and "not allowed to manage nodes" in denied.json()["error"]
    answer = web.get("/api/v1/nodes/n0/disk", HTTP_AUTHORIZATION=f"Bearer {op_token}")
    assert answer.status_code == 200 and answer.json()["lines"][0] == lines[0]
    # and the client prints the same lines (its requests answered by the API above)

    def get(self, path, **params):
        got = web.get(f"/api/v1/{path}", params, HTTP_AUTHORIZATION=f"Bearer {op_token}")
        assert got.status_code == 200, got.content
        return got.json()

    monkeypatch.setattr(cli.Client, "get", get)
    monkeypatch.setenv("UGRO_TOKEN", op_token)
    shown = io.StringIO()
    monkeypatch.setattr("sys.stdout", shown)
    assert cli.run(["node", "disk", "n0"]) == 0
    assert shown.getvalue().splitlines()[0] == lines[0] and "kept: running job run" in shown.getvalue()


def test_the_controllers_store_keeps_a_running_jobs_snapshot_and_a_fresh_upload_and_trims_the_rest_oldest_first(
    db, settings, tmp_path
):
    from jobs import cache, data, sync
    from jobs.models import Job

    settings.DATA_DIR = tmp_path / "data"
    # given three snapshots: an ended job's from ten days ago, a running job's, and a client's upload no job used yet
    old = dataset(tmp_path / "old", {"o.py": 40_000})
    run = dataset(tmp_path / "run", {"r.py": 40_000})
    up = dataset(tmp_path / "up", {"u.py": 40_000})
    digests = {}
    for name, src in (("old", old), ("run", run)):
        manifest, _ = sync.snapshot(str(src))
        digests[name] = manifest.digest
    job_row("old", Job.State.SUCCEEDED, [], ended_days=10, sync_digest=digests["old"])
    job_row("run", Job.State.RUNNING, [], sync_digest=digests["run"])
    upload = {"files": [{"path": "u.py", "sha256": sha((up / "u.py").read_bytes()), "size": 40_000, "mode": 0o644}]}
    digests["up"], missing = sync.record_upload(upload, "laptop:~/up", {})
    sync.put_object(missing[0], [(up / "u.py").read_bytes()], 10**6)
    # and a hash cache entry of a --data file, last read twenty days ago
    data.hash_file(str(old / "o.py"))
    entry = next((tmp_path / "data" / "data" / "hashes").glob("*/*.json"))
    os.utime(entry, (time.time() - 20 * 86400, time.time() - 20 * 86400))
    for path in [*(tmp_path / "data" / "sync").glob("objects/*/*"), *(tmp_path / "data" / "sync").glob("manifests/*")]:
        os.utime(path, (time.time() - 30 * 86400, time.time() - 30 * 86400))  # each last read long ago
    # when the store's limit leaves room for two of the three objects
    done = cache.trim_controller(limit=cache.trim_controller(limit=10**12)["before"] - 30_000)
    # then the hash entry (oldest use) and the ended job's snapshot went, its manifest with it
    assert (done["hashes"], done["objects"], done["manifests"]) == (1, 1, 1)
    assert not entry.exists()
    with pytest.raises(sync.SyncError):
        sync.load_manifest(digests["old"])
    # and the running job's snapshot and the upload are whole
    for name in ("run", "up"):
        assert sync.missing_objects(sync.load_manifest(digests[name])) == []
    # and with no room at all, they are still kept
    done = cache.trim_controller(limit=1)
    for name in ("run", "up"):
        assert sync.missing_objects(sync.load_manifest(digests[name])) == []
