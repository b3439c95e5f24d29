"""Tests of metrics.parsing.LineParser on real and hostile rank output (no database)."""

from __future__ import annotations

import pytest

from metrics.parsing import MAX_LINE_CHARS, LineParser, Point

# Captured from `torchrun --nproc-per-node 2 train/train_production.py --max-steps 30 --log-every 10`.
REFERENCE_LOG = """\
UGRO train_production: job=local world_size=2 backend=gloo device=cpu model=tiny params=134912 \
dataset=gpl-3.txt tokens=35149 steps_per_epoch=34 total_steps=30 start_step=0 output_dir=/tmp/ugro_ref/out
{"step": 10, "epoch": 0, "loss": 4.514902, "lr": 0.00252397, "tokens_per_sec": 41084.83, \
"grad_norm": 1.352049, "rank": 1}
{"step": 10, "epoch": 0, "loss": 4.521892, "lr": 0.00252397, "tokens_per_sec": 40489.38, \
"grad_norm": 1.352049, "rank": 0}
{"step": 20, "epoch": 0, "loss": 3.328042, "lr": 0.00115031, "tokens_per_sec": 51151.27, \
"grad_norm": 0.813769, "rank": 1}
{"step": 20, "epoch": 0, "loss": 3.340988, "lr": 0.00115031, "tokens_per_sec": 51154.92, \
"grad_norm": 0.813769, "rank": 0}
{"step": 30, "epoch": 0, "loss": 3.092129, "lr": 0.000307914, "tokens_per_sec": 44366.75, \
"grad_norm": 0.699805, "rank": 0}
{"step": 30, "epoch": 0, "loss": 3.088951, "lr": 0.000307914, "tokens_per_sec": 44220.85, \
"grad_norm": 0.699805, "rank": 1}
saved checkpoint /tmp/ugro_ref/out/checkpoint_step30.pt (step 30)
training complete: job=local steps=30 epochs=0.88 final_loss=3.0795 elapsed=1.2s output_dir=/tmp/ugro_ref/out
"""

# A Trainer run with logging_steps=10 as it lands in a log file that merges stdout and stderr:
# tqdm redraws with '\r' and the Trainer writes its dicts through tqdm.write().
HF_LOG = (
    "***** Running training *****\n"
    "  Num examples = 240\n"
    "  Num Epochs = 1\n"
    "  Total optimization steps = 30\n"
    "\r  0%|          | 0/30 [00:00<?, ?it/s]"
    "\r  3%|▎         | 1/30 [00:00<00:21,  1.33it/s]"
    "\r 30%|███       | 9/30 [00:05<00:12,  1.70it/s]"
    "\r 33%|███▎      | 10/30 [00:06<00:11,  1.71it/s]"
    "\r                                              \r"
    "{'loss': 2.3145, 'grad_norm': 1.2345678806304932, "
    "'learning_rate': 3.3333333333333335e-05, 'epoch': 0.33}\n"
    "\r 33%|███▎      | 10/30 [00:06<00:11,  1.71it/s]"
    "\r 67%|██████▋   | 20/30 [00:12<00:05,  1.72it/s]"
    "\r                                              \r"
    "{'loss': 2.0461, 'grad_norm': 0.9876, 'learning_rate': 1.6666666666666667e-05, 'epoch': 0.67}\n"
    "\r 67%|██████▋   | 20/30 [00:12<00:05,  1.72it/s]"
    "\r100%|██████████| 30/30 [00:18<00:00,  1.73it/s]"
    "\r                                              \r"
    "{'loss': 1.9012, 'grad_norm': 0.8, 'learning_rate': 0.0, 'epoch': 1.0}\n"
    "\r100%|██████████| 30/30 [00:18<00:00,  1.73it/s]"
    "\r                                              \r"
    "{'train_runtime': 18.4521, 'train_samples_per_second': 13.007, 'train_steps_per_second': 1.626, "
    "'train_loss': 2.0872666676839193, 'epoch': 1.0}\n"
    "\r100%|██████████| 30/30 [00:18<00:00,  1.63it/s]\n"
    "Saving model checkpoint to out/checkpoint-30\n"
)

TQDM_LINES = [
    "  5%|▌         | 5/100 [00:01<00:19,  4.87it/s]",
    "\r  5%|▌         | 5/100 [00:01<00:19,  4.87it/s]\r 10%|█         | 10/100 [00:02<00:18,  4.90it/s]",
    "100%|██████████| 100/100 [00:20<00:00,  4.99it/s]",
    "Epoch 1:  42%|████▏     | 21/50 [00:04<00:06,  4.52it/s, v_num=0]",
    "\r\r\r",
    "",
]


def feed_all(parser: LineParser, text: str) -> list[Point]:
    """Feed text the way a follower does: split on newlines, no trailing newline."""
    points: list[Point] = []
    for line in text.split("\n"):
        points.extend(parser.feed(line))
    return points


def by_name(points: list[Point]) -> dict[tuple[int, str, int | None], float]:
    return {(p.step, p.name, p.rank): p.value for p in points}


def test_reference_script_lines() -> None:
    parser = LineParser()
    points = feed_all(parser, REFERENCE_LOG)
    assert parser.metric_lines == 6
    assert parser.malformed == 0
    assert len(points) == 6 * 5
    assert {p.name for p in points} == {"epoch", "loss", "lr", "tokens_per_sec", "grad_norm"}
    values = by_name(points)
    assert values[(10, "loss", 1)] == 4.514902
    assert values[(30, "lr", 0)] == 0.000307914
    assert values[(20, "epoch", 0)] == 0.0
    assert all(isinstance(p.value, float) for p in points)
    assert parser.last_step == 30


def test_single_reference_line_with_example_values() -> None:
    line = '{"step": 10, "epoch": 0, "loss": 3.91, "lr": 0.001, "tokens_per_sec": 5123.4, "grad_norm": 0.82, "rank": 1}'
    assert LineParser().feed(line) == [
        Point(10, "epoch", 0.0, 1),
        Point(10, "loss", 3.91, 1),
        Point(10, "lr", 0.001, 1),
        Point(10, "tokens_per_sec", 5123.4, 1),
        Point(10, "grad_norm", 0.82, 1),
    ]


def test_global_step_and_integral_float_step() -> None:
    parser = LineParser()
    assert parser.feed('{"global_step": 7, "loss": 1.5}') == [Point(7, "loss", 1.5, None)]
    assert parser.feed('{"step": 8.0, "loss": 1.25}') == [Point(8, "loss", 1.25, None)]


def test_hugging_face_trainer_log() -> None:
    # given a Trainer log whose dicts are written through tqdm.write(), the bar redrawn right after each
    parser = LineParser()
    # when it is fed as a follower does
    points = feed_all(parser, HF_LOG)
    # then each dict takes the step of the bar redrawn after it (10, 20, 30), never a count of lines
    assert parser.malformed == 0
    curve = [p for p in points if not p.final]
    values = by_name(curve)
    assert values[(10, "loss", None)] == 2.3145
    assert values[(10, "learning_rate", None)] == 3.3333333333333335e-05
    assert values[(20, "grad_norm", None)] == 0.9876
    assert values[(30, "learning_rate", None)] == 0.0
    assert values[(30, "epoch", None)] == 1.0
    assert {p.step for p in curve} == {10, 20, 30}
    # and the end-of-training summary is the run's final metrics, not a curve point
    finals = {p.name: p.value for p in points if p.final}
    assert finals == {
        "train_runtime": 18.4521,
        "train_samples_per_second": 13.007,
        "train_steps_per_second": 1.626,
        "train_loss": 2.0872666676839193,
        "epoch": 1.0,
    }
    assert "train_runtime" not in {p.name for p in curve}
    assert parser.total_steps == 30


def test_hf_dict_reads_numbers_as_strings_and_skips_other_values() -> None:
    # given a transformers 5 dict (numbers quoted) with values that are no numbers; no bar drawn
    parser = LineParser()
    line = "{'loss': 2.31, 'learning_rate': '1.2e-05', 'flag': True, 'note': None, 'name': 'x1', 'epoch': '0.12'}"
    # then the quoted numbers are read, the rest skipped
    assert parser.feed(line) == [
        Point(1, "loss", 2.31, None),
        Point(1, "learning_rate", 1.2e-05, None),
        Point(1, "epoch", 0.12, None),
    ]


def test_step_inference_continues_after_explicit_steps() -> None:
    parser = LineParser()
    assert parser.feed('UGRO_METRIC {"acc": 0.5}') == [Point(1, "acc", 0.5, None)]
    assert parser.feed('UGRO_METRIC {"acc": 0.6}')[0].step == 2
    assert parser.feed('{"step": 100, "loss": 1.0}')[0].step == 100
    assert parser.feed("{'loss': 0.9}")[0].step == 101
    assert parser.feed('UGRO_METRIC {"step": 500, "loss": 0.8, "rank": 3}') == [Point(500, "loss", 0.8, 3)]
    assert parser.feed('UGRO_METRIC {"loss": 0.7}')[0].step == 501
    assert parser.malformed == 0
    assert parser.metric_lines == 6


def test_plain_json_without_step_is_a_log_line() -> None:
    parser = LineParser()
    assert parser.feed('{"event": "checkpoint", "loss": 1.0}') == []
    assert parser.feed('{"step": 3, "message": "saving"}') == []
    assert parser.malformed == 0
    assert parser.metric_lines == 0


def test_rank_field_only_when_int() -> None:
    parser = LineParser()
    assert parser.feed('{"step": 1, "loss": 1.0, "rank": "0"}') == [Point(1, "loss", 1.0, None)]
    assert parser.feed('{"step": 1, "loss": 1.0, "rank": true}') == [Point(1, "loss", 1.0, None)]
    assert parser.feed('{"step": 1, "loss": 1.0, "rank": 2}') == [Point(1, "loss", 1.0, 2)]


@pytest.mark.parametrize("line", TQDM_LINES)
def test_tqdm_lines_are_plain(line: str) -> None:
    parser = LineParser()
    assert parser.feed(line) == []
    assert parser.malformed == 0


def test_non_finite_values_are_skipped() -> None:
    parser = LineParser()
    line = '{"step": 1, "loss": NaN, "acc": 0.5, "big": Infinity}'
    assert parser.feed(line) == [Point(1, "acc", 0.5, None)]
    assert parser.feed('{"step": 2, "loss": 1e999, "acc": 0.25}') == [Point(2, "acc", 0.25, None)]
    assert parser.malformed == 0
    # Numbers were there but none was usable: counted, nothing returned.
    assert parser.feed('{"step": 1, "loss": NaN}') == []
    assert parser.malformed == 1


GARBAGE = [
    "{",
    "{}}",
    '{"step": 1, "loss": 2.0',  # unterminated
    '{"step": "abc", "loss": 1.0}',
    '{"step": true, "loss": 1.0}',
    '{"step": 1.5, "loss": 1.0}',
    '{"step": 1e400, "loss": 1.0}',
    '{"step": 99999999999999999999999, "loss": 1.0}',
    "{" + '"a": ' * 10 + "x",
    '{"a": ' + "[" * 10000 + "]" * 10000 + "}",
    '{"step": 1, "loss": 2.5} and more',  # a JSON value with something after it is not JSON
    '{"step": 1, "loss": 2.5}{"step": 2, "loss": 2.4}',
    'UGRO_METRIC {"loss": 2.5} x',
    "UGRO_METRIC not json",
    "UGRO_METRIC [1, 2]",
    "UGRO_METRIC {}",
    'UGRO_METRIC {"loss": "high"}',
    'UGRO_METRIC {"a": ' + "[" * 10000,
    "{'loss': __import__('os').system('true')}",
    "{'loss': tensor(2.31)}",
    "{'a', 'b'}",
    "{'loss': " + "(" * 500 + "1" + ")" * 500 + "}",
    "{'loss': " + "9" * 4050 + "}",
]


@pytest.mark.parametrize("line", GARBAGE)
def test_malformed_metric_lines_are_counted(line: str) -> None:
    parser = LineParser()
    assert parser.feed(line) == []
    assert parser.malformed == 1
    assert parser.metric_lines == 0


PLAIN_GARBAGE = [
    "\x00",
    "\x00{\x00",
    "[1,2]",
    "[" * 10000,
    "[" * 10000 + "]" * 10000,
    b"\xff\xfe\x00garbage\x80\x81{".decode("utf-8", errors="replace"),
    bytes(range(256)).decode("utf-8", errors="replace"),
    "\ud800 lone surrogate",
    "UGRO_METRICS {}",
    "loss=2.31 step=10",
]


@pytest.mark.parametrize("line", PLAIN_GARBAGE)
def test_garbage_log_lines_are_plain(line: str) -> None:
    parser = LineParser()
    assert parser.feed(line) == []
    assert parser.malformed == 0


def test_huge_numbers_do_not_raise() -> None:
    parser = LineParser()
    # An int beyond float range is skipped, the rest of the line is kept.
    assert parser.feed('{"step": 1, "huge": ' + "9" * 400 + ', "ok": 1}') == [Point(1, "ok", 1.0, None)]
    assert parser.feed("{'huge': " + "9" * 400 + ", 'ok': 2}") == [Point(2, "ok", 2.0, None)]


def test_overlong_lines_are_never_parsed() -> None:
    parser = LineParser()
    filler = "x" * (1024 * 1024)
    assert parser.feed('{"step": 1, "loss": 1.0, "pad": "' + filler + '"}') == []
    assert parser.feed("x" * (1024 * 1024)) == []
    assert parser.feed('{"step": 1, "loss": 1.0}' + " " * MAX_LINE_CHARS) == []
    assert parser.malformed == 3
    at_limit = '{"step": 1, "loss": 1.0}'.ljust(MAX_LINE_CHARS)
    assert parser.feed(at_limit) == [Point(1, "loss", 1.0, None)]


def test_garbage_does_not_disturb_later_lines() -> None:
    parser = LineParser()
    for line in GARBAGE + PLAIN_GARBAGE + TQDM_LINES:
        parser.feed(line)
    assert parser.feed('{"step": 42, "loss": 0.5}') == [Point(42, "loss", 0.5, None)]
    assert parser.malformed == len(GARBAGE)
    assert parser.metric_lines == 1


def test_follower_splits_at_newlines_only():
    from jobs.follow import split_lines

    data = b"a\r\n 10%|#  | 1/10\r 20%|## | 2/10\rdone\nx\x0cy\xc2\x85z\nlast"
    assert split_lines(data) == ["a\r", " 10%|#  | 1/10\r 20%|## | 2/10\rdone", "x\x0cy\x85z", "last"]
    assert split_lines(b"") == [] and split_lines(b"one\n") == ["one"]


def test_a_bar_line_longer_than_the_limit_is_read_state_by_state() -> None:
    # given one log line of 3000 carriage-return states of a training bar (no newline for a whole run)
    states = [f"Training:  {n // 30:2d}%|##  | {n}/3000 [00:01<00:02, 9.9it/s, v_num=0, loss={1 + n / 1e4:.4f}]"
              for n in range(1, 3001)]  # fmt: skip
    line = "\r" + "\r".join(states)
    assert len(line) > MAX_LINE_CHARS
    parser = LineParser()
    # then every state is read once, at its own step
    points = parser.feed(line)
    assert [p.step for p in points] == list(range(1, 3001))
    assert parser.malformed == 0 and parser.counter == 3000


def test_a_trainer_dict_at_the_end_of_the_stream_takes_the_last_bar_step() -> None:
    parser = LineParser()
    assert parser.feed("\r 40%|####      | 4/10 [00:01<00:01,  3.1it/s]") == []
    assert parser.feed("\r    \r{'loss': '1.5', 'epoch': '0.4'}") == []  # waits for the bar's redraw
    assert parser.flush() == [Point(4, "loss", 1.5, None), Point(4, "epoch", 0.4, None)]


def test_bars_give_only_steps_when_the_job_reads_a_metrics_file() -> None:
    parser = LineParser(bar_metrics=False)
    assert parser.feed(" 50%|#####     | 10/20 [00:01<00:01, 9.9it/s, train_loss=0.5]") == []
    assert (parser.counter, parser.last_step) == (10, 10)
    # and a bar that counts global steps gives its values otherwise
    assert LineParser().feed(" 50%|#####     | 10/20 [00:01<00:01, 9.9it/s, train_loss=0.5]") == [
        Point(10, "train_loss", 0.5, None)
    ]


def test_an_epoch_bar_never_gives_a_step_to_its_values() -> None:
    # given Lightning's bars: N/M is the batch within the epoch
    parser = LineParser()
    bar = "Epoch 1: 50%|#####     | 10/20 [00:01<00:01, 9.9it/s, v_num=0, train_loss=0.5]"
    assert parser.feed(bar) == [Point(None, "train_loss", 0.5, None)]
    assert parser.feed("Epoch 1/2 ━━━━━━━━━━━━━━━━━━━━ 20/20 0:00:01 • 0:00:00 12.3it/s v_num: 0") == []
    assert parser.feed("train_loss: 0.062") == [Point(None, "train_loss", 0.062, None)]  # a row of that bar
    # then the counter stands for progress only
    assert (parser.counter, parser.total_steps) == (40, 60)


@pytest.mark.parametrize("pattern", ["(", "x" * 501, "a\x00b"])
def test_an_unusable_pattern_is_refused_in_one_line(pattern: str) -> None:
    from metrics.parsing import compile_pattern

    with pytest.raises(ValueError) as err:
        compile_pattern(pattern)
    assert "\n" not in str(err.value) and str(err.value).startswith("the metrics pattern")


def test_pattern_lines_skip_units_and_take_the_first_number() -> None:
    # given timm's train.py line shape; every "key: number" is a pair (name groups to pick fewer)
    parser = LineParser(pattern="^Train:")
    line = "Train: 3 [  50/100 ( 50%)]  Loss: 2.31 (2.40)  Time: 0.123s  LR: 1.000e-03  acc=0.5"
    assert parser.feed(line) == [
        Point(50, "Train", 3.0, None),
        Point(50, "Loss", 2.31, None),
        Point(50, "LR", 0.001, None),
        Point(50, "acc", 0.5, None),
    ]
    assert parser.total_steps == 100
    assert parser.feed("Eval: Loss: 1.0") == []  # lines the pattern does not match stay log lines
