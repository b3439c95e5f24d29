"""The recorded corpus: real output of each framework (tests/data/frameworks, made by record.sh) read as
UGRO reads it. A framework's next format change shows up here as a failing test.

Each recording has an expected.json (points, steps, final metrics, the bar's total, and the points
of the metric files the run wrote); the tests below also state by hand what the run did (its
logging interval, max steps, epochs) so that the expected files are not the only judge.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metrics.files import csv_points, events_points
from metrics.parsing import LineParser, Point

CORPUS = Path(__file__).parent / "data" / "frameworks"
RECORDINGS = sorted(p.name for p in CORPUS.iterdir() if (p / "rank_0.log").exists())


def read(name: str, pattern: str | None = None) -> tuple[list[Point], LineParser]:
    parser = LineParser(pattern=pattern)
    points: list[Point] = []
    for line in (CORPUS / name / "rank_0.log").read_bytes().decode("utf-8", "replace").split("\n"):
        points.extend(parser.feed(line))
    points.extend(parser.flush())
    return points, parser


def steps_of(points: list[Point], name: str) -> list[int]:
    return [p.step for p in points if p.name == name and not p.final]


def test_the_corpus_holds_every_framework_version_tested() -> None:
    assert RECORDINGS == [
        "accelerate_loop",
        "hf4_trainer",
        "hf5_seq2seq",
        "hf5_trainer",
        "lightning_rich",
        "lightning_rich_100sps",
        "lightning_rich_10sps",
        "lightning_rich_1sps",
        "lightning_rich_live",
        "lightning_tqdm",
        "lightning_tqdm_100sps",
        "lightning_tqdm_10sps",
        "lightning_tqdm_1sps",
    ]
    assert "transformers 4.57.6" in (CORPUS / "hf4_trainer" / "rank_0.log").read_text()
    assert "transformers 5.23.0" in (CORPUS / "hf5_trainer" / "rank_0.log").read_text()


@pytest.mark.parametrize("name", RECORDINGS)
def test_recording_reads_as_expected(name: str) -> None:
    # given a framework's real output and what it should give
    expected = json.loads((CORPUS / name / "expected.json").read_text())
    # when UGRO reads it (with the recording's pattern, if it needs one)
    points, parser = read(name, expected["pattern"])
    # then every point, step, final metric and the bar's total are as expected, and nothing was malformed
    log = expected["log"]
    assert [[p.step, p.name, p.value] for p in points if not p.final] == log["points"]
    assert {p.name: p.value for p in points if p.final} == log["final"]
    assert parser.total_steps == log["total_steps"]
    assert parser.malformed == log["malformed"] == 0
    # and the metric files it wrote read as expected
    for relative, triples in expected["files"].items():
        path = CORPUS / name / relative
        if path.name == "metrics.csv":
            header, _, rows = path.read_bytes().decode().partition("\n")
            got = csv_points(header, rows, 0)[0]
        else:
            got = events_points(path, 0)[0]
        assert [list(t) for t in got] == triples


@pytest.mark.parametrize("name", ["hf4_trainer", "hf5_trainer"])
def test_trainer_steps_come_from_its_own_counter(name: str) -> None:
    # given a Trainer run of 30 steps logging every 5 and evaluating every 10 (record.sh)
    points, parser = read(name)
    # then its loss is at steps 5..30 (the bar's N), evaluations are their own series at 10, 20, 30
    assert steps_of(points, "loss") == [5, 10, 15, 20, 25, 30]
    assert steps_of(points, "eval_loss") == [10, 20, 30]
    assert steps_of(points, "epoch") == [5, 10, 15, 20, 25, 30]  # eval dicts do not repeat the epoch
    # and the end-of-training summary is the final metrics, with progress out of the bar's M
    finals = {p.name for p in points if p.final}
    assert {"train_runtime", "train_loss", "train_samples_per_second", "epoch"} <= finals
    assert not {p.name for p in points if not p.final} & {"train_runtime", "train_loss"}
    assert parser.total_steps == 30


def test_transformers_5_quoted_numbers_equal_transformers_4_numbers_rounded() -> None:
    # given the same run under transformers 4 (numbers) and 5 (numbers as 4-digit strings)
    four = {(p.step, p.name): p.value for p in read("hf4_trainer")[0] if p.name in ("loss", "grad_norm")}
    five = {(p.step, p.name): p.value for p in read("hf5_trainer")[0] if p.name in ("loss", "grad_norm")}
    # then both give the same points, the values equal to 4 significant digits
    assert four.keys() == five.keys()
    for key, value in four.items():
        assert five[key] == float(f"{value:.4g}")


def test_seq2seq_trainer() -> None:
    points, parser = read("hf5_seq2seq")
    assert steps_of(points, "loss") == [5, 10, 15, 20]
    assert steps_of(points, "eval_loss") == [10, 20]
    assert {p.name: p.value for p in points if p.final}["train_loss"] == 5.354
    assert parser.total_steps == 20


def test_lightning_tqdm_bar_postfix_gives_progress_but_no_steps() -> None:
    # given Lightning's tqdm bar over 2 epochs of 20 batches, training loss on the bar at every batch
    points, parser = read("lightning_tqdm")
    # then its values have no step: "Epoch 1: 21/20" counts the batch within the epoch, not Lightning's
    # global step (its metrics.csv has train_loss at 4, 9, ... 39; epoch x 20 + N would say 5, 10, ... 40)
    assert {p.step for p in points} == {None}
    values = [p.value for p in points if p.name == "train_loss"]
    assert values[0] == 2.35 and values[-1] == 0.0228
    assert "v_num" not in {p.name for p in points}
    # and its thousands of carriage-return states became one point per value shown that changed
    changes = [p.value for p in points if p.name == "train_loss"]
    assert all(a != b for a, b in zip(changes, changes[1:], strict=False))
    # and the bar's counter is progress only: 2 epochs of 20
    assert parser.counter == 40
    assert parser.total_steps is None  # "Epoch k" does not say how many epochs


def test_lightning_rich_bar_printed_once_when_not_a_terminal() -> None:
    # given Lightning's rich bar written to a log file (drawn once, at the end: "Epoch 1/1 ... 20/20")
    points, parser = read("lightning_rich")
    # then the metric rows under it are points with no step (not at an invented one: the "step 88")
    assert [(p.step, p.name, p.value) for p in points] == [(None, "train_loss", 0.023), (None, "val_loss", 0.069)]
    assert parser.malformed == 0
    assert parser.total_steps == 40  # "Epoch 1/1": two epochs of 20


def test_lightning_rich_bar_redrawn_live() -> None:
    # given the rich bar as drawn on a terminal (cursor moves and colours, rows redrawn each batch)
    points, parser = read("lightning_rich_live")
    # then its rows are points with no step, a repeated value once
    assert {p.step for p in points} == {None} and parser.malformed == 0
    assert [p.value for p in points if p.name == "val_loss"] == [2.015, 1.114, 0.388]  # sanity check, 2 epochs
    assert parser.total_steps == 12 and parser.counter == 12


@pytest.mark.parametrize("bar", ["tqdm", "rich"])
@pytest.mark.parametrize(("pace", "batches", "every"), [("1sps", 6, 2), ("10sps", 30, 5), ("100sps", 150, 10)])
def test_lightning_in_a_log_file_at_any_pace_gets_its_steps_from_its_files_never_from_the_bar(
    bar: str, pace: str, batches: int, every: int
) -> None:
    # given Lightning's bar written to a log file (not a terminal) at 1, 10 and 100 steps a second, 2 epochs
    name = f"lightning_{bar}_{pace}"
    points, parser = read(name)
    # then the bar gives no point at an invented step: its values keep only their time, and progress
    # (rich says the total: "Epoch k/1")
    assert points and {p.step for p in points} == {None} and parser.malformed == 0
    assert parser.total_steps == (2 * batches if bar == "rich" else None)
    assert parser.counter == 2 * batches
    # and the files Lightning wrote hold every logged step, Lightning's own (counted from 0)
    base = CORPUS / name / "lightning_logs"
    header, _, rows = (base / "version_0" / "metrics.csv").read_text().partition("\n")
    logged = list(range(every - 1, 2 * batches, every))
    assert sorted(s for s, n, _ in csv_points(header, rows, 0)[0] if n == "train_loss") == logged
    tb_file = next((base / "version_1").glob("events.out.tfevents.*"))
    assert sorted(s for s, n, _ in events_points(tb_file, 0)[0] if n == "train_loss") == logged


def test_lightning_metric_files_agree() -> None:
    # given the metrics.csv and TensorBoard file of one Lightning run
    base = CORPUS / "lightning_tqdm" / "lightning_logs"
    header, _, rows = (base / "version_0" / "metrics.csv").read_text().partition("\n")
    from_csv = {(s, n): v for s, n, v in csv_points(header, rows, 0)[0]}
    tb_file = next((base / "version_1").glob("events.out.tfevents.*"))
    from_tb = {(s, n): v for s, n, v in events_points(tb_file, 0)[0]}
    # then both hold the same values at Lightning's own steps (it counts from 0: the 5th batch is step 4)
    assert from_csv == from_tb
    assert sorted(s for s, n in from_csv if n == "train_loss") == [4, 9, 14, 19, 24, 29, 34, 39]
    assert sorted(s for s, n in from_csv if n == "val_loss") == [19, 39]


def test_a_script_of_its_own_needs_its_pattern() -> None:
    # given an accelerate loop printing "epoch 0 step 5/40: loss: 3.4697 lr: 0.002625"
    assert read("accelerate_loop")[0] == []  # without a pattern these are log lines
    # when the job's pattern names its lines
    points, parser = read("accelerate_loop", r"^epoch \d+")
    # then its pairs are metrics at the script's own step counter, progress out of its M
    assert steps_of(points, "loss") == [5, 10, 15, 20, 25, 30, 35, 40]
    assert steps_of(points, "eval_loss") == [20, 40]  # the last counter the script showed
    assert parser.total_steps == 40


def test_the_pattern_named_groups_pick_what_is_a_metric() -> None:
    parser = LineParser(pattern=r"it (?P<step>\d+) .*?ppl (?P<ppl>[\d.]+)")
    assert parser.feed("it 12 took 3s ppl 41.5 mem 3.2") == [Point(12, "ppl", 41.5, None)]
    assert parser.feed("other 3 ppl 2") == []
