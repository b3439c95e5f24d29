"""Turn the lines a training rank prints into metric points.

What is read without any change to the script:

* a JSON object with an integer ``step`` (or ``global_step``), one line per log
  event, as the reference script ``train/train_production.py`` prints;
* ``UGRO_METRIC {...}``: a JSON object with an explicit marker;
* the dicts the Hugging Face Trainer (and Seq2SeqTrainer) prints with repr():
  numbers in transformers 4 (``{'loss': 2.31, 'epoch': 0.12}``), numbers as
  quoted strings in transformers 5 (``{'loss': '2.31', 'epoch': '0.12'}``).
  ``eval_*``/``test_*`` dicts are series of their own; the end-of-training
  summary (``train_runtime``, ``train_loss``, ...) is the run's final metrics
  (points with ``final=True``), not a curve point;
* progress bars: tqdm states (``Epoch 1:  42%|████▏ | 21/50 [00:04<00:06, 4.52it/s,
  loss=2.31, v_num=0]``) and rich bars with their metric rows under the bar
  (``Epoch 1/1 ━━━━ 20/20 ...`` then ``train_loss: 0.062``), as PyTorch
  Lightning draws them. ``v_num`` is not a metric;
* with a job's metrics pattern (a regular expression), the ``key=value`` and
  ``key: value`` pairs of the lines it matches (or its named groups).

Steps come from the framework's own counter: a ``step``/``global_step`` key,
else the progress bar's ``N`` of ``N/M`` where the bar counts global steps (the
Trainer's). Lightning's ``Epoch k`` bars count the batch within an epoch: their
values are points with no step (placed by time; the framework's metric file,
once found, gives them with their steps: metrics/files.py), and ``epoch * M + N``
stands for progress only.
A Trainer dict takes the state its bar is redrawn with
right after it (tqdm.write() redraws the bar at once; the state drawn before
the dict can lag a few steps behind). Only a script that shows no counter at
all gets consecutive numbers. ``total_steps`` is the bar's ``M`` (over all
epochs where the bar says how many), for progress and ETA.

A line may hold many carriage-return states of a bar: each is read once, and
a bar's value that did not change since its last state is not repeated.

Everything else is a plain log line. The parser never raises: a follower that
dies on one odd line would lose every later metric of the run.

This module is pure Python (no Django) so it can be tested and reused anywhere.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, NamedTuple

MAX_LINE_CHARS = 65536  # longer segments are never parsed as metrics

METRIC_PREFIX = "UGRO_METRIC "
# literal_eval is only ever applied to short lines of this shape (HF Trainer dicts).
REPR_DICT_MAX_CHARS = 4096
# MetricPoint.name is a CharField(max_length=100): longer keys could not be stored.
MAX_NAME_CHARS = 100
# A user's pattern is only tried on segments up to this long (bounds the time one line can take).
PATTERN_MAX_CHARS = 4096
MAX_PATTERN_CHARS = 500

STEP_KEYS = ("step", "global_step")
# A run's planned total of steps, when a script logs it beside the step (HF's state.max_steps).
TOTAL_KEYS = ("max_steps", "total_steps")
# Both pairs by name, for the per-line checks (two `in`s cost less per line than `keys().isdisjoint(...)`)
_STEP_KEY, _GLOBAL_STEP_KEY = STEP_KEYS
_MAX_STEPS_KEY, _TOTAL_STEPS_KEY = TOTAL_KEYS
NOT_METRICS = frozenset({"step", "global_step", "rank", "v_num", *TOTAL_KEYS})
# A Trainer dict with one of these is the end-of-training summary: the run's final metrics.
FINAL_KEYS = frozenset({"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"})
# Series of their own whose 'epoch' would only repeat the training one.
OWN_SERIES_PREFIXES = ("eval_", "test_", "predict_")
# Bars that do not count training steps (Lightning's names for them).
NOT_TRAINING_BARS = ("sanity", "validation", "testing", "predicting", "writing", "loading", "map", "generating")

_BIGINT_MIN, _BIGINT_MAX = -(2**63), 2**63 - 1
_INT_MAX = 2**31 - 1

_ANSI = re.compile(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
_NUMBER = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
_NUMBER_RE = re.compile(rf"^{_NUMBER}$")
# tqdm: "{desc}: {pct}%|{bar}| {n}/{total} [{elapsed}<{remaining}, {rate}{, postfix}]"
_TQDM = re.compile(r"^(?P<desc>.*?)(?:\s*\d{1,3}%)?\|[^|]*\|\s*(?P<n>\d+)/(?P<m>\d+|\?)\s*\[(?P<info>[^\]]*)\]")
# rich (Lightning's RichProgressBar): "{desc} ━━━━╸━━━ {n}/{total} 0:00:01 • 0:00:02 12.3it/s {v_num: 0}"
_RICH = re.compile(r"^(?P<desc>\S.*?)\s+[━╸╺─]+\s+(?P<n>\d+)/(?P<m>\d+|\?)(?:\s|$)")
_RICH_CHARS = frozenset("━╸╺─")
_RICH_ROW_PAIR = re.compile(rf"(?<![\w.])(?P<key>[A-Za-z_][\w./-]*): (?P<value>{_NUMBER})(?![\w.])")
# what else a rich bar's wrapped rows hold beside their metrics: its elapsed/remaining times and rate
_RICH_ROW_REST = re.compile(r"^(?:\s|•|-:--:--|\d+:\d\d(?::\d\d)?|[\d.]+\s?it/s)*$")
_EPOCH = re.compile(r"^\s*epoch\s+(?P<k>\d+)(?:\s*/\s*(?P<last>\d+))?", re.IGNORECASE)
_PAIR = re.compile(rf"(?<![\w.])(?P<key>[A-Za-z_][\w./-]*)\s*(?:=|:)\s*(?P<value>{_NUMBER})(?![\w.%])")
_N_OF_M = re.compile(r"(?<![\w./])(?P<n>\d+)\s*/\s*(?P<m>\d+)(?![\w./])")


class Point(NamedTuple):
    """One value of one named metric at one step (a named tuple: the follower makes thousands a second,
    and a frozen dataclass's __init__ is a Python call per point)."""

    step: int | None  # None: the step is not known (a Lightning bar's value), only the time
    name: str
    value: float
    rank: int | None  # the line's own "rank" field if it carried an int one, else None
    final: bool = False  # part of the run's end-of-training summary, not a curve point


_new_tuple = tuple.__new__


class _Malformed(Exception):
    """Raised inside the parser for a line that looked like metrics but cannot be used."""


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A job's metrics pattern as a compiled regex; ValueError with a one-line reason if unusable."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"the metrics pattern is longer than {MAX_PATTERN_CHARS} characters")
    if "\x00" in pattern:
        raise ValueError("the metrics pattern contains a NUL byte")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"the metrics pattern is not a valid regular expression: {exc}") from None


class LineParser:
    """One per rank stream.

    feed() each line (str, without the trailing newline, already decoded with
    errors='replace'); flush() once the stream has ended.

    pattern: the job's metrics pattern (lines it matches give their key=value
    and key: value pairs, or its named groups). bar_metrics: False to take only
    steps from progress bars, not their (rounded) values, when the job reads the
    same metrics from a file.

    ``malformed`` counts lines that looked like metrics but could not be used,
    or were too long to parse; ``metric_lines`` counts lines that produced at
    least one point; ``last_step`` is the last step seen (None before any);
    ``counter`` the last step a progress bar or an N/M counter showed; ``total_steps``
    the training bar's total (None while unknown).
    """

    def __init__(self, pattern: str | re.Pattern[str] | None = None, bar_metrics: bool = True) -> None:
        self.malformed: int = 0
        self.metric_lines: int = 0
        self.last_step: int | None = None
        self.total_steps: int | None = None
        self.pattern = compile_pattern(pattern) if isinstance(pattern, str) and pattern else pattern or None
        self.bar_metrics = bar_metrics
        self.counter: int | None = None
        self._train_m: int | None = None  # the training bar's N/M total, once one was drawn
        self._bar_seen = False
        self._pending: list[dict[Any, Any]] = []  # Trainer dicts waiting for the bar's redraw
        self._rich_open = False  # a rich training bar was drawn: its metric rows follow
        self._rich_step: int | None = None  # that bar's global step (None: it shows only the batch in an epoch)
        self._shown: dict[str, float] = {}  # last value a bar showed for each metric

    def feed(self, line: str) -> list[Point]:
        """Parse one line; return its points ([] for plain log lines). Never raises."""
        points: list[Point] = []
        if not isinstance(line, str):
            self.malformed += 1
            return points
        for segment in line.split("\r") if "\r" in line else (line,):
            try:
                points.extend(self._segment(segment))
            except Exception:  # _Malformed, or anything unforeseen: one odd line must not kill the follower
                self.malformed += 1
        if points:
            self.metric_lines += 1
        return points

    def flush(self) -> list[Point]:
        """Points still waiting for a bar state (the stream ended): they take the last step known."""
        try:
            return self._resolve(self._fallback_step())
        except Exception:
            self.malformed += 1
            return []

    # -- one carriage-return segment -------------------------------------------------------------

    def _segment(self, raw: str) -> list[Point]:
        if len(raw) > MAX_LINE_CHARS:
            raise _Malformed
        text = _ANSI.sub("", raw) if "\x1b" in raw else raw
        stripped = text.strip()
        if not stripped:
            return []
        bar = self._parse_bar(text)
        if bar is not None:
            return bar
        if self._rich_open:
            pairs = _rich_row(text)
            if pairs:
                return self._bar_values(self._rich_step, pairs)
            self._rich_open = False
        if stripped.startswith(METRIC_PREFIX):
            return self._parse_marked(stripped[len(METRIC_PREFIX) :])
        if stripped.startswith("{"):
            obj = _load_json(stripped)
            if obj is not None:
                return self._parse_json_object(obj)
            if stripped.startswith("{'") and stripped.endswith("}") and len(stripped) < REPR_DICT_MAX_CHARS:
                return self._parse_repr_dict(stripped)
            raise _Malformed
        if self.pattern is not None and len(stripped) <= PATTERN_MAX_CHARS:
            return self._parse_pattern(stripped)
        return []

    # -- progress bars ----------------------------------------------------------------------------

    def _parse_bar(self, text: str) -> list[Point] | None:
        """Points of a bar state ([] if none), or None when the text is not a bar."""
        if "/" not in text or ("|" not in text and not _RICH_CHARS.intersection(text)):
            return None  # most log lines: no regex tried
        match = _TQDM.match(text)
        rich = False
        if match is None:
            match = _RICH.match(text.strip())
            rich = match is not None
        if match is None:
            return None
        desc = match["desc"].strip().rstrip(":").strip()
        n = int(match["n"])
        m = int(match["m"]) if match["m"] != "?" else None
        training = not desc.lower().startswith(NOT_TRAINING_BARS)
        epoch = _EPOCH.match(desc)
        if training and m is not None and not epoch:
            # the Trainer's eval bar has no name either: the training bar is the one drawn first
            if self._train_m is None:
                self._train_m = m
            training = m == self._train_m
        step, total = n, m
        # An "Epoch k" bar's N/M is the batch within the epoch, not the global step (gradient accumulation,
        # max_steps, a validation pass make them differ): epoch x M + N stands for progress only, and the
        # values it shows get no step (a metric file the framework writes gives their steps)
        global_step: int | None = step
        if epoch and m:
            step = int(epoch["k"]) * m + n
            global_step = None
            # rich says "Epoch k/last": the run's total is known; tqdm's "Epoch k" does not say it
            total = (int(epoch["last"]) + 1) * m if epoch["last"] else None
        elif epoch:
            total = None
            global_step = None
        self._rich_open = rich and training
        self._rich_step = global_step
        points: list[Point] = []
        if not training:
            return points
        self._bar_seen = True
        if self._pending:
            points = self._resolve(step)  # the redraw right after a Trainer dict: the dict's own step
        if total is not None:
            self.total_steps = total
        if n > 0 or self.counter is None:  # not a bar's reset to 0 at an epoch's end
            self.counter = self.last_step = step
        if not rich and match["info"]:
            pairs = [item.split("=", 1) for item in match["info"].split(", ") if "=" in item]
            points.extend(self._bar_values(global_step, [(k.strip(), v.strip()) for k, v in pairs]))
        return points

    def _bar_values(self, step: int | None, pairs: list[tuple[str, str]]) -> list[Point]:
        """A bar's metrics: only values that changed since the bar last showed them (it redraws often).
        step None: the bar does not show the global step, the points keep only their time."""
        points = []
        for key, raw in pairs:
            if key in NOT_METRICS or not key or len(key) > MAX_NAME_CHARS or not _NUMBER_RE.match(raw):
                continue
            value = _finite_float(float(raw))
            if value is None or self._shown.get(key) == value:
                continue
            self._shown[key] = value
            if self.bar_metrics:
                points.append(Point(step=step, name=key, value=value, rank=None))
        return points

    # -- dict lines -------------------------------------------------------------------------------

    def _parse_marked(self, payload: str) -> list[Point]:
        """``UGRO_METRIC {...}``: the marker promises metrics, so getting none is malformed."""
        obj = _load_json(payload.strip())
        if not isinstance(obj, dict):
            raise _Malformed
        points = self._points(obj, self._step_for(obj))
        if not points:
            raise _Malformed
        return points

    def _parse_json_object(self, obj: Any) -> list[Point]:
        """A bare JSON line is a metric line only if it carries a step."""
        if type(obj) is not dict or (_STEP_KEY not in obj and _GLOBAL_STEP_KEY not in obj):
            return []
        return self._points(obj, self._step_for(obj))

    def _parse_repr_dict(self, text: str) -> list[Point]:
        """A Hugging Face Trainer log dict, printed with repr() (transformers 5 quotes its numbers)."""
        try:
            obj = ast.literal_eval(text)
        except Exception as exc:  # literal_eval raises many types (ValueError, SyntaxError, MemoryError, ...)
            raise _Malformed from exc
        if not isinstance(obj, dict):
            raise _Malformed
        obj = {k: _number_from_text(v) for k, v in obj.items()}
        points = self._resolve(self._fallback_step()) if self._pending else []  # no redraw came between two dicts
        if FINAL_KEYS & obj.keys():
            finals = self._points(obj, self.counter if self.counter is not None else self.last_step or 0, final=True)
            return points + finals
        if _explicit_step(obj) is None and self._bar_seen:
            if _has_values(obj):
                self._pending.append(obj)
            return points
        return points + self._points(obj, self._step_for(obj))

    def _resolve(self, step: int) -> list[Point]:
        pending, self._pending = self._pending, []
        points: list[Point] = []
        for obj in pending:
            points.extend(self._points(obj, step))
        return points

    def _fallback_step(self) -> int:
        """The last counter the script showed; consecutive numbers only for a script that shows none."""
        if self.counter is not None:
            return self.counter
        return (self.last_step if self.last_step is not None else 0) + 1

    def _step_for(self, obj: dict[Any, Any]) -> int | None:
        """An object's step: explicit, else None (the caller decides)."""
        return _explicit_step(obj)

    def _points(self, obj: dict[Any, Any], step: int | None, final: bool = False) -> list[Point]:
        """Points of one parsed object at ``step`` (None: inferred); updates ``last_step``."""
        # an eval_/test_/predict_ series' 'epoch' would only repeat the training one (asked only when there is one)
        own_series = "epoch" in obj and any(isinstance(k, str) and k.startswith(OWN_SERIES_PREFIXES) for k in obj)
        values: list[tuple[str, float]] = []
        rejected = False
        for key, raw in obj.items():
            kind = type(raw)  # _is_number and _finite_float, inline: this loop runs for every value of every line
            if (kind is not float and kind is not int) or type(key) is not str or key in NOT_METRICS:
                continue
            if own_series and key == "epoch":
                continue
            value = (raw if math.isfinite(raw) else None) if kind is float else _finite_float(raw)
            if value is None or not key or len(key) > MAX_NAME_CHARS:
                rejected = True
                continue
            values.append((key, value))
        if step is None:
            if not values:
                # Nothing to record: don't consume a step number.
                if rejected:
                    raise _Malformed
                return []
            step = self._fallback_step()
        if not final:
            self.last_step = step
            if _MAX_STEPS_KEY in obj or _TOTAL_STEPS_KEY in obj:
                self._take_total(obj, step)
        if not values and rejected:
            raise _Malformed  # e.g. {"step": 1, "loss": NaN}: numbers were there but none usable
        rank = _rank(obj.get("rank"))
        # tuple.__new__ with the fields in order: a named tuple's own __new__ is a Python function, a call per
        # point on the follower's hot path
        return [_new_tuple(Point, (step, name, value, rank, final)) for name, value in values]

    def _take_total(self, obj: dict[Any, Any], step: int) -> None:
        """A logged ``max_steps``/``total_steps`` beside the step is progress, like a bar's N/M."""
        for key in TOTAL_KEYS:
            total = obj.get(key)
            if isinstance(total, int) and not isinstance(total, bool) and 0 < total <= _BIGINT_MAX:
                self.total_steps = total
                self.counter = step
                return

    # -- the job's own pattern --------------------------------------------------------------------

    def _parse_pattern(self, text: str) -> list[Point]:
        match = self.pattern.search(text) if self.pattern is not None else None
        if match is None:
            return []
        groups = {k: v for k, v in match.groupdict().items() if v is not None}
        if set(groups) - {"step"}:
            pairs = list(groups.items())
        else:
            pairs = [(m["key"], m["value"]) for m in _PAIR.finditer(text)]
            if "step" in groups:
                pairs.append(("step", groups["step"]))
        obj: dict[str, Any] = {}
        for key, raw in pairs:
            number = _number_from_text(raw.strip())
            if isinstance(number, (int, float)) and key not in obj:
                obj[key] = number
        step = _explicit_step(obj)
        if step is None:
            counter = _N_OF_M.search(text)
            if counter:
                step = self.counter = int(counter["n"])
                self.total_steps = int(counter["m"])
        return self._points(obj, step)


def _rich_row(text: str) -> list[tuple[str, str]] | None:
    """The metrics of a row under a rich bar ("train_loss: 0.062"; wrapped to the console's width in a log
    file, a row also holds the bar's times: "0:00:00   train_loss: 0.006"), None for any other line."""
    pairs = [(m["key"], m["value"]) for m in _RICH_ROW_PAIR.finditer(text)]
    if not pairs or not _RICH_ROW_REST.match(_RICH_ROW_PAIR.sub("", text)):
        return None
    return pairs


def _has_values(obj: dict[Any, Any]) -> bool:
    return any(isinstance(k, str) and k not in NOT_METRICS and _is_number(v) for k, v in obj.items())


def _number_from_text(value: Any) -> Any:
    """'4.867' -> 4.867 and '12' -> 12 (transformers 5 prints its numbers as strings); other values as they are."""
    if isinstance(value, str) and len(value) < 64 and _NUMBER_RE.match(value.strip()):
        text = value.strip()
        try:
            return int(text) if text.lstrip("+-").isdigit() else float(text)
        except (ValueError, OverflowError):
            return value
    return value


_SCAN_JSON = json.JSONDecoder().scan_once  # the C scanner under json.loads, without its two Python layers


def _load_json(text: str) -> Any:
    """json.loads of a stripped line, or None when it is not JSON (including too deep or too big to decode).
    The scanner is called directly, without json.loads' Python layers and whitespace regexes (every line the
    follower reads comes through here: bench/pass_cost.py times it); like json.loads it refuses anything
    after the value."""
    try:
        value, end = _SCAN_JSON(text, 0)
    except (StopIteration, ValueError, RecursionError, MemoryError, TypeError):
        return None
    return value if end == len(text) else None


def _is_number(value: Any) -> bool:
    """int or float, but not bool. Values here come from json.loads and ast.literal_eval, which make exact
    ints and floats, so the type itself is asked (cheaper than two isinstance calls, on every value)."""
    kind = type(value)
    return kind is float or kind is int


def _finite_float(value: int | float) -> float | None:
    """The value as a finite float, or None (NaN, inf, ints beyond float range)."""
    try:
        result = float(value)
    except OverflowError:
        return None
    return result if math.isfinite(result) else None


def _explicit_step(obj: dict[Any, Any]) -> int | None:
    """The object's step; None if it has no step key; _Malformed if the key holds no usable integer."""
    for key in STEP_KEYS:
        if key not in obj:
            continue
        raw = obj[key]
        if not _is_number(raw):
            raise _Malformed
        if isinstance(raw, float):
            if not math.isfinite(raw) or not raw.is_integer():
                raise _Malformed
            raw = int(raw)
        if not _BIGINT_MIN <= raw <= _BIGINT_MAX:
            raise _Malformed
        return raw
    return None


def _rank(raw: Any) -> int | None:
    """The line's own rank if it is a plausible int (fits the rank column), else None."""
    if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw <= _INT_MAX:
        return raw
    return None
