"""Every failure explained: jobs.failure on real torchrun output (tests/data/failures, re-recorded by
tests/data/failures/record.py) and on what no torchrun should print but a node might."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from jobs.failure import (
    LINE_MAX,
    SUMMARY_MAX,
    Failure,
    FailureKind,
    RankFacts,
    _best,
    _bound,
    _candidates,
    _clean,
    _prepare,
    explain,
    parse_error_file,
)

RECORDINGS = Path(__file__).parent / "data" / "failures"
CASES = sorted(p.name for p in RECORDINGS.iterdir() if (p / "case.json").exists())
TAIL = 200  # what the controller keeps of a rank's output


def decisive_line(lines: list) -> str | None:
    """The line explain() would quote for these lines alone: the best candidate, cleaned and bounded."""
    best = _best(_candidates(_prepare(lines)))
    return _bound(_clean(best.line), LINE_MAX) if best else None


def recorded(case: str) -> tuple[list[RankFacts], dict | None]:
    """The facts the controller would hold for each rank of a recorded run, and the expected Failure."""
    doc = json.loads((RECORDINGS / case / "case.json").read_text())
    ranks = []
    for r in doc["ranks"]:
        error_file = (RECORDINGS / case / r["error_file"]).read_text() if r["error_file"] else None
        lines = (RECORDINGS / case / r["log"]).read_text(errors="replace").splitlines()
        ranks.append(
            RankFacts(
                index=r["index"],
                node=r["node"],
                state=r["state"],
                torchrun_rc=r["torchrun_rc"],
                signal=r["signal"],
                error_file=error_file,
                log_tail=lines[-TAIL:],
                lost_reason=r["lost_reason"],
            )
        )
    return ranks, doc["expected"]


def one_rank(case: str, recorded_node: str, **changes) -> RankFacts:
    """One node's facts from a recording, with some fields changed (to put it next to another recording)."""
    facts = next(r for r in recorded(case)[0] if r.node == recorded_node)
    for key, value in changes.items():
        setattr(facts, key, value)
    return facts


def assert_one_line(text: str, limit: int) -> None:
    assert "\n" not in text and "\r" not in text
    assert len(text) <= limit
    assert not re.search(r"[\x00-\x1f\x7f]", text)
    text.encode("utf-8")  # no lone surrogates: it must reach the database, an alert and Prometheus


def test_every_expected_recording_is_there():
    # given the cases the brief asks for, then each was recorded (a missing one would silently not be tested)
    assert {
        "oom_exit3",
        "oom_raise_record",
        "oom_then_abort",
        "torch_oom",
        "hip_oom",
        "mps_oom",
        "value_error",
        "sigkill_worker",
        "sigterm_worker",
        "sigterm_torchrun",
        "rendezvous_timeout",
        "nccl",
        "store_host_first",
        "success",
    } <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_recorded_failure_is_explained(case):
    # given what real torchrun left on each node
    ranks, expected = recorded(case)

    # when the job's failure is explained
    failure = explain(ranks)

    # then kind, first failing rank, the script's own exit code or signal and the decisive line are the true ones
    if expected is None:
        assert failure is None
        return
    assert failure is not None
    assert (failure.kind, failure.rank, failure.node) == (expected["kind"], expected["rank"], expected["node"])
    assert (failure.exit_code, failure.signal) == (expected["exit_code"], expected["signal"])
    if "line" in expected:
        assert failure.line == expected["line"]
    else:
        assert re.search(expected["line_re"], failure.line or ""), failure.line
    summary = failure.summary()
    assert summary.startswith(f"{expected['kind']} on rank {expected['rank']} ({expected['node']})")
    assert_one_line(summary, SUMMARY_MAX)


def test_oom_exit_code_is_the_scripts_own_not_torchruns():
    # given rank 1 printed a CUDA OOM and exited 3; torchrun itself exited 1
    ranks, _ = recorded("oom_exit3")
    assert [r.torchrun_rc for r in ranks] == [1, 1]

    # when explained
    summary = explain(ranks).summary()

    # then the summary carries the script's 3 and the OOM line
    assert summary.startswith(
        "OOM on rank 1 (node-b), exit code 3: RuntimeError: CUDA out of memory. Tried to allocate"
    )


def test_exception_then_abort_at_exit_is_the_exception_with_its_signal():
    # given a worker that printed an OOM traceback, then aborted at exit (SIGABRT, recorded for real)
    ranks, _ = recorded("oom_then_abort")
    assert "exitcode  : -6" in "\n".join(ranks[1].log_tail)
    assert explain(ranks).summary().startswith("OOM on rank 1 (node-b), signal 6 (SIGABRT): RuntimeError: CUDA out")

    # when the exception had been a plain ValueError instead, then it is a script error, with the same signal
    oom = "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    tail = [line.replace(oom, "ValueError: bad lr (") for line in ranks[1].log_tail]
    failure = explain([one_rank("oom_then_abort", "node-b", log_tail=tail, error_file=None)])
    assert (failure.kind, failure.exit_code, failure.signal) == (FailureKind.SCRIPT_ERROR, None, 6)
    assert failure.line.startswith("ValueError: bad lr (")


def test_consequences_on_a_lower_rank_do_not_hide_the_cause():
    # given rank 0 only saw its peer go away (gloo "Connection closed by peer", torchrun exit 1)
    survivor = one_rank("value_error", "node-a")
    assert "Connection closed by peer" in (decisive_line(survivor.log_tail) or "")

    # when it is explained alone, it is a communication failure; next to the rank that raised, that rank wins
    assert explain([survivor]).kind == FailureKind.NCCL
    failure = explain(recorded("value_error")[0])
    assert (failure.kind, failure.rank) == (FailureKind.SCRIPT_ERROR, 1)


def table(rank: int, code: int, name: str) -> list[str]:
    """torchrun's closing table for a worker that died of a signal."""
    return ["Root Cause (first observed failure):", "[0]:", "  time      : 2026-11-24_01:05:30",
            "  host      : localhost", f"  rank      : {rank} (local_rank: 0)",
            f"  exitcode  : -{code} (pid: 31581)  ({name})", "  error_file: <N/A>",
            f"  traceback : Signal {code} ({name}) received by PID 31581", "=" * 60]  # fmt: skip


def test_a_rank_that_aborts_after_its_peer_was_killed_does_not_hide_the_kill():
    # given rank 1's worker was killed (SIGKILL), and rank 0, whose gloo saw the peer go, aborted (SIGABRT:
    # gloo's std::terminate), as seen on loopback nodes
    gone = (
        "RuntimeError: Got the following error when running the callback: RuntimeError: [/__w/pytorch/pytorch/"
        "third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:17092."
    )
    survivor = RankFacts(index=0, node="node1", state="exited", torchrun_rc=1, signal=None, error_file=None,
                         log_tail=["error on rank 0:", "Traceback (most recent call last):",
                                   '  File "train.py", line 686, in train', "    loss.backward()", gone, "",
                                   "terminate called without an active exception", *table(0, 6, "SIGABRT")],
                         lost_reason=None)  # fmt: skip
    killed = RankFacts(index=1, node="node2", state="exited", torchrun_rc=1, signal=None, error_file=None,
                       log_tail=table(1, 9, "SIGKILL"), lost_reason=None)  # fmt: skip

    # when explained, whichever torchrun reported first, then the killed rank is the cause
    for ranks in ([survivor, killed], [killed, survivor]):
        failure = explain(ranks)
        assert (failure.kind, failure.rank, failure.node, failure.signal) == (FailureKind.KILLED, 1, "node2", 9)
    # alone, the aborted rank says its peer went away, with its own signal
    alone = explain([survivor])
    assert (alone.kind, alone.signal, alone.line) == (FailureKind.NCCL, 6, gone)
    # a rank that aborted on its own (no peer gone) is still a crash by that signal
    crashed = explain([RankFacts(index=0, node="node1", state="exited", torchrun_rc=1, signal=None, error_file=None,
                                 log_tail=table(0, 6, "SIGABRT"), lost_reason=None)])  # fmt: skip
    assert (crashed.kind, crashed.signal) == (FailureKind.KILLED, 6)


def test_store_host_exiting_first_is_not_blamed_on_the_rank_that_printed_the_trace():
    # given the node hosting the c10d store failed first; the other printed RendezvousConnectionError, exited 0
    other = one_rank("store_host_first", "node-b")
    assert other.torchrun_rc == 0
    assert any("RendezvousConnectionError" in line for line in other.log_tail)

    # when only that node is explained, then nothing failed there: exit codes decide, not stderr
    assert explain([other]) is None


def test_ranks_stopped_by_teardown_do_not_outrank_the_oom():
    # given rank 1 ran out of memory, then the teardown sent SIGTERM to rank 0's torchrun (a recorded one)
    oom = one_rank("oom_exit3", "node-b")
    stopped = one_rank("sigterm_torchrun", "node-b", index=0, node="node-a")
    assert explain([stopped]).kind == FailureKind.KILLED

    # when both are explained, then the OOM on the higher rank is the cause
    failure = explain([stopped, oom])
    assert (failure.kind, failure.rank, failure.exit_code) == (FailureKind.OOM, 1, 3)


def test_worker_stopped_by_sigterm_is_weaker_than_a_script_error():
    # given rank 0's workers died of SIGTERM (as when the job's processes are signalled) and rank 1 raised
    stopped = one_rank("sigterm_worker", "node-a")
    raised = one_rank("value_error", "node-b")

    # when explained, then the script error is the cause
    assert explain([stopped, raised]).kind == FailureKind.SCRIPT_ERROR


def test_lost_node_is_explained_with_its_reason_and_outranks_consequences():
    # given node-a stopped answering, and rank 1 only saw its peer disappear
    lost = RankFacts(index=0, node="gpu0", state="lost", lost_reason="ssh: connect to host 10.0.0.1: timed out")
    survivor = one_rank("value_error", "node-a", index=1, node="gpu1")

    # when explained
    failure = explain([survivor, lost])

    # then the lost node is the cause, with its reason
    assert (failure.kind, failure.rank, failure.node) == (FailureKind.NODE_LOST, 0, "gpu0")
    assert failure.summary() == "NODE_LOST on rank 0 (gpu0): ssh: connect to host 10.0.0.1: timed out"


def test_a_script_error_outranks_a_lost_node():
    # given rank 1 raised and node-a was then unreachable during teardown
    lost = RankFacts(index=0, node="node-a", state="lost", lost_reason=None)
    raised = one_rank("value_error", "node-b")

    # when explained, then the script error is the cause; a lost node without a reason still says something
    assert explain([lost, raised]).kind == FailureKind.SCRIPT_ERROR
    assert explain([lost]).line == "node stopped answering"


def test_running_or_successful_ranks_explain_nothing():
    # given ranks still running and ranks that exited 0
    ranks = [
        RankFacts(index=0, node="a", state="running"),
        RankFacts(index=1, node="b", state="exited", torchrun_rc=0),
    ]
    # when explained, then there is no failure
    assert explain(ranks) is None
    assert explain([]) is None


def test_error_file_alone_explains_an_oom_when_the_log_tail_is_empty():
    # given the script used @record: torchrun copied its error file (errorCode 1) and no log lines came back
    rank = one_rank("oom_raise_record", "node-b", log_tail=[])

    # when explained
    failure = explain([rank])

    # then the error file gives the kind, exit code and line
    assert (failure.kind, failure.exit_code) == (FailureKind.OOM, 1)
    assert failure.line.startswith("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB")


def test_parse_error_file_reads_what_torchrun_writes():
    # given the error files real torchrun wrote: a worker's (copied, with errorCode) and torchrun's own
    worker = parse_error_file((RECORDINGS / "oom_raise_record" / "node-b.error.json").read_text())
    agent = parse_error_file((RECORDINGS / "rendezvous_timeout" / "node-a.error.json").read_text())

    # then the worker's carries its exit code and call stack, torchrun's has no exit code
    assert worker["source"] == "worker" and worker["error_code"] == 1
    assert worker["message"].startswith("RuntimeError: CUDA out of memory.")
    assert worker["traceback"].startswith("Traceback (most recent call last):")
    assert isinstance(worker["timestamp"], int)
    assert agent["source"] == "torchrun" and agent["error_code"] is None
    assert agent["message"].startswith("RendezvousTimeoutError")
    # and the newer flat format is read too
    flat = parse_error_file('{"message": "RuntimeError: boom", "timestamp": "17", "errorCode": 3}')
    assert (flat["message"], flat["timestamp"], flat["error_code"]) == ("RuntimeError: boom", 17, 3)


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "{not json",
        "[]",
        '"a string"',
        '{"message": 5}',
        '{"message": {"message": ["x"], "errorCode": "three", "extraInfo": "none"}}',
        '{"message": {"message": "X", "errorCode": true, "extraInfo": {"timestamp": 1e99}}}',
        "[" * 100_000 + "]" * 100_000,
        b"\xff\xfe\x00garbage",
    ],
)
def test_malformed_error_file_never_raises(text):
    # given an error file torchrun did not write (truncated, hand-edited, binary, absurdly nested)
    # when parsed, then every key is there and holds nothing wrong
    parsed = parse_error_file(text)
    assert set(parsed) == {"message", "traceback", "error_code", "timestamp", "source"}
    assert parsed["error_code"] is None and parsed["timestamp"] is None

    # and a rank that left it next to a real OOM log is still an OOM
    rank = one_rank("oom_exit3", "node-b", error_file=text)
    assert explain([rank]).kind == FailureKind.OOM


def test_a_10_mb_line_without_newline_is_bounded():
    # given a rank whose only output is one 10 MB line, then one that starts with an OOM
    noise = RankFacts(index=0, node="a", state="exited", torchrun_rc=1, log_tail=["x" * 10_000_000])
    oom = RankFacts(
        index=1, node="b", state="exited", torchrun_rc=1, log_tail=["RuntimeError: CUDA out of memory. " + "y" * 10**7]
    )

    # when explained, then each gives a bounded one-line answer
    failure = explain([noise])
    assert failure.kind == FailureKind.UNKNOWN and len(failure.line) <= LINE_MAX
    assert_one_line(failure.summary(), SUMMARY_MAX)
    failure = explain([oom])
    assert failure.kind == FailureKind.OOM and failure.line.startswith("RuntimeError: CUDA out of memory.")
    assert len(failure.line) <= LINE_MAX
    assert_one_line(failure.summary(), SUMMARY_MAX)


def test_no_output_at_all_still_says_something():
    # given torchrun exited 1 (or left no exit code) and printed nothing
    silent = RankFacts(index=0, node="a", state="exited", torchrun_rc=1, log_tail=[])
    no_code = RankFacts(index=1, node="b", state="exited", torchrun_rc=None, log_tail=[])

    # when explained, then it is UNKNOWN with a line that says what is known
    assert explain([silent]).summary() == "UNKNOWN on rank 0 (a): torchrun exited with code 1 and printed nothing"
    assert explain([no_code]).summary() == "UNKNOWN on rank 1 (b): no output and no exit code"


def test_binary_garbage_never_raises():
    # given ranks whose output is random bytes, decoded every way a caller might
    rng = random.Random(8)
    for _ in range(50):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000)))
        tails = [
            blob.decode("utf-8", "surrogateescape").split("\n"),
            blob.decode("latin-1").splitlines(),
            [blob],  # not decoded at all
            [None, 3, blob.decode("utf-8", "replace")],  # not even strings
        ]
        for tail in tails:
            rank = RankFacts(index=0, node="n\x00", state="exited", torchrun_rc=1, log_tail=tail, error_file=blob)
            # when explained, then a failure comes back and its summary is one clean line
            failure = explain([rank])
            assert failure is not None
            assert_one_line(failure.summary(), SUMMARY_MAX)
            decisive_line(tail)


def test_facts_that_cannot_be_read_count_as_unknown_and_hide_nothing():
    # given a rank whose facts are not facts at all, and the recorded OOM on rank 1
    broken = RankFacts(index="zero", node=None, state="exited", torchrun_rc="1", log_tail=object())
    ranks = [None, broken, one_rank("oom_exit3", "node-b")]

    # when explained, then nothing raises and the OOM is still the cause
    assert explain(ranks).kind == FailureKind.OOM
    assert explain([None]) == Failure(FailureKind.UNKNOWN)
    assert explain([broken]).kind == FailureKind.UNKNOWN


def test_torchrun_killed_by_a_signal_through_a_shell_or_the_wrapper():
    # given torchrun's exit code says a shell saw it die of SIGKILL, or the wrapper saw the signal itself
    via_shell = RankFacts(index=0, node="a", state="exited", torchrun_rc=137, log_tail=["step 1"])
    via_wrapper = RankFacts(index=0, node="a", state="exited", torchrun_rc=None, signal=9, log_tail=[])

    # when explained, then it is KILLED by signal 9
    for rank in (via_shell, via_wrapper):
        failure = explain([rank])
        assert (failure.kind, failure.signal, failure.signal_name) == (FailureKind.KILLED, 9, "SIGKILL")


def test_decisive_line_skips_prefixes_frames_and_progress_bars():
    # given torch's "[rankN]: " prefix, a frame whose source mentions OutOfMemoryError, and a \r progress bar
    lines = [
        " 10%|#         | 1/10\r 20%|##        | 2/10\rValueError: the progress bar ended here",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "train.py", line 3, in <module>',
        "[rank1]:     except torch.OutOfMemoryError: pass",
        "[rank1]: KeyError: 'lr'",
    ]
    # when the decisive line is picked, then it is the first exception line, clean
    assert decisive_line(lines) == "ValueError: the progress bar ended here"
    assert decisive_line(lines[1:]) == "KeyError: 'lr'"
    assert decisive_line([]) is None
    assert decisive_line(["step 1 loss 2.3", "step 2 loss 2.1"]) is None


def test_summary_and_round_trip_for_kinds_the_lead_sets():
    # given failures that do not come from ranks (cancel, pre-flight, a time limit)
    cancelled = Failure(FailureKind.CANCELLED, line="cancelled by alice")
    preflight = Failure(FailureKind.PREFLIGHT, node="gpu1", line="torch 2.13.0 on gpu0 but 2.12.1 on gpu1\nmore")

    # then their summaries are one line, and to_dict/from_dict round-trip
    assert cancelled.summary() == "CANCELLED: cancelled by alice"
    assert preflight.summary() == "PREFLIGHT on gpu1: torch 2.13.0 on gpu0 but 2.12.1 on gpu1 more"
    assert Failure(FailureKind.TIMEOUT).summary() == "TIMEOUT"
    for failure in (cancelled, preflight, explain(recorded("sigkill_worker")[0])):
        assert Failure.from_dict(json.loads(json.dumps(failure.to_dict()))) == failure
    assert Failure.from_dict({"kind": "NOPE"}).kind == FailureKind.UNKNOWN


def test_every_kind_has_a_one_line_description():
    # given the fixed set of kinds, then it is exactly the set and each says what it means in one line
    assert {k.value for k in FailureKind} == {
        "OOM",
        "SCRIPT_ERROR",
        "RENDEZVOUS",
        "NODE_LOST",
        "KILLED",
        "PREFLIGHT",
        "CANCELLED",
        "TIMEOUT",
        "NCCL",
        "HANG",  # the recovery issue's kind for a job whose metric lines stopped
        "UNKNOWN",
    }
    for kind in FailureKind:
        assert kind.description and "\n" not in kind.description
