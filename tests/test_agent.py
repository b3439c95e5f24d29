"""The node agent's tail long poll, through a real agent process (the local transport's pipe)."""

from __future__ import annotations

import base64
import threading
import time

import pytest

from cluster.links import Endpoint, NodeLink


@pytest.fixture
def agent():
    link = NodeLink(Endpoint(name="local-agent", address="127.0.0.1", transport="local"), connect_timeout=10)
    yield link
    link.close()


def tail(link, path, offset=0, wait_ms=0, wait_above=0, exit_file=None):
    item = {"key": 1, "path": str(path), "offset": offset, "wait_above": wait_above, "max_bytes": 1 << 20}
    if exit_file:
        item["exit_file"] = str(exit_file)
    t0 = time.monotonic()
    result = link.request("tail", timeout=10, files=[item], wait_ms=wait_ms)["files"][0]
    return time.monotonic() - t0, base64.b64decode(result["data"]), result


def test_a_line_written_during_the_wait_is_answered_at_once(agent, tmp_path):
    log = tmp_path / "rank.log"
    log.write_bytes(b"old\n")

    def write_later():
        time.sleep(0.3)
        with open(log, "ab") as fh:
            fh.write(b"new line\n")

    writer = threading.Thread(target=write_later)
    writer.start()
    elapsed, data, _ = tail(agent, log, offset=4, wait_ms=4000)
    writer.join()
    assert data == b"new line\n"
    assert 0.25 <= elapsed < 2.0


def test_a_silent_log_waits_about_wait_ms_then_answers_empty(agent, tmp_path):
    log = tmp_path / "rank.log"
    log.write_bytes(b"a\n")
    elapsed, data, result = tail(agent, log, offset=2, wait_ms=400)
    assert data == b"" and result["eof"] and result["size"] == 2
    assert 0.35 <= elapsed < 2.0
    # no wait_ms: the old behaviour, an immediate answer
    elapsed, _, _ = tail(agent, log, offset=2)
    assert elapsed < 0.3


def test_data_already_there_is_answered_without_waiting(agent, tmp_path):
    log = tmp_path / "rank.log"
    log.write_bytes(b"one\ntwo\n")
    elapsed, data, _ = tail(agent, log, offset=0, wait_ms=4000)
    assert data == b"one\ntwo\n" and elapsed < 1.0


def test_a_partial_line_already_seen_does_not_end_the_wait_but_an_exit_does(agent, tmp_path):
    log, exit_file = tmp_path / "rank.log", tmp_path / "rank.exit"
    log.write_bytes(b"done\nprogress 10%")  # the caller took "done\n" and saw the partial line
    elapsed, data, _ = tail(agent, log, offset=5, wait_above=17, wait_ms=400, exit_file=exit_file)
    assert data == b"progress 10%" and elapsed >= 0.35
    exit_file.write_text('{"rc": 0, "ended": 1.0}')
    elapsed, data, result = tail(agent, log, offset=5, wait_above=17, wait_ms=4000, exit_file=exit_file)
    assert result["exit"] == {"rc": 0, "ended": 1.0} and elapsed < 1.0


def test_a_missing_log_waits_and_the_wait_is_capped(agent, tmp_path):
    elapsed, data, result = tail(agent, tmp_path / "not-yet.log", wait_ms=300)
    assert data == b"" and result["size"] is None and 0.25 <= elapsed < 2.0
    elapsed, _, _ = tail(agent, tmp_path / "not-yet.log", wait_ms=10**9)  # capped at MAX_TAIL_WAIT_MS (5 s)
    assert 4.5 <= elapsed < 8.0


def test_a_5_mib_line_without_a_newline_comes_back_whole_in_1_mib_reads(agent, tmp_path):
    log = tmp_path / "rank.log"
    line = bytes(range(256)) * (5 * 4096)  # 5 MiB, every byte value, no newline
    log.write_bytes(line.replace(b"\n", b"\r"))
    want = log.read_bytes()
    got, offset, reads = b"", 0, 0
    # when a follower reads it from successive offsets, 1 MiB at a time
    while reads < 10:
        _, data, result = tail(agent, log, offset=offset)
        reads += 1
        assert len(data) == min(1 << 20, len(want) - offset) and result["size"] == len(want)
        got, offset = got + data, offset + len(data)
        if result["eof"]:
            break
    # then it has every byte in order, in five reads, and the last one says end of file
    assert reads == 5 and got == want and b"\n" not in got


def test_release_before_frees_the_copied_part_of_a_log_its_writer_still_appends_to(agent, tmp_path):
    # given a 4 MiB log a process keeps appending to (O_APPEND, as the agent starts every process's output)
    import os

    log = tmp_path / "engine.log"
    writer = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(writer, b"x" * (4 << 20))
    # when a reader that has stored the first 4 MiB asks the next bytes and to release the first 3 MiB
    item = {"key": 1, "path": str(log), "offset": 4 << 20, "max_bytes": 1 << 20, "release_before": 3 << 20}
    answer = agent.request("tail", timeout=10, files=[item])["files"][0]
    # then their disk blocks are freed (a hole), while the size, the offsets and the newest MiB stay
    assert answer["released"] is True and answer["size"] == 4 << 20
    assert log.stat().st_size == 4 << 20 and log.stat().st_blocks * 512 <= (1 << 20) + 65536
    # and the writer goes on at the end, where the next read finds it
    os.write(writer, b"next line\n")
    os.close(writer)
    _, data, result = tail(agent, log, offset=4 << 20)
    assert data == b"next line\n" and log.read_bytes()[(3 << 20) :] == b"x" * (1 << 20) + b"next line\n"
    # a release never goes past what the reader said it has
    item = {"key": 1, "path": str(log), "offset": 0, "max_bytes": 16, "release_before": 4 << 20}
    assert agent.request("tail", timeout=10, files=[item])["files"][0]["released"] is True
    assert log.read_bytes()[(3 << 20) :] == b"x" * (1 << 20) + b"next line\n"


def test_the_env_report_is_kept_until_a_package_is_installed_or_removed(agent, tmp_path):
    import sys

    # given an env (<env>/bin/python, <env>/lib/python3.X/site-packages) and code that counts its runs
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").symlink_to(sys.executable)
    site = env / "lib" / "python3.99" / "site-packages"
    site.mkdir(parents=True)
    runs = tmp_path / "runs"
    code = f"import json; f = open({str(runs)!r}, 'a'); f.write('x'); f.close(); print(json.dumps({{'torch': '2'}}))"

    def report():
        return agent.request("env_report", timeout=30, python=str(env / "bin" / "python"), code=code)

    # when the pre-flight asks twice: the code ran once, the second answer is the kept one
    first, second = report(), report()
    assert first["stdout"].strip() == second["stdout"].strip() == '{"torch": "2"}'
    assert (first["cached"], second["cached"]) == (False, True) and runs.read_text() == "x"
    # when a package is installed (a dist-info directory appears) or removed: it runs again
    time.sleep(0.01)
    (site / "newpkg-1.0.dist-info").mkdir()
    assert report()["cached"] is False and runs.read_text() == "xx"
    assert report()["cached"] is True
    time.sleep(0.01)
    (site / "newpkg-1.0.dist-info").rmdir()
    assert report()["cached"] is False and runs.read_text() == "xxx"
    # an interpreter with no site-packages next to it: never kept
    bare = tmp_path / "bare" / "bin"
    bare.mkdir(parents=True)
    (bare / "python").symlink_to(sys.executable)
    again = [agent.request("env_report", timeout=30, python=str(bare / "python"), code=code) for _ in range(2)]
    assert [a["cached"] for a in again] == [False, False]
