"""The same code on every node, on real sshd nodes whose workdirs differ and real torchrun: a directory
synced before the ranks start (only what changed travels), a script that differs between nodes refused by
name, and what ran (code, environment) recorded with each job."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from cluster.models import ClusterSettings
from jobs.logs import job_settled
from jobs.models import Job, JobCode
from ugro_client import manifest

from .conftest import NODE_ENV, wait_for
from .test_sync import tree

pytestmark = pytest.mark.e2e

# A script that imports a module beside it and says which version of it ran, where, on which rank.
SCRIPT = (
    "import os\n"
    "from lib.version import VERSION\n"
    "print(f\"VERSION={VERSION} in {os.getcwd()} rank {os.environ['UGRO_NODE_RANK']}\", flush=True)\n"
)


def run(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def finish(job: Job) -> Job:
    wait_for(lambda: job_settled(job), timeout=120, interval=0.1, what=f"job {job.name} to end")
    job.refresh_from_db()
    return job


@pytest.fixture
def project(lab, tmp_path):
    """A code directory under a sync root, in git, with data its .gitignore leaves out."""
    cs = ClusterSettings.load()
    cs.paths = {**(cs.paths or {}), "sync_roots": [str(tmp_path / "code")]}
    cs.save()
    root = tree(tmp_path / "code" / "proj", {
        "train.py": SCRIPT, "lib/__init__.py": "", "lib/version.py": "VERSION = 1\n", ".gitignore": "data/\n",
        "data/shard.bin": b"0" * 4096,
    })  # fmt: skip
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@x"]
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    return root


def test_a_changed_file_reaches_every_node_and_an_unchanged_tree_copies_nothing(project, lab):
    """Covers: a synced directory reaching two real nodes, each rank running in its copy, then only a changed file
    travelling and an unchanged tree sending nothing; the store's rules alone are tests/test_sync.py's. And what ran,
    recorded from real nodes (`results --json`): the synced tree's git state (clean, then an uncommitted diff) and
    each node's python, torch and packages as its agent read them.
    """
    code_bytes = sum(f["size"] for f in manifest.build(str(project)).files)
    # given a directory synced to two nodes
    run("launch", "--name", "s1", "--nodes", "2", "--sync", str(project), "--script", "train.py", "--detach")
    job = finish(Job.objects.get(name="s1"))
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    # then each node has the code (not the data .gitignore leaves out) and both ranks ran in their copy
    for rank in job.ranks.select_related("node"):
        copy = Path(rank.node.workdir) / "outputs" / "s1" / "code"
        assert (copy / "lib" / "version.py").read_text() == "VERSION = 1\n" and not (copy / "data").exists()
    logs = run("logs", "s1")
    assert logs.count("VERSION=1 in ") == 2 and "/outputs/s1/code rank 0" in logs and "rank 1" in logs
    first = JobCode.objects.get(job=job)
    # (what an earlier test on these nodes already sent them is not sent again)
    assert 0 < first.sync_sent_bytes <= 2 * code_bytes and first.sync_s is not None and first.sync_files == 4
    # when one file changes, only it travels, and every node runs the new version
    (project / "lib" / "version.py").write_text("VERSION = 2\n")
    run("launch", "--name", "s2", "--nodes", "2", "--sync", str(project), "--script", "train.py", "--detach")
    second = finish(Job.objects.get(name="s2"))
    assert second.state == Job.State.SUCCEEDED and run("logs", "s2").count("VERSION=2 in ") == 2
    assert JobCode.objects.get(job=second).sync_sent_bytes == 2 * len("VERSION = 2\n")
    # and each job records what ran: the synced directory, its git commit (the uncommitted diff too), per node versions
    record = json.loads(run("results", "s2", "--json"))["code"]
    assert record["sync"]["source"] == str(project) and record["git"]["branch"] == "main"
    assert record["git"]["dirty"] is True and "+VERSION = 2" in record["git"]["diff"]
    assert json.loads(run("results", "s1", "--json"))["code"]["git"]["dirty"] is False
    nodes = record["nodes"]
    env_python = subprocess.run([f"{NODE_ENV}/bin/python", "-c", "import platform; print(platform.python_version())"],
                                capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert len(nodes) == 2 and {v["python"] for v in nodes.values()} == {env_python}
    assert all(v["torch"].startswith("2.13.0") and v["packages_count"] > 5 for v in nodes.values())
    assert len({v["packages_sha256"] for v in nodes.values()}) == 1  # the same env on both
    assert len({v["script_sha256"] for v in nodes.values()}) == 1
    packages = JobCode.objects.get(job=second).packages
    assert any(p.startswith("torch==2.13.0") for p in next(iter(packages.values())))
    # and an unchanged tree copies nothing
    run("launch", "--name", "s3", "--nodes", "2", "--sync", str(project), "--script", "train.py", "--detach")
    third = finish(Job.objects.get(name="s3"))
    assert third.state == Job.State.SUCCEEDED and JobCode.objects.get(job=third).sync_sent_bytes == 0
    status = run("status", "s3")
    assert f"code: {project} synced (4 files" in status and "(0 bytes sent)" in status


def test_a_script_that_differs_between_nodes_is_refused_by_name(lab):
    """Covers: a script whose copies differ on two real nodes refused by pre-flight with both hashes, then run with
    --allow-mismatch keeping each hash.
    """
    # given two nodes whose copies of a script differ (no sync)
    for i, node in enumerate(lab.nodes[:2]):
        tree(Path(node.workdir), {"train/differs.py": f"print('copy {i}')\n"})
    # when it is launched on both, pre-flight refuses it, naming both nodes and their hashes
    with pytest.raises(CommandError) as err:
        run("launch", "--name", "m1", "--node", "node1", "--node", "node2", "--script", "train/differs.py", "--detach")
    message = str(err.value)
    assert "script train/differs.py differs between nodes: node1 sha256 " in message and ", node2 sha256 " in message
    assert "--allow-mismatch" in message and "Nothing was started" in message
    # and with --allow-mismatch it runs, each node's hash kept with the job
    run("launch", "--name", "m2", "--node", "node1", "--node", "node2", "--script", "train/differs.py",
        "--allow-mismatch", "--detach")  # fmt: skip
    job = finish(Job.objects.get(name="m2"))
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    hashes = {n: v["script_sha256"] for n, v in JobCode.objects.get(job=job).nodes.items()}
    assert len(set(hashes.values())) == 2 and set(hashes) == {"node1", "node2"}


def test_bad_sync_input_is_refused_in_one_line_and_leaves_nothing_behind(project, lab, tmp_path, monkeypatch):
    """Covers: `launch --sync` refusing a bad directory, a symlink out, an oversize tree or a missing script in one line
    before any node is asked (the rules alone are tests/test_sync.py's; a fast test could hold it).
    """

    def refused(*args: str) -> str:
        with pytest.raises(CommandError) as err:
            run("launch", "--name", "bad", "--nodes", "2", "--script", "train.py", "--detach", *args)
        assert "\n" not in str(err.value).strip() and not Job.objects.exists() and not JobCode.objects.exists()
        return str(err.value)

    assert "outside the directories UGRO may sync" in refused("--sync", "/etc")
    assert "not a directory" in refused("--sync", str(project / "train.py"))
    outside = tmp_path / "secret.txt"
    outside.write_text("s")
    (project / "leak.txt").symlink_to(outside)
    assert "leak.txt is a symlink out of the tree" in refused("--sync", str(project))
    (project / "leak.txt").unlink()
    monkeypatch.setattr(manifest, "LIMIT_BYTES", 40)
    assert "over the 0 MB limit; biggest: train.py" in refused("--sync", str(project))
    monkeypatch.undo()
    assert "script nope.py is not in" in refused("--sync", str(project), "--script", "nope.py")


def test_a_node_that_cannot_take_the_code_fails_the_attempt_before_any_rank_starts(project, lab):
    """Covers: a node's agent unable to build the job's copy (a file in its way): the attempt fails naming that node
    before any rank starts.
    """
    # given a second node where the job's copy cannot be made (a file stands where its directory goes)
    blocker = Path(lab.nodes[1].workdir) / "outputs" / "nocopy"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("in the way")
    try:
        with pytest.raises(CommandError, match=r"code sync failed on node2: .*Nothing was started"):
            run("launch", "--name", "nocopy", "--node", "node1", "--node", "node2", "--sync", str(project),
                "--script", "train.py", "--detach")  # fmt: skip
        job = Job.objects.get(name="nocopy")
        assert job.state == Job.State.FAILED and job.failure_kind == "PREFLIGHT" and job.running_at is None
        assert not job.ranks.exclude(pid=None).exists()
        assert "node1" not in job.failure_reason.split("code sync failed on ", 1)[1].split(":")[0]
    finally:
        blocker.unlink()


def test_a_node_the_openssh_client_refuses_fails_the_attempt_in_one_line_and_keeps_nothing(project, lab, tmp_path,
                                                                                          monkeypatch):  # fmt: skip
    """Covers: the OpenSSH client refusing a node's host key on the transfer path's first hop (ssh -W from the
    controller): the attempt fails in one line naming the node, no object nor copy kept on either node.
    """
    # given an OpenSSH client that meets another host key than the one pinned for node1, the chain's first hop (the
    # hops after it are node to node, not through the OpenSSH client), and a tree over 1 MB
    from cluster import links

    fake = tmp_path / "ssh"
    fake.write_text(f'#!/bin/sh\ncase "$*" in *{lab.nodes[0].address}*) echo "Host key verification failed." >&2; '
                    f'exit 255;; esac\nexec {links.SSH_CLIENT} "$@"\n')  # fmt: skip
    fake.chmod(0o755)
    monkeypatch.setattr(links, "SSH_CLIENT", str(fake))
    (project / "assets").mkdir()
    (project / "assets" / "vocab.bin").write_bytes(os.urandom(1_500_000))
    # when it is launched on node1 and node2, the launch fails naming node1's key, before any rank starts
    with pytest.raises(CommandError) as err:
        run("launch", "--name", "wrongkey", "--node", "node1", "--node", "node2", "--sync", str(project),
            "--script", "train.py", "--detach")  # fmt: skip
    message = str(err.value).strip()
    assert "code sync failed on node1: node1 (" in message and "host key changed" in message and "\n" not in message
    job = Job.objects.get(name="wrongkey")
    assert job.state == Job.State.FAILED and not job.ranks.exclude(pid=None).exists()
    # and neither node kept the tree's large object, nor the job's copy
    vocab = hashlib.sha256((project / "assets" / "vocab.bin").read_bytes()).hexdigest()
    for node in lab.nodes[:2]:
        assert not (Path(node.workdir) / ".ugro" / "objects" / vocab).exists()
        assert not (Path(node.workdir) / "outputs" / "wrongkey" / "code").exists()


@pytest.mark.parametrize("client", ["openssh", "the link's own connection"])
def test_a_node_whose_sshd_forwards_nothing_takes_the_code_by_a_direct_connection(project, lab, client,
                                                                                   monkeypatch):  # fmt: skip
    """Covers: a tree over 1 MB going by the transfer path to two real nodes, arriving whole with nothing of the
    transfer left, node2's sshd forwarding nothing (AllowTcpForwarding no): through the OpenSSH client or on the
    link's own connection to the first hop, node to node to the second; where node2 leads the chain, the controller
    connects straight to its listener (jobs/transfer.py _direct).
    """
    from cluster import links
    from cluster.models import Node

    # given node2's sshd set to forward no connections (AllowTcpForwarding no), node1's as it was, and a tree
    # over 1 MB (a stream), through the OpenSSH client or the link's own connection
    node = lab.nodes[1]
    original = node.config.read_text()
    node.config.write_text(original + "AllowTcpForwarding no\n")
    node.stop()
    node.start()
    links.pool.close_all()
    try:
        if client != "openssh":
            monkeypatch.setattr(links, "SSH_CLIENT", None)
        weights = os.urandom(1_500_000)
        (project / "assets").mkdir()
        (project / "assets" / "vocab.bin").write_bytes(weights)
        tree(project, {f"configs/c{i}.yaml": f"lr: {i}\n" for i in range(40)})
        order = ["node1", "node2"] if client == "openssh" else ["node2", "node1"]
        run("launch", "--name", "noforward", "--node", order[0], "--node", order[1], "--sync", str(project),
            "--script", "train.py", "--detach")  # fmt: skip
        job = finish(Job.objects.get(name="noforward"))
        # then both nodes have the copy whole and ran it; every byte arrived, checked, and the nodes' stores hold
        # nothing of the transfer left over
        assert job.state == Job.State.SUCCEEDED, job.failure_reason
        total = sum(f["size"] for f in manifest.build(str(project)).files)  # less what earlier tests' runs left there
        # the controller sent the tree's new objects once: the second node took them from the first
        assert len(weights) <= JobCode.objects.get(job=job).sync_sent_bytes <= total
        for rank in job.ranks.select_related("node"):
            copy = Path(rank.node.workdir) / "outputs" / "noforward" / "code"
            assert (copy / "assets" / "vocab.bin").read_bytes() == weights and (copy / "configs" / "c39.yaml").exists()
            assert not os.listdir(Path(rank.node.workdir) / ".ugro" / "objects" / ".xfer")
        # (node2's link learns its sshd refuses forwarding only when node2 is the chain's first hop: the chain's order
        # is the attempt's node order, not --node's, so either node may lead)
        assert Node.objects.get(name="node1").link().forward_refused is False
    finally:
        node.config.write_text(original)
        node.stop()
        node.start()
        links.pool.close_all()
