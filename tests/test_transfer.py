"""The one transfer path (jobs/transfer.py, cluster/node/transfer.py) and --data (jobs/data.py), on nodes whose
agents are local processes: chains, chunks checked on arrival, resume from the chunks held, room checked first,
node to node, shared working directories, and the data placed read-only in the job's directory."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tests.test_sync import local_nodes, recorded  # noqa: F401 (a fixture)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 KiB, so that files of a few hundred kB travel as many chunks."""
    from jobs import transfer

    monkeypatch.setattr(transfer, "CHUNK", 64 << 10)
    return 64 << 10


def dataset(root: Path, sizes: dict[str, int]) -> Path:
    for name, size in sizes.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    return root


def objects_of(root: Path, chunk: int):
    from jobs import transfer

    objs = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        sums = [sha(data[i : i + chunk]) for i in range(0, len(data), chunk)] if len(data) > chunk else []
        objs.append(transfer.Obj(sha(data), len(data), sums, str(path), path.stat().st_mtime_ns))
    return objs


def store(workdir: Path) -> Path:
    return workdir / ".ugro" / "objects"


def test_objects_reach_every_node_once_from_the_controller_then_node_to_node_and_a_second_delivery_sends_nothing(
    db, tmp_path, small_chunks, recorded  # noqa: F811
):
    from jobs import transfer

    # given three nodes with their own working directories and a dataset of several chunked files
    data = dataset(tmp_path / "ds", {"a.bin": 300_000, "sub/b.bin": 70_000, "c.txt": 10})
    objs = objects_of(data, small_chunks)
    nodes = local_nodes({f"n{i}": tmp_path / f"w{i}" for i in range(3)})
    sent = recorded(transfer)
    # when the objects are delivered
    got = transfer.deliver(objs, nodes)
    # then every node's store holds each object whole, read-only, and the controller sent the bytes once (one chain)
    size = sum(o.size for o in objs)
    for i in range(3):
        for o in objs:
            obj = store(tmp_path / f"w{i}") / o.sha
            assert sha(obj.read_bytes()) == o.sha and not os.access(obj, os.W_OK) or os.geteuid() == 0
            assert sha(obj.read_bytes()) == o.sha
    assert got.controller_bytes == size and got.peer_bytes == 0 and got.rounds == 1
    assert got.relayed_bytes == 2 * size  # node 1 passed it to node 2, node 2 to node 3
    assert sorted(op for _, op in sent if op == "xfer_listen") == ["xfer_listen"] * 3
    # and a second delivery asks and sends nothing
    again = transfer.deliver(objs, nodes)
    assert again.controller_bytes == 0 and again.rounds == 0
    # and a fourth node joining later is sent them by a node that holds them, not by the controller
    late = local_nodes({"n3": tmp_path / "w3"})
    third = transfer.deliver(objs, [*nodes, *late])
    assert third.controller_bytes == 0 and third.peer_bytes == size
    assert all(sha((store(tmp_path / "w3") / o.sha).read_bytes()) == o.sha for o in objs)


def test_a_cut_transfer_resumes_from_the_chunks_held_and_a_corrupted_chunk_is_not_kept(db, tmp_path, small_chunks):
    from jobs import transfer

    data = dataset(tmp_path / "ds", {"big.bin": 640_000})
    (obj,) = objects_of(data, small_chunks)
    raw = (data / "big.bin").read_bytes()
    node, other = local_nodes({"n0": tmp_path / "w0", "n1": tmp_path / "w1"})
    # given n0 holding the first 4 chunks (as a cut transfer leaves them) and 100 bytes of a fifth, unchecked
    part = store(tmp_path / "w0") / ".xfer" / obj.sha
    part.parent.mkdir(parents=True)
    part.write_bytes(raw[: 4 * small_chunks + 100])
    (part.parent / f"{obj.sha}.ok").write_text(str(4 * small_chunks))
    # and n1 holding 2 chunks whose second is corrupted on disk though recorded as checked
    part1 = store(tmp_path / "w1") / ".xfer" / obj.sha
    part1.parent.mkdir(parents=True)
    part1.write_bytes(raw[:small_chunks] + b"\0" * small_chunks)
    (part1.parent / f"{obj.sha}.ok").write_text(str(small_chunks))
    # when it is delivered to both
    got = transfer.deliver([obj], [node, other])
    # then the stream started at the smaller held offset: the bytes resent are those n1 lacked, not the file
    assert got.controller_bytes == obj.size - small_chunks
    for w in ("w0", "w1"):
        assert sha((store(tmp_path / w) / obj.sha).read_bytes()) == obj.sha
        assert not (store(tmp_path / w) / ".xfer" / obj.sha).exists()


def test_a_chunk_that_arrives_corrupted_is_refused_in_one_line_and_nothing_half_written_is_used(
    db, tmp_path, small_chunks, monkeypatch
):
    from jobs import transfer

    data = dataset(tmp_path / "ds", {"big.bin": 200_000})
    (obj,) = objects_of(data, small_chunks)
    obj.chunks[1] = "0" * 64  # the controller's record of chunk 1 does not match its bytes
    (node,) = local_nodes({"n0": tmp_path / "w0"})
    monkeypatch.setattr(transfer, "ROUNDS", 2)
    with pytest.raises(transfer.TransferError) as err:
        transfer.deliver([obj], [node], what="data ds")
    assert str(err.value).startswith("data ds transfer failed on n0: chunk 1 of object ")
    assert "arrived corrupted" in str(err.value) and "\n" not in str(err.value)
    assert not (store(tmp_path / "w0") / obj.sha).exists()
    # the chunk before it was checked and is kept for the next try
    assert (store(tmp_path / "w0") / ".xfer" / f"{obj.sha}.ok").read_text() == str(small_chunks)


def test_a_node_without_room_is_refused_before_any_byte_is_sent(db, tmp_path, small_chunks, monkeypatch,
                                                                  recorded):  # noqa: F811
    from jobs import transfer

    data = dataset(tmp_path / "ds", {"big.bin": 100_000})
    objs = objects_of(data, small_chunks)
    nodes = local_nodes({"n0": tmp_path / "w0", "n1": tmp_path / "w1"})
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    monkeypatch.setattr(transfer, "FREE_MARGIN", free)  # no disk has this much left over
    sent = recorded(transfer)
    with pytest.raises(transfer.TransferError) as err:
        transfer.deliver(objs, nodes, what="data ds")
    assert str(err.value).startswith("n0 needs 0.1 MB for the data ds, ") and "; n1 needs" in str(err.value)
    assert {op for _, op in sent} == {"xfer_have"}
    assert not (store(tmp_path / "w0") / objs[0].sha).exists()


def test_nodes_sharing_a_working_directory_receive_once_and_a_peer_that_cannot_be_reached_gets_it_from_the_controller(
    db, tmp_path, small_chunks, recorded, monkeypatch  # noqa: F811
):
    from jobs import transfer

    data = dataset(tmp_path / "ds", {"a.bin": 150_000})
    objs = objects_of(data, small_chunks)
    shared = tmp_path / "shared"
    (shared / ".ugro").mkdir(parents=True)
    (shared / ".ugro" / "workdir-id").write_text("d" * 32 + "\n")
    nodes = local_nodes({"s1": shared, "s2": shared, "own": tmp_path / "own"})
    # given the node that holds it already (own) cannot reach the shared ones' listeners (an address no one answers)
    (store(tmp_path / "own")).mkdir(parents=True)
    (store(tmp_path / "own") / objs[0].sha).write_bytes((data / "a.bin").read_bytes())
    nodes[0].address = "192.0.2.1"  # its peers connect here (refused); its own link is local
    nodes[0].save()
    sent = recorded(transfer)
    got = transfer.deliver(objs, nodes)
    # then the shared directory received it once, from the controller after the node-to-node hop failed
    assert [n for n, op in sent if op == "xfer_listen"].count("s2") == 0
    assert got.controller_bytes == objs[0].size and got.rounds == 2
    assert sha((store(shared) / objs[0].sha).read_bytes()) == objs[0].sha


def test_data_items_are_parsed_and_bad_ones_refused_in_one_line(db, tmp_path, settings):
    from cluster.models import ClusterSettings
    from jobs import data

    names = {"gpu1"}
    assert data.parse("~/ds/tiny", names).as_dict() == {"src": "~/ds/tiny", "dest": "tiny", "node": ""}
    assert data.parse("/data/x:inputs/x", names).dest == "inputs/x"
    assert data.parse("gpu1:/mnt/models/llama:model", names).as_dict() == {
        "src": "/mnt/models/llama", "dest": "model", "node": "gpu1"}  # fmt: skip
    for bad, says in [("", "needs SRC"), ("/d:../up", "escapes the job's directory"), ("/d:/abs", "escapes"),
                      ("/d:code/x", "is UGRO's"), ("/d:.ugro", "is UGRO's"), ("a:b:c", "at most one ':'")]:  # fmt: skip
        with pytest.raises(data.DataError) as err:
            data.parse(bad, names)
        assert says in str(err.value) and "\n" not in str(err.value)
    cs = ClusterSettings.load()
    cs.paths = {"sync_roots": [str(tmp_path)]}
    with pytest.raises(data.DataError, match="no such file or directory on the controller"):
        data.check([data.parse(str(tmp_path / "missing"), names)], cs)
    with pytest.raises(data.DataError, match="outside the directories UGRO may sync"):
        data.check([data.parse("/etc", names)], cs)
    (tmp_path / "a").mkdir()
    with pytest.raises(data.DataError, match="two items at"):
        data.check([data.parse(f"{tmp_path}/a:x", names), data.parse(f"{tmp_path}/a:x/y", names)], cs)


def test_a_jobs_data_is_placed_read_only_on_every_node_from_a_controller_dir_and_from_a_nodes_path(
    db, tmp_path, settings, small_chunks
):
    from cluster.models import ClusterSettings
    from jobs import data
    from jobs.models import Job, JobCode

    settings.DATA_DIR = tmp_path / "data"
    cs = ClusterSettings.load()
    cs.paths = {"sync_roots": [str(tmp_path)]}
    cs.save()
    ds = dataset(tmp_path / "ds", {"train.bin": 200_000, "meta/info.json": 50})
    nodes = local_nodes({f"n{i}": tmp_path / f"w{i}" for i in range(3)})
    weights = dataset(tmp_path / "w1" / "models" / "m", {"model.safetensors": 90_000, "config.json": 20})
    job = Job.objects.create(name="dj", script="train.py")
    JobCode.objects.create(job=job, data=[{"src": str(ds), "dest": "ds", "node": ""},
                                          {"src": str(tmp_path / "w1/models/m"), "dest": "model", "node": "n1"}])
    got = data.deliver(job, nodes)
    for i in range(3):
        out = tmp_path / f"w{i}" / "outputs" / "dj"
        assert (out / "ds" / "train.bin").read_bytes() == (ds / "train.bin").read_bytes()
        assert (out / "model" / "model.safetensors").read_bytes() == (weights / "model.safetensors").read_bytes()
        assert oct((out / "ds" / "meta" / "info.json").stat().st_mode & 0o222) == "0o0"
    # the model left n1 once, to the other two in one chain; the dataset left the controller once; node to node: the
    # model's two hops and the dataset's two relays
    assert got.controller_bytes == 200_050 and got.peer_bytes == 2 * 90_020 + 2 * 200_050
    code = JobCode.objects.get(job=job)
    assert code.transfer["stage"] == "done" and code.data[0]["files"] == 2
    line = data.summary(code)
    assert line.startswith(f"data: {ds} -> ds, n1:{tmp_path}/w1/models/m -> model (290 kB), delivered in ")
    assert line.endswith(" (200 kB from the controller, 580 kB node to node)")
    # a second attempt's delivery sends nothing
    again = data.deliver(job, nodes)
    assert again.controller_bytes == 0 and again.peer_bytes == 0


def test_cluster_yaml_training_data_is_checked_at_import_in_one_line(db):
    from cluster.config_yaml import ConfigError, import_cluster

    base = ("cluster:\n  name: lab\n  master_ip: 127.0.0.1\nnodes:\n  gpu1:\n    ip: 127.0.0.2\n    role: master\n"
            "training:\n  data:\n")  # fmt: skip
    import_cluster(base + "    - ~/datasets/tiny:tiny\n    - gpu1:/mnt/models/m:model\n")
    refused = [("    - /d:../up\n", "escapes the job's directory"), ("    - 3\n", "must be a list of SRC[:DEST]")]
    for bad, says in refused:
        with pytest.raises(ConfigError) as err:
            import_cluster(base + bad)
        assert says in str(err.value) and "training" in str(err.value) and "\n" not in str(err.value)


def test_a_listener_drops_a_connection_without_its_token_unread_and_takes_the_one_with_it(tmp_path):
    import json
    import socket

    from cluster.links import Endpoint, NodeLink

    agent = NodeLink(Endpoint(name="local-agent", address="127.0.0.1", transport="local"), connect_timeout=10)
    try:
        root, data = tmp_path / "store", b"not for a stranger\n"
        listen = agent.request("xfer_listen", store=str(root), name="n", bind="127.0.0.1")
        body = json.dumps({"objects": [{"sha": sha(data), "size": len(data), "offset": 0, "chunks": []}],
                           "chunk": 8 << 20, "rest": []}).encode()  # fmt: skip
        stream = b"%d\n" % len(body) + body + data
        # given a process that finds the port, without the token (none, a guess, the token cut short)
        for token in (b"", b"0" * 48 + b"\n", listen["token"][:-1].encode() + b"\n"):
            with socket.create_connection(("127.0.0.1", listen["port"]), timeout=15) as sock:
                # then its stream is dropped unread: no answer, nothing written in the store
                try:
                    sock.sendall(token + stream)
                    sock.shutdown(socket.SHUT_WR)
                    answer = sock.recv(100)
                except OSError:  # reset, or no longer connected
                    answer = b""
            assert answer == b"" and not (root / sha(data)).exists() and not os.listdir(root / ".xfer")
        # and the controller's stream, with the token, still reaches the store
        rc, answer = agent.forward(listen["port"], f"{listen['token']}\n".encode() + stream, [], 30)
        assert (rc, json.loads(answer)) == (0, {"n": None})
        assert (root / sha(data)).read_bytes() == data
    finally:
        agent.close()


def test_a_launch_still_preparing_its_nodes_keeps_its_job_starting_and_stops_saying_so_when_done(
    transactional_db, monkeypatch
):
    # a delivery of tens of GB takes minutes: the starts loop must not take the launch for dead meanwhile
    import threading
    from datetime import timedelta

    from django.utils import timezone

    from jobs import lifecycle
    from jobs.models import Job

    monkeypatch.setattr(lifecycle, "HEARTBEAT_S", 0.05)
    old = timezone.now() - timedelta(minutes=10)
    job = Job.objects.create(name="slow", script="t.py", state=Job.State.STARTING, state_changed_at=old)
    with lifecycle.StillStarting(job):
        threading.Event().wait(0.3)
        moved = Job.objects.get(pk=job.pk).state_changed_at
    assert moved > old + timedelta(minutes=9)
    after = Job.objects.get(pk=job.pk).state_changed_at
    threading.Event().wait(0.2)
    assert Job.objects.get(pk=job.pk).state_changed_at == after  # stopped with the launch's preparation
