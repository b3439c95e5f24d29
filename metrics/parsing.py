"""Turn the lines a training rank prints into metric points.

Three shapes of line carry metrics:

* a JSON object with an integer ``step`` (or ``global_step``), one line per log
  event, as the reference script ``train/train_production.py`` prints;
* ``UGRO_METRIC {...}``: a JSON object with an explicit marker, whose step may
  be left out and is then inferred;
* the Python-repr dicts the Hugging Face Trainer prints
  (``{'loss': 2.31, 'learning_rate': 0.0002, 'epoch': 0.12}``), step inferred.

Everything else is a plain log line.  The parser never raises: a follower that
dies on one odd line would lose every later metric of the run.

This module is pure Python (no Django) so it can be tested and reused anywhere.
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from typing import Any

MAX_LINE_CHARS = 65536  # longer lines are truncated for storage and never parsed as metrics

METRIC_PREFIX = "UGRO_METRIC "
# literal_eval is only ever applied to short lines of this shape (HF Trainer dicts).
REPR_DICT_MAX_CHARS = 4096
# MetricPoint.name is a CharField(max_length=100): longer keys could not be stored.
MAX_NAME_CHARS = 100

STEP_KEYS = ("step", "global_step")
NOT_METRICS = frozenset({"step", "global_step", "rank"})

# Bounds of the database columns the values end up in (BigIntegerField, IntegerField).
_BIGINT_MIN, _BIGINT_MAX = -(2**63), 2**63 - 1
_INT_MAX = 2**31 - 1


@dataclass(frozen=True)
class Point:
    """One value of one named metric at one step."""

    step: int
    name: str
    value: float
    rank: int | None  # the line's own "rank" field if it carried an int one, else None


class _Malformed(Exception):
    """Raised inside the parser for a line that looked like metrics but cannot be used."""


class LineParser:
    """One per rank stream.

    feed() each line (str, without the trailing newline, already decoded with
    errors='replace').

    ``malformed`` counts lines that looked like metrics (start with ``{`` or
    ``UGRO_METRIC ``) but could not be used, or were too long to parse;
    ``metric_lines`` counts lines that produced at least one point;
    ``last_step`` is the last step seen, explicit or inferred (None before any).
    """

    def __init__(self) -> None:
        self.malformed: int = 0
        self.metric_lines: int = 0
        self.last_step: int | None = None

    def feed(self, line: str) -> list[Point]:
        """Parse one line; return its points ([] for plain log lines). Never raises."""
        try:
            points = self._parse(line)
        except Exception:  # _Malformed, or anything unforeseen: one odd line must not kill the follower
            self.malformed += 1
            return []
        if points:
            self.metric_lines += 1
        return points

    def _parse(self, line: str) -> list[Point]:
        if not isinstance(line, str):
            raise _Malformed
        if len(line) > MAX_LINE_CHARS:
            raise _Malformed
        text = _last_segment(line)
        if text.startswith(METRIC_PREFIX):
            return self._parse_marked(text[len(METRIC_PREFIX) :])
        if not text.startswith("{"):
            return []
        obj = _load_json(text)
        if obj is not None:
            return self._parse_json_object(obj)
        if text.startswith("{'") and text.endswith("}") and len(text) < REPR_DICT_MAX_CHARS:
            return self._parse_repr_dict(text)
        raise _Malformed

    def _parse_marked(self, payload: str) -> list[Point]:
        """``UGRO_METRIC {...}``: the marker promises metrics, so getting none is malformed."""
        obj = _load_json(payload.strip())
        if not isinstance(obj, dict):
            raise _Malformed
        points = self._points(obj)
        if not points:
            raise _Malformed
        return points

    def _parse_json_object(self, obj: Any) -> list[Point]:
        """A bare JSON line is a metric line only if it carries a step."""
        if not isinstance(obj, dict) or not any(key in obj for key in STEP_KEYS):
            return []
        return self._points(obj)

    def _parse_repr_dict(self, text: str) -> list[Point]:
        """A Hugging Face Trainer log dict, printed with repr()."""
        try:
            obj = ast.literal_eval(text)
        except Exception as exc:  # literal_eval raises many types (ValueError, SyntaxError, MemoryError, ...)
            raise _Malformed from exc
        if not isinstance(obj, dict):
            raise _Malformed
        return self._points(obj)

    def _points(self, obj: dict[Any, Any]) -> list[Point]:
        """Points of one parsed object, its step explicit or else inferred; updates ``last_step``."""
        step = _explicit_step(obj)
        values: list[tuple[str, float]] = []
        rejected = False
        for key, raw in obj.items():
            if not isinstance(key, str) or key in NOT_METRICS or not _is_number(raw):
                continue
            value = _finite_float(raw)
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
            step = (self.last_step if self.last_step is not None else 0) + 1
        self.last_step = step
        if not values and rejected:
            raise _Malformed  # e.g. {"step": 1, "loss": NaN}: numbers were there but none usable
        rank = _rank(obj.get("rank"))
        return [Point(step=step, name=name, value=value, rank=rank) for name, value in values]


def _last_segment(line: str) -> str:
    """The text a terminal would show last: tqdm redraws with '\\r' and HF prints its dict after the bar."""
    if "\r" in line:
        for segment in reversed(line.split("\r")):
            if segment.strip():
                return segment.strip()
        return ""
    return line.strip()


def _load_json(text: str) -> Any:
    """json.loads, or None when the text is not JSON (including too deep or too big to decode)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError, MemoryError, TypeError):
        return None


def _is_number(value: Any) -> bool:
    """int or float, but not bool (a subclass of int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
