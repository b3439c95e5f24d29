"""Code sync's parts without nodes: the manifest a directory makes (.gitignore, excludes, symlinks, limits),
and the node agent's store and copy (a real agent process on this machine)."""

from __future__ import annotations

import base64
import glob
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from cluster.links import AgentRequestError, Endpoint, NodeLink
from ugro_client import manifest


def tree(root: Path, files: dict[str, bytes | str]) -> Path:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
    return root


def test_the_manifest_respects_gitignore_and_leaves_out_outputs_caches_and_checkpoints(tmp_path):
    # given a project with a .gitignore (and one in a subdirectory), outputs, caches and a checkpoint
    tree(tmp_path, {
        "train.py": "print(1)\n", "lib/model.py": "X = 1\n", ".gitignore": "data/\n*.log\n",
        "data/shard0.bin": b"0" * 100, "run.log": "x", "lib/.gitignore": "scratch.py\n", "lib/scratch.py": "y",
        "outputs/job/ckpt.txt": "o", "__pycache__/train.cpython-311.pyc": "c", "model.pt": b"w" * 10,
        ".git/HEAD": "ref", "configs/base.yaml": "lr: 1\n",
    })  # fmt: skip
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    # when its manifest is built
    found = manifest.build(str(tmp_path))
    # then only the code is listed, with each file's sha256, size and mode
    paths = [f["path"] for f in found.files]
    assert paths == [".gitignore", "configs/base.yaml", "lib/.gitignore", "lib/model.py", "run.sh", "train.py"]
    by_path = {f["path"]: f for f in found.files}
    assert by_path["train.py"]["sha256"] == hashlib.sha256(b"print(1)\n").hexdigest()
    assert by_path["run.sh"]["mode"] & 0o111 and by_path["train.py"]["size"] == 9
    # and the digest changes with any byte of the tree, and only then
    again = manifest.build(str(tmp_path)).digest
    assert again == found.digest
    (tmp_path / "lib" / "model.py").write_text("X = 2\n")
    assert manifest.build(str(tmp_path)).digest != found.digest


def test_symlinks_inside_the_tree_are_kept_and_one_out_of_it_is_refused_in_one_line(tmp_path):
    project = tree(tmp_path / "p", {"train.py": "x", "configs/a.yaml": "a"})
    (project / "current.yaml").symlink_to("configs/a.yaml")
    found = manifest.build(str(project))
    assert found.links == [{"path": "current.yaml", "target": "configs/a.yaml"}]
    (tmp_path / "secret").write_text("s")
    (project / "leak").symlink_to(tmp_path / "secret")
    with pytest.raises(manifest.ManifestError, match=r"^--sync: leak is a symlink out of the tree \(to .*secret\)$"):
        manifest.build(str(project))


def test_a_tree_over_the_limit_is_refused_naming_its_biggest_files(tmp_path):
    tree(tmp_path, {"train.py": "x", "big/weights.npy": b"0" * 3000, "mid.csv": b"0" * 2000, "small.txt": "s"})
    with pytest.raises(manifest.ManifestError) as err:
        manifest.build(str(tmp_path), limit_bytes=4000)
    assert "over the 0 MB limit" in str(err.value) and "biggest: big/weights.npy (0.0 MB), mid.csv" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(manifest.ManifestError, match="more than 2 files"):
        manifest.build(str(tmp_path), limit_files=2)
    with pytest.raises(manifest.ManifestError, match="not a directory"):
        manifest.build(str(tmp_path / "train.py"))


def test_git_info_names_the_commit_branch_and_the_uncommitted_diff(tmp_path):
    tree(tmp_path, {"train.py": "a = 1\n"})
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@x"]
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    clean = manifest.git_info(str(tmp_path))
    assert clean["branch"] == "main" and len(clean["commit"]) == 40 and clean["dirty"] is False
    (tmp_path / "train.py").write_text("a = 2\n")
    dirty = manifest.git_info(str(tmp_path))
    assert dirty["dirty"] is True and "-a = 1\n+a = 2" in dirty["diff"] and dirty["commit"] == clean["commit"]
    assert manifest.git_info(str(tmp_path.parent / "nowhere")) == {}


# -- the node agent's store and copy ----------------------------------------------------------------


@pytest.fixture
def agent():
    link = NodeLink(Endpoint(name="local-agent", address="127.0.0.1", transport="local"), connect_timeout=10)
    yield link
    link.close()


def listing_of(objects: dict[str, bytes]) -> dict:
    """A manifest of one file per object, named after it."""
    return {"files": [{"path": f"f/{name[:8]}", "sha256": name, "size": len(data), "mode": 0o644}
                      for name, data in objects.items()], "links": []}  # fmt: skip


def put(agent, store: str, objects: dict[str, bytes]) -> dict:
    """The objects into a node's store as the controller sends them (jobs/transfer.py): a stream to the agent's
    transfer listener, after its token; the listener's answer, {node: None or why}."""
    import json

    listen = agent.request("xfer_listen", store=store, name="n")
    specs = [{"sha": name, "size": len(data), "offset": 0, "chunks": []} for name, data in objects.items()]
    body = json.dumps({"objects": specs, "chunk": 8 << 20, "rest": []}).encode()
    head = f"{listen['token']}\n".encode() + b"%d\n" % len(body) + body
    rc, answer = agent.forward(listen["port"], head, list(objects.values()), 30)
    assert rc == 0, answer
    return json.loads(answer)


def send(agent, store: str, objects: dict[str, bytes], listing: dict, dest: str) -> None:
    """The objects by the transfer path, then the copy built from the store alone (jobs/sync.py _build)."""
    assert put(agent, store, objects) == {"n": None}
    agent.request("sync_apply", store=store, manifest=listing, dest=dest)


def store_files(store: str) -> set[str]:
    """Every file under a node's store, by name (objects, and anything left behind)."""
    return {name for _, _, names in os.walk(store) for name in names}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_objects_the_transfer_path_brought_build_the_copy_from_the_store_and_are_kept_once(agent, tmp_path):
    store, dest = str(tmp_path / "store"), str(tmp_path / "job" / "code")
    files = {"train.py": b"print('v1')\n", "lib/util.py": b"U = 1\n", "copy.py": b"print('v1')\n",
             "run.sh": b"#!/bin/sh\n"}  # fmt: skip
    listing = {
        "files": [{"path": p, "sha256": sha(d), "size": len(d), "mode": 0o755 if p.endswith(".sh") else 0o644}
                  for p, d in files.items()],
        "links": [{"path": "latest.py", "target": "train.py"}],
    }  # fmt: skip
    digest = manifest.digest_of(listing)
    objects = {sha(d): d for d in files.values()}
    # a node that never saw it knows nothing, and lacks each distinct object once
    assert agent.request("sync_have", store=store, digest=digest) == {"known": False, "missing": None}
    have = agent.request("sync_have", store=store, digest=digest, manifest=listing)
    assert sorted(have["missing"]) == sorted(objects)
    # while an object is missing from the store, no copy is built and dest is left as it was
    util = sha(b"U = 1\n")
    assert put(agent, store, {k: v for k, v in objects.items() if k != util}) == {"n": None}
    with pytest.raises(AgentRequestError, match=f"lib/util.py: object {util[:12]} is not in the store"):
        agent.request("sync_apply", store=store, digest=digest, dest=dest)
    assert not os.path.exists(dest) and not glob.glob(dest + ".ugro-part*")
    # when the last object has come by the transfer path, the copy is built from the store alone: every file, its
    # mode, its link, one inode per object
    assert agent.request("sync_have", store=store, manifest=listing)["missing"] == [util]
    assert put(agent, store, {util: b"U = 1\n"}) == {"n": None}
    assert agent.request("sync_apply", store=store, digest=digest, dest=dest)["files"] == 4
    assert Path(dest, "lib/util.py").read_bytes() == b"U = 1\n" and os.readlink(Path(dest, "latest.py")) == "train.py"
    assert os.stat(Path(dest, "train.py")).st_ino == os.stat(Path(dest, "copy.py")).st_ino
    assert os.access(Path(dest, "run.sh"), os.X_OK) and not os.stat(Path(dest, "train.py")).st_mode & 0o333
    # and the store keeps each object, the same inode as the copy's file, with nothing of the transfer left over
    for path, data in files.items():
        assert os.stat(Path(store, sha(data))).st_ino == os.stat(Path(dest, path)).st_ino
    assert not os.listdir(Path(store, ".xfer"))
    # so the next copy of the tree is one small request, and builds from the store alone
    assert agent.request("sync_have", store=store, digest=digest) == {"known": True, "missing": []}
    other = str(tmp_path / "job2" / "code")
    done = agent.request("sync_apply", store=store, digest=digest, dest=other)
    assert done == {"files": 4, "bytes": sum(len(d) for d in files.values())}
    assert Path(other, "train.py").read_bytes() == b"print('v1')\n" and os.access(Path(other, "run.sh"), os.X_OK)


def test_a_few_small_objects_come_inside_the_request_that_builds_the_copy(agent, tmp_path):
    store, dest = str(tmp_path / "store"), tmp_path / "code"
    old, new = b"print('old')\n", b"print('new')\n"
    entry = {"path": "train.py", "sha256": sha(old), "size": len(old), "mode": 0o644}
    agent.request("sync_apply", store=store, manifest={"files": [entry]}, dest=str(tmp_path / "first"),
                  blobs=[{"sha256": sha(old), "data": base64.b64encode(old).decode()}])  # fmt: skip
    listing = {"files": [entry, {"path": "lib.py", "sha256": sha(new), "size": len(new), "mode": 0o644}]}
    # a blob whose bytes are not its name, or one the manifest does not name, is refused: nothing is left
    for blobs, why in (
        ([{"sha256": sha(new), "data": base64.b64encode(b"other").decode()}], "checksum mismatch"),
        ([{"sha256": sha(b"x"), "data": base64.b64encode(b"x").decode()}], "is not a file of this copy"),
    ):
        with pytest.raises(AgentRequestError, match=why):
            agent.request("sync_apply", store=store, manifest=listing, dest=str(dest), blobs=blobs)
        assert not dest.exists() and not glob.glob(f"{dest}.ugro-part*") and sha(new) not in store_files(store)
    # the new object travels in the request, the other file is linked from the store
    blobs = [{"sha256": sha(new), "data": base64.b64encode(new).decode()}]
    done = agent.request("sync_apply", store=store, manifest=listing, dest=str(dest), blobs=blobs)
    assert done == {"files": 2, "bytes": len(old) + len(new)}
    assert (dest / "lib.py").read_bytes() == new and Path(store, sha(new)).read_bytes() == new
    assert os.stat(dest / "train.py").st_ino == os.stat(Path(store, sha(old))).st_ino


def test_what_killed_receivers_left_in_a_store_is_removed_before_the_next_objects_come(agent, tmp_path):
    import subprocess
    import time

    store, data = tmp_path / "store", b"print('kept')\n"
    store.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    running = subprocess.Popen(["sleep", "30"])
    try:
        # given a named part file of a receiver killed meanwhile, one of a receiver still writing, one of another
        # node's receiver, and the earlier code's staging directories: one left an hour ago, one in use
        host = os.uname().nodename
        (store / f".part-{host}-{gone.pid}-{sha(data)}").write_bytes(b"half")
        (store / f".part-{host}-{running.pid}-{sha(data)}").write_bytes(b"being written")
        (store / f".part-othernode-{gone.pid}-{sha(data)}").write_bytes(b"another node's (a shared store)")
        for name, age in ((".stage-old", 2 * 3600), (".stage-new", 0)):
            (store / name).mkdir()
            (store / name / "obj").write_bytes(b"x")
            os.utime(store / name, (time.time() - age, time.time() - age))
        listing = {"files": [{"path": "train.py", "sha256": sha(data), "size": len(data), "mode": 0o644}]}
        # when the node is asked what it lacks for a copy
        assert agent.request("sync_have", store=str(store), manifest=listing)["missing"] == [sha(data)]
        # then only what nobody writes any more is gone
        left = {p.name for p in store.iterdir() if p.name.startswith(".")}
        assert left == {".flat", f".part-{host}-{running.pid}-{sha(data)}", f".part-othernode-{gone.pid}-{sha(data)}",
                        ".stage-new"}  # fmt: skip
    finally:
        running.kill()
        running.wait()


def test_a_store_of_the_earlier_layout_is_moved_to_the_flat_one_once_and_nothing_is_sent_again(agent, tmp_path):
    # given a node's store as the earlier code left it: <sha[:2]>/<sha>, and a killed put's part file
    store, data = tmp_path / "store", b"print('kept')\n"
    old = store / sha(data)[:2] / sha(data)
    old.parent.mkdir(parents=True)
    old.write_bytes(data)
    (old.parent / f"{sha(data)}.123.ugro-part").write_bytes(b"half")
    listing = {"files": [{"path": "train.py", "sha256": sha(data), "size": len(data), "mode": 0o644}]}
    # when the node is asked what it lacks, it lacks nothing: the object moved, the old directory is gone
    assert agent.request("sync_have", store=str(store), manifest=listing)["missing"] == []
    assert (store / sha(data)).read_bytes() == data and not old.parent.exists() and (store / ".flat").exists()
    # and the copy is built from it
    done = agent.request("sync_apply", store=str(store), manifest=listing, dest=str(tmp_path / "code"))
    assert done["files"] == 1 and (tmp_path / "code" / "train.py").read_bytes() == data


def test_a_copy_missing_an_object_or_with_a_bad_path_leaves_the_old_copy_as_it_was(agent, tmp_path):
    store, dest = str(tmp_path / "store"), tmp_path / "code"
    dest.mkdir()
    (dest / "train.py").write_text("old")
    data = b"new"
    send(agent, store, {sha(data): data}, listing_of({sha(data): data}), str(tmp_path / "first"))
    entry = {"path": "train.py", "sha256": sha(data), "size": 3, "mode": 0o644}
    absent = {"path": "lib.py", "sha256": "0" * 64, "size": 1, "mode": 0o644}
    for listing, why in (
        ({"files": [entry, absent]}, "lib.py: object 000000000000 is not in the store"),
        ({"files": [dict(entry, path="../escape.py")]}, "bad path in manifest"),
        ({"files": [entry], "links": [{"path": "x", "target": "../../etc/passwd"}]}, "a symlink out of the tree"),
        ({"files": [entry], "links": [{"path": "x", "target": "/etc/passwd"}]}, "a symlink out of the tree"),
    ):
        with pytest.raises(AgentRequestError, match=why):
            agent.request("sync_apply", store=store, manifest=listing, dest=str(dest))
        assert (dest / "train.py").read_text() == "old" and not glob.glob(f"{dest}.ugro-part*")
    assert not (tmp_path / "escape.py").exists()


# -- what ran, on the pages -------------------------------------------------------------------------


def test_the_job_page_and_compare_show_what_ran_and_what_changed_escaped(db, client, settings, tmp_path):
    from django.contrib.auth import get_user_model

    from jobs import sync
    from jobs.models import Job, JobCode

    settings.DATA_DIR = tmp_path
    client.force_login(get_user_model().objects.create_user("viewer1", password="x" * 12))
    v1, v2 = b"lr = 1\nprint('<b>v1</b>')\n", b"lr = 1\nprint('<b>v2</b>')\n"
    for data in (v1, v2):
        sync.put_object(hashlib.sha256(data).hexdigest(), [data], 1000)
    old = {"files": [{"path": "train.py", "sha256": hashlib.sha256(v1).hexdigest(), "size": len(v1), "mode": 420},
                     {"path": "gone.py", "sha256": "b" * 64, "size": 1, "mode": 420}]}  # fmt: skip
    new = {"files": [{"path": "train.py", "sha256": hashlib.sha256(v2).hexdigest(), "size": len(v2), "mode": 420},
                     {"path": "new.py", "sha256": "d" * 64, "size": 1, "mode": 420}]}  # fmt: skip
    env = {"python": "3.11.7", "torch": "2.13.0", "cuda": "12.8", "nccl": "2.27.3", "driver": "580.65.06",
           "gpu": "NVIDIA H200", "script_sha256": "e" * 64, "packages_sha256": "f" * 64,
           "packages_count": 2}  # fmt: skip
    jobs = []
    for name, listing, torch, diff in (("r1", old, "2.13.0", ""), ("r2", new, "2.14.0", "+<script>alert(1)</script>")):
        job = Job.objects.create(name=name, script="train.py", state=Job.State.SUCCEEDED)
        JobCode.objects.create(
            job=job, sync_source="/home/u/proj", sync_digest=sync.save_manifest(listing), sync_files=2, sync_bytes=2,
            sync_s=0.25, git={"commit": "1" * 40, "branch": "main", "dirty": bool(diff), "diff": diff},
            nodes={"gpu1": {**env, "torch": torch}, "gpu2": env},
            packages={"gpu1": ["numpy==2.1.0", f"torch=={torch}"], "gpu2": ["numpy==2.1.0", "torch==2.13.0"]},
        )  # fmt: skip
        jobs.append(job)
    page = client.get(f"/jobs/{jobs[1].pk}/").content.decode()
    assert 'id="code"' in page and "copied to the nodes in 0.25 s" in page and "NVIDIA H200" in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script>alert(1)" not in page
    compare = client.get(f"/compare/?job={jobs[0].pk}&job={jobs[1].pk}").content.decode()
    assert 'id="code-diff"' in compare and "gpu1: 2.13.0, gpu2: 2.13.0" not in compare
    assert "gpu1: 2.14.0, gpu2: 2.13.0" in compare  # the nodes differed in r2: each is named
    assert "~ train.py" in compare and "+ new.py" in compare and "- gone.py" in compare
    assert "torch 2.13.0 -&gt; 2.14.0" in compare
    # the code diff, escaped
    assert "-print(&#x27;&lt;b&gt;v1&lt;/b&gt;&#x27;)\n+print(&#x27;&lt;b&gt;v2&lt;/b&gt;&#x27;)" in compare
    listed = client.get("/api/v1/jobs/r2/packages?node=gpu1&text=1")
    assert listed.status_code == 200, listed.content
    assert listed.content.decode() == "numpy==2.1.0\ntorch==2.14.0\n"


def test_a_checkpoint_in_the_synced_copy_is_named_from_where_the_ranks_start(db, tmp_path):
    from cluster.models import Node
    from jobs import checkpoints
    from jobs.models import Checkpoint, Job, JobCode

    one = Node.objects.create(name="a", address="127.0.0.9", workdir="/w/a")
    two = Node.objects.create(name="b", address="127.0.0.10", workdir="/w/b")
    job = Job.objects.create(name="syncd", script="train.py")
    JobCode.objects.create(job=job, sync_digest="1" * 64, sync_source="/p")
    ckpt = Checkpoint.objects.create(job=job, node=one, path="/w/a/outputs/syncd/code/runs/checkpoint-20", size=1,
                                     mtime=1.0, step=20, kind="dir", ready=True)  # fmt: skip
    # the script's resume argument is relative to its working directory (the copy), as is the copy elsewhere
    assert checkpoints.path_for_rank0(ckpt) == "runs/checkpoint-20"
    assert checkpoints.target_path(ckpt, two) == "/w/b/outputs/syncd/code/runs/checkpoint-20"
    # without a sync the workdir is where the ranks start
    plain = Job.objects.create(name="plain", script="train.py")
    other = Checkpoint.objects.create(job=plain, node=one, path="/w/a/outputs/plain/checkpoint_step5.pt", size=1,
                                      mtime=1.0, step=5, ready=True)  # fmt: skip
    assert checkpoints.path_for_rank0(other) == "outputs/plain/checkpoint_step5.pt"


# -- nodes that share a working directory (an NFS home) ---------------------------------------------


@pytest.fixture
def two_agents():
    """Two nodes' agents on this machine: what one writes in a directory, the other sees, as over NFS."""
    links = [NodeLink(Endpoint(name=f"local-agent-{i}", address="127.0.0.1", transport="local"), connect_timeout=10)
             for i in (1, 2)]  # fmt: skip
    yield links
    for link in links:
        link.close()


def test_nodes_that_share_a_workdir_read_the_one_id_the_first_of_them_wrote_there(two_agents, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    shared, own = tmp_path / "shared", tmp_path / "own"
    shared.mkdir()
    own.mkdir()
    # given two nodes that see one working directory no node has looked at yet
    # when both ask for its id at the same moment
    with ThreadPoolExecutor(2) as pool:
        ids = list(pool.map(lambda a: a.request("workdir_id", workdir=str(shared))["workdir_id"], two_agents))
    # then they read one id: the one the first of them wrote there, once, and nothing else is left
    marker = (shared / ".ugro" / "workdir-id").read_text().strip()
    assert ids == [marker, marker] and len(marker) == 32 and int(marker, 16) >= 0
    assert os.listdir(shared / ".ugro") == ["workdir-id"]
    # and the health probe answers it too, while another directory has an id of its own, a missing one none
    assert two_agents[1].request("probe", workdir=str(shared))["workdir_id"] == marker
    other = two_agents[0].request("workdir_id", workdir=str(own))["workdir_id"]
    assert other not in (None, marker) and (own / ".ugro" / "workdir-id").read_text().strip() == other
    assert two_agents[0].request("workdir_id", workdir=str(tmp_path / "nowhere"))["workdir_id"] is None
    assert not (tmp_path / "nowhere").exists()
    # and a marker that is not an id names no group
    (own / ".ugro" / "workdir-id").write_text("not an id\n")
    assert two_agents[0].request("workdir_id", workdir=str(own))["workdir_id"] is None


def test_one_node_of_each_working_directory_is_chosen_and_a_node_without_an_id_is_alone():
    from types import SimpleNamespace

    from jobs.sync import one_per_workdir

    nodes = [SimpleNamespace(pk=i, name=f"n{i}") for i in range(1, 7)]
    ids = {1: "a" * 32, 2: None, 3: "a" * 32, 4: "b" * 32, 5: "b" * 32, 6: None}
    firsts, sharers = one_per_workdir(nodes, ids)
    assert [n.pk for n in firsts] == [1, 2, 4, 6] and [n.pk for n in sharers] == [3, 5]


def local_nodes(workdirs: dict[str, Path]) -> list:
    """Nodes run on this machine (their agents local processes), each with its working directory."""
    from cluster.models import Node

    return [Node.objects.create(name=name, address="127.0.0.1", transport="local", workdir=str(workdir),
                                agent_python="/usr/bin/python3") for name, workdir in workdirs.items()]  # fmt: skip


@pytest.fixture
def recorded(monkeypatch):
    """Every request a module sends its nodes, as (node, op), in the order sent; the links closed after."""
    from cluster.links import pool

    sent: list[tuple[str, str]] = []

    def record(module) -> list[tuple[str, str]]:
        real = module.node_request

        def request(node, op, /, **fields):
            sent.append((node.name, op))
            return real(node, op, **fields)

        monkeypatch.setattr(module, "node_request", request)
        return sent

    yield record
    pool.close_all()


def test_a_sync_to_nodes_sharing_a_workdir_builds_one_copy_there_and_a_copied_workdir_gets_its_own(
    db, settings, tmp_path, recorded
):
    from jobs import sync
    from jobs.models import Job, JobCode

    settings.DATA_DIR = tmp_path / "data"
    project = tree(tmp_path / "proj", {"train.py": "print(1)\n", "lib/util.py": "U = 1\n"})
    # given three nodes on one working directory, one on its own, and one whose workdir was copied from the
    # shared one with its .ugro/workdir-id (as `rsync -a` of a node's directory would)
    shared, own, copied = tmp_path / "shared", tmp_path / "own", tmp_path / "copied"
    (shared / ".ugro").mkdir(parents=True)
    (shared / ".ugro" / "workdir-id").write_text("c" * 32 + "\n")
    (copied / ".ugro").mkdir(parents=True)
    (copied / ".ugro" / "workdir-id").write_text("c" * 32 + "\n")
    nodes = local_nodes({"n1": shared, "n2": shared, "n3": shared, "n4": own, "n5": copied})
    listing, _ = sync.snapshot(str(project))
    job = Job.objects.create(name="grp", script="train.py")
    JobCode.objects.create(job=job, sync_digest=listing.digest, sync_source=str(project))
    sent = recorded(sync)
    # when the job's code is pushed to all five
    pushed = sync.push(job, nodes)
    # then the shared directory's copy was built by one of its nodes, the other two only looked for it, and the
    # other two directories got their own
    built = {node for node, op in sent if op == "sync_apply"}
    assert built == {"n1", "n4", "n5"}, sent
    assert {node for node, op in sent if op == "stat"} == {"n2", "n3", "n5"}
    code = sum(f["size"] for f in listing.files)
    assert pushed.sent_bytes == 3 * code and pushed.nodes == 5
    for workdir in (shared, own, copied):
        assert (workdir / "outputs" / "grp" / "code" / "lib" / "util.py").read_text() == "U = 1\n"
        assert [p.name for p in (workdir / "outputs" / "grp").iterdir()] == ["code"]


def test_a_sync_over_a_megabyte_goes_by_the_transfer_path_leaving_the_controller_once_and_a_small_change_inline(
    db, settings, tmp_path, recorded
):
    from jobs import sync, transfer
    from jobs.models import Job, JobCode

    settings.DATA_DIR = tmp_path / "data"
    big = os.urandom(sync.INLINE_BYTES + 300_000)
    project = tree(tmp_path / "proj", {"train.py": "print(1)\n", "assets/vocab.bin": big, "lib/util.py": "U = 1\n"})
    nodes = local_nodes({"n1": tmp_path / "w1", "n2": tmp_path / "w2"})
    sent = recorded(sync)
    recorded(transfer)

    def push(name: str):
        listing, _ = sync.snapshot(str(project))
        job = Job.objects.create(name=name, script="train.py")
        JobCode.objects.create(job=job, sync_digest=listing.digest, sync_source=str(project))
        return listing, sync.push(job, nodes)

    # when a tree over INLINE_BYTES is pushed to two nodes that hold none of it
    listing, pushed = push("big")
    # then its objects went by the transfer path, one chain through both nodes: each byte left the controller once
    code = sum(f["size"] for f in listing.files)
    assert pushed.sent_bytes == code and pushed.nodes == 2
    assert sorted(n for n, op in sent if op == "xfer_listen") == ["n1", "n2"]
    # and each copy was linked from its store alone: the same inode as the store's object
    for w in ("w1", "w2"):
        copy = tmp_path / w / "outputs" / "big" / "code"
        assert (copy / "assets" / "vocab.bin").read_bytes() == big and (copy / "train.py").read_text() == "print(1)\n"
        obj = tmp_path / w / ".ugro" / "objects" / sha(big)
        assert (copy / "assets" / "vocab.bin").stat().st_ino == obj.stat().st_ino
    # and a small change travels inside the request that builds the copy, no transfer set up
    (project / "lib" / "util.py").write_text("U = 2\n")
    sent.clear()
    _, pushed = push("small")
    assert pushed.sent_bytes == 2 * len("U = 2\n") and not [op for _, op in sent if op.startswith("xfer_")]
    assert (tmp_path / "w2" / "outputs" / "small" / "code" / "lib" / "util.py").read_text() == "U = 2\n"


def test_two_builders_of_one_copy_at_once_end_with_it_whole_and_leave_nothing_of_theirs(tmp_path, monkeypatch):
    # codesync.py run here, as the agent runs it: the interleavings of two nodes' agents, step by step
    code = {"__name__": "ugro_codesync", "AgentError": RuntimeError}
    exec(compile(Path("cluster/node/codesync.py").read_text(), "codesync.py", "exec"), code)
    store, dest = tmp_path / "store", tmp_path / "outputs" / "j" / "code"
    store.mkdir()
    data = b"print(1)\n"
    (store / sha(data)).write_bytes(data)
    files = [{"path": "train.py", "sha256": sha(data), "size": len(data), "mode": 0o644}]
    # given an earlier attempt's copy, what a killed builder of this host left, the earlier code's part, and a part
    # of another host (whose name begins as this one's) still building
    dest.mkdir(parents=True)
    (dest / "old.py").write_text("old")
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = os.uname().nodename
    theirs = f"code.ugro-part-{host}-x-{gone.pid}-1"
    for name in (f"code.ugro-part-{host}-{gone.pid}-1", "code.ugro-part", theirs):
        (dest.parent / name).mkdir()
    # when two builders of it (two nodes on one workdir) start together and finish one after the other
    one, two = (code["_SyncCopy"](str(store), str(dest), files) for _ in range(2))
    one.finish([])
    two.finish([])
    # then the copy is whole and the only one there, beside the other host's part
    assert os.listdir(dest) == ["train.py"] and (dest / "train.py").read_bytes() == data
    assert sorted(os.listdir(dest.parent)) == ["code", theirs]
    # and when the other puts its copy in place between this one's moves, this one's is dropped, not an error
    one, two = (code["_SyncCopy"](str(store), str(dest), files) for _ in range(2))
    rename = os.rename

    def other_first(src: str, dst: str) -> None:
        if src == two.part and os.path.exists(one.part):
            rename(one.part, dst)
        rename(src, dst)

    monkeypatch.setattr(os, "rename", other_first)
    two.finish([])
    monkeypatch.undo()
    assert os.listdir(dest) == ["train.py"] and sorted(os.listdir(dest.parent)) == ["code", theirs]


def test_a_copy_of_the_same_snapshot_is_kept_with_what_the_job_wrote_in_it_and_another_replaces_it(agent, tmp_path):
    store, dest = str(tmp_path / "store"), tmp_path / "outputs" / "j" / "code"
    v1, v2 = b"print(1)\n", b"print(2)\n"
    listing = listing_of({sha(v1): v1})
    send(agent, store, {sha(v1): v1}, listing, str(dest))
    # given the job wrote a checkpoint in its copy (where it runs)
    ckpt = dest / "outputs" / "j" / "checkpoint_step10.pt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"weights")
    # when the same snapshot is applied again (a resume), the copy is kept, checkpoint and all
    assert agent.request("sync_apply", store=store, manifest=listing, dest=str(dest))["kept"] is True
    assert ckpt.read_bytes() == b"weights"
    # and a copy whose file is not the store's any more (edited in place of its link) is built again
    synced = dest / listing["files"][0]["path"]
    synced.unlink()
    synced.write_bytes(b"print(0)\n")
    assert "kept" not in agent.request("sync_apply", store=store, manifest=listing, dest=str(dest))
    assert synced.read_bytes() == v1 and not ckpt.exists()
    # as is the copy of another snapshot
    other = listing_of({sha(v2): v2})
    blob = {"sha256": sha(v2), "data": base64.b64encode(v2).decode()}
    assert "kept" not in agent.request("sync_apply", store=store, manifest=other, dest=str(dest), blobs=[blob])
    assert sorted(p.name for p in (dest / "f").iterdir()) == [sha(v2)[:8]]


def test_a_checkpoint_seen_from_nodes_sharing_a_workdir_is_recorded_and_offered_once(db, tmp_path):
    from django.utils import timezone

    from cluster.models import Node
    from jobs import checkpoints
    from jobs.models import Checkpoint, Job, Rank

    # given a job on two nodes that share a working directory and one with its own
    shared = str(tmp_path / "shared")
    one, two = (Node.objects.create(name=f"s{i}", address=f"127.0.0.{20 + i}", workdir=shared, workdir_id="a" * 32)
                for i in (1, 2))  # fmt: skip
    alone = Node.objects.create(name="s3", address="127.0.0.23", workdir=str(tmp_path / "own"), workdir_id="b" * 32)
    job = Job.objects.create(name="grp", script="x.py", state=Job.State.RUNNING, started_at=timezone.now())
    ranks = [Rank.objects.create(job=job, node=n, index=i, state=Rank.State.RUNNING)
             for i, n in enumerate((one, two, alone))]  # fmt: skip
    path = f"{shared}/outputs/grp/checkpoint_step10.pt"
    found = {"path": path, "kind": "checkpoint", "dir": False, "size": 10, "mtime": 1.0}
    # when the first two ranks' walks find its checkpoint, unchanged between them, and the third's two its own
    checkpoints.record_found(ranks[0], [dict(found)])
    checkpoints.record_found(ranks[1], [dict(found)])
    mine = dict(found, path=f"{tmp_path}/own/outputs/grp/checkpoint_step10.pt")
    checkpoints.record_found(ranks[2], [dict(mine)])
    checkpoints.record_found(ranks[2], [dict(mine)])
    # then the shared one is one checkpoint, ready (two listings agreed), as the first node recorded it
    shared_rows = Checkpoint.objects.filter(job=job, path=path)
    assert [(c.node.name, c.ready) for c in shared_rows] == [("s1", True)]
    assert Checkpoint.objects.filter(job=job, path=mine["path"], node=alone).exists()
    # and one recorded from each node of the directory (before the nodes knew they share it) is offered once
    Checkpoint.objects.create(job=job, node=two, path=path, size=10, mtime=1.0, step=10, ready=True)
    assert sorted((c.node.name, c.path) for c in checkpoints.offered(job)) == [("s1", path), ("s3", mine["path"])]


def test_a_checkpoint_is_copied_once_to_each_other_working_directory_and_never_where_it_is_seen(db, tmp_path, recorded):
    from cluster.models import Node
    from jobs import checkpoints, transfer
    from jobs.models import Checkpoint, Job

    # given a checkpoint on n1, whose workdir n2 shares; n3 and n4 on another workdir; n5 on its own
    w1, w2, w3 = (tmp_path / f"w{i}" for i in (1, 2, 3))
    for w in (w1, w2, w3):
        w.mkdir()
    nodes = local_nodes({"n1": w1, "n2": w1, "n3": w2, "n4": w2, "n5": w3})
    job = Job.objects.create(name="ck", script="train.py", state=Job.State.FAILED)
    saved = w1 / "outputs" / "ck" / "checkpoint_step10.pt"
    saved.parent.mkdir(parents=True)
    saved.write_bytes(os.urandom(5000))
    ckpt = Checkpoint.objects.create(job=job, node=nodes[0], path=str(saved), size=5000, mtime=1.0, step=10,
                                     ready=True)  # fmt: skip
    sent = recorded(checkpoints)
    recorded(transfer)  # the copies go by the one transfer path
    # when a resume on all five needs it everywhere
    checkpoints.ensure_on(ckpt, nodes)
    # then it was written once to w2 (by n3) and once to w3, never to w1, and n2 and n4 were only asked to look
    assert sorted({node for node, op in sent if op == "xfer_place"}) == ["n3", "n5"], sent
    assert {node for node, op in sent if op == "stat"} == {"n2", "n4"}
    for w in (w2, w3):
        assert (w / "outputs" / "ck" / "checkpoint_step10.pt").read_bytes() == saved.read_bytes()
        assert os.listdir(w / "outputs" / "ck") == ["checkpoint_step10.pt"]
    # and nothing is copied at all when every node sees it, even with the node that recorded it gone (its last
    # probe's id says where it was)
    sent.clear()
    checkpoints.ensure_on(ckpt, nodes[:2])
    assert {op for _, op in sent} == {"workdir_id", "stat"}
    # (a writable copy: a resumed job may save over it in place without touching the store's object)
    assert (w2 / "outputs" / "ck" / "checkpoint_step10.pt").stat().st_nlink == 1
    gone = Node.objects.create(name="gone", address="127.0.0.1", transport="local", workdir=str(w1),
                               agent_python=str(tmp_path / "no-python"), workdir_id=nodes[0].link().request(
                                   "workdir_id", workdir=str(w1))["workdir_id"])  # fmt: skip
    Checkpoint.objects.filter(pk=ckpt.pk).update(node=gone)
    ckpt.refresh_from_db()
    sent.clear()
    checkpoints.ensure_on(ckpt, nodes[1:2])
    assert sorted(sent) == [("gone", "workdir_id"), ("n2", "stat"), ("n2", "workdir_id")]
