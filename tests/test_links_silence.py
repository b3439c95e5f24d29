"""A silent node never stalls the requests queued behind it: a link whose request went unanswered fails the
others at once (not sent: the node counts as unreachable); a link merely busy with a long request makes them
wait their turn; a failed connection is not tried again within the connect timeout. Local agents (no SSH) with
test ops sent ahead of agent.py."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from cluster.fanout import unreachable
from cluster.links import Endpoint, LinkBusy, LinkError, NodeLink

OPS = b"""
import time as _test_time
def _test_freeze(req):
    _test_time.sleep(req.get("seconds", 30))
    return {}
EXTRA_OPS = dict(globals().get("EXTRA_OPS", {}), freeze=_test_freeze)
"""


@pytest.fixture
def link():
    made = NodeLink(Endpoint(name="box", address="127.0.0.1", transport="local", python=sys.executable),
                    connect_timeout=1.0, extra_source=OPS)  # fmt: skip
    yield made
    made.close()


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["result"] = fn()
        except Exception as exc:
            out["error"] = exc
        out["took"] = time.monotonic() - t0

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def fake_python(tmp_path: Path, name: str, then: str) -> tuple[Path, Path]:
    """A node 'python' that counts each agent start in a file, then runs `then` (never the agent)."""
    attempts = tmp_path / f"{name}-attempts"
    fake = tmp_path / name
    fake.write_text(f"#!/bin/sh\necho try >> {attempts}\n{then}\n")
    fake.chmod(0o755)
    return fake, attempts


def tries(attempts: Path) -> int:
    return attempts.read_text().count("try") if attempts.exists() else 0


def test_a_request_behind_an_unanswered_one_fails_at_once(link):
    # given a node that already left one request unanswered (the link is marked silent)
    with pytest.raises(LinkError) as first:
        link.request("freeze", timeout=0.5, seconds=30)
    assert first.value.delivered and link.silent_since is not None
    # and another request that holds the link now, waiting for an answer that will not come
    holder, held = in_thread(lambda: link.request("freeze", timeout=4, seconds=30))
    time.sleep(0.3)
    # when a third request comes (as the health poll's or the reconciler's would)
    queued, out = in_thread(lambda: link.request("hello", timeout=10))
    queued.join(timeout=10)
    # then it fails at once, not after the holder's 4 s or its own 10 s, and says the node is not answering;
    # one late answer is not yet proof that the node is unreachable (an overloaded controller reads late too)
    assert isinstance(out.get("error"), LinkBusy) and out["took"] < 2.0, out
    assert "not answering" in str(out["error"]) and not unreachable(out["error"])
    holder.join(timeout=10)
    assert isinstance(held.get("error"), LinkError)


def test_once_a_connection_got_no_answer_the_requests_behind_it_are_unreachable(tmp_path):
    # given a node that takes connections but never answers, whose first connection got no answer
    fake, attempts = fake_python(tmp_path, "mute", "exec sleep 30")
    link = NodeLink(Endpoint(name="box", address="127.0.0.1", transport="local", python=str(fake)), 1.0)
    try:
        with pytest.raises(LinkError):
            link.request("hello", timeout=1)
        # when a follower's read comes while it is silent, it is not even tried
        with pytest.raises(LinkError) as skipped:
            link.request("tail", timeout=5, when_silent=False, files=[])
        assert unreachable(skipped.value) and tries(attempts) == 1
        # and a request that finds another one trying to connect again fails at once, as unreachable
        time.sleep(1.1)
        holder, _ = in_thread(lambda: link.request("hello", timeout=1))
        time.sleep(0.3)
        queued, out = in_thread(lambda: link.request("hello", timeout=10))
        queued.join(timeout=10)
        holder.join(timeout=10)
        assert isinstance(out.get("error"), LinkError) and unreachable(out["error"]) and out["took"] < 1.5, out
    finally:
        link.close()


def test_a_request_behind_a_long_answered_one_waits_its_turn_and_a_busy_link_is_not_silence(link):
    link.request("hello", timeout=5)
    # given a long request on a node that answers it
    holder, held = in_thread(lambda: link.request("freeze", timeout=5, seconds=1.5))
    time.sleep(0.2)
    # when a request with room to wait comes, it gets its turn and its answer
    patient, out = in_thread(lambda: link.request("hello", timeout=10))
    # and one with too little room is told the link was busy, which is not the node's silence
    with pytest.raises(LinkBusy) as busy:
        link.request("hello", timeout=0.5)
    assert not unreachable(busy.value)
    patient.join(timeout=10)
    holder.join(timeout=10)
    assert "result" in held and "result" in out, (held, out)
    assert link.silent_since is None


def test_a_connection_that_got_no_answer_is_not_tried_again_within_the_connect_timeout(tmp_path):
    # given a node that takes the connection but never answers (its agent never says hello)
    fake, attempts = fake_python(tmp_path, "mute", "exec sleep 30")
    link = NodeLink(Endpoint(name="box", address="127.0.0.1", transport="local", python=str(fake)), 1.0)
    try:
        with pytest.raises(LinkError) as first:
            link.request("hello", timeout=1)
        assert unreachable(first.value) and link.silent_since is not None
        # when another request comes at once, it fails with the same reason without trying
        t0 = time.monotonic()
        with pytest.raises(LinkError, match="tried 0 s ago") as again:
            link.request("hello", timeout=1)
        assert unreachable(again.value) and time.monotonic() - t0 < 0.5
        assert tries(attempts) == 1
        # and after the connect timeout it is tried again
        time.sleep(1.1)
        with pytest.raises(LinkError):
            link.request("hello", timeout=1)
        assert tries(attempts) == 2
    finally:
        link.close()


def test_a_node_that_refuses_is_tried_every_time_and_an_answer_clears_silence(tmp_path):
    # given a node that refuses (its agent exits at once): that is an answer, so no request is held back
    fake, attempts = fake_python(tmp_path, "refusing", "exit 1")
    link = NodeLink(Endpoint(name="box", address="127.0.0.1", transport="local", python=str(fake)), 1.0)
    try:
        for _ in range(2):
            with pytest.raises(LinkError):
                link.request("hello", timeout=1)
        assert tries(attempts) == 2 and link.silent_since is None
    finally:
        link.close()
    # when a node that was silent answers again, the link is no longer silent
    fixed = NodeLink(Endpoint(name="box", address="127.0.0.1", transport="local", python=sys.executable), 1.0)
    fixed.silent_since = time.monotonic() - 30
    try:
        fixed.request("hello", timeout=5)
        assert fixed.silent_since is None
    finally:
        fixed.close()


def test_a_probe_that_finds_the_link_busy_is_no_failure_towards_down(monkeypatch):
    from cluster import monitor
    from cluster.health import Breaker

    def busy(node):
        raise LinkBusy("box (local): busy with another request for 5 s; hello not sent")

    monkeypatch.setattr(monitor, "_probe", busy)
    breaker = Breaker()
    sample, _, error, went_down = monitor.probe_node(object(), breaker, time.time())
    assert sample is None and "busy" in error and not went_down
    assert breaker.failures == 0


def test_a_local_node_that_never_reads_its_agent_is_silent_within_the_timeout_however_long_the_agent(tmp_path):
    # given a local node's python that never reads, and an agent's source past a pipe's default 64 KiB
    fake, attempts = fake_python(tmp_path, "mute", "exec sleep 30")
    padding = b"#" + b"x" * (200 * 1024) + b"\n"
    link = NodeLink(Endpoint(name="box", address="127.0.0.1", transport="local", python=str(fake)), 1.0,
                    extra_source=padding)  # fmt: skip
    try:
        # when a request is made, the connect does not block on the full pipe: it fails as silence
        caught, out = in_thread(lambda: link.request("hello", timeout=1))
        caught.join(timeout=20)
        assert not caught.is_alive() and isinstance(out.get("error"), LinkError), out
        assert tries(attempts) == 1
    finally:
        link.close()


def test_an_answer_buffered_after_the_channels_signal_was_cleared_is_still_read():
    """paramiko signals a channel's stdout and stderr through one pipe: a stderr read that clears it while an
    answer is being fed in (the feed signals before it appends) leaves the answer buffered, the pipe silent."""
    import json
    import os

    from cluster.links import _Pipe

    quiet_r, quiet_w = os.pipe()  # the channel's signal: never readable again
    answer = json.dumps({"id": 7, "ok": True, "result": {"answered": True}}).encode() + b"\n"
    buffered = threading.Event()
    threading.Timer(0.3, buffered.set).start()  # the answer lands in the buffer after the signal was cleared

    def recv(n: int) -> bytes:
        assert buffered.is_set()
        return answer

    link = NodeLink(Endpoint(name="box", address="127.0.0.1", transport="local", python=sys.executable))
    link._pipe = _Pipe(lambda data: None, recv, lambda: quiet_r, lambda: None, lambda: "", lambda: True,
                       pending=buffered.is_set)  # fmt: skip
    try:
        # then the wait for the answer finds it (before, it waited for the pipe until its deadline: _NoAnswer)
        assert link._answer(7, timeout=20) == {"answered": True}
    finally:
        link._pipe = None
        os.close(quiet_r)
        os.close(quiet_w)
