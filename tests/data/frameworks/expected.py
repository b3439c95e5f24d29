"""Write expected.json beside each recording from what UGRO reads of it now (after record.sh).

    .venv/bin/python tests/data/frameworks/expected.py

Then read the diff line by line against the recorded output: the expected files are what
tests/test_framework_corpus.py holds UGRO to, so a wrong reading written here would pass.
The metrics pattern of a recording (a script no framework formats for) is kept in its expected.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugro_site.settings")

PATTERNS = {"accelerate_loop": r"^epoch \d+"}


def read_log(directory: Path, pattern: str | None) -> dict:
    from metrics.parsing import LineParser

    parser = LineParser(pattern=pattern)
    points = []
    for line in (directory / "rank_0.log").read_bytes().decode("utf-8", "replace").split("\n"):
        points.extend(parser.feed(line))
    points.extend(parser.flush())
    return {
        "points": [[p.step, p.name, p.value] for p in points if not p.final],
        "final": {p.name: p.value for p in points if p.final},
        "total_steps": parser.total_steps,
        "malformed": parser.malformed,
    }


def read_files(directory: Path) -> dict:
    from metrics.files import csv_points, events_points

    out = {}
    for path in sorted(directory.rglob("metrics.csv")):
        header, _, rows = path.read_bytes().decode().partition("\n")
        out[str(path.relative_to(directory))] = [list(t) for t in csv_points(header, rows, 0)[0]]
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        out[str(path.relative_to(directory))] = [list(t) for t in events_points(path, 0)[0]]
    return out


def main() -> None:
    import django

    django.setup()
    for directory in sorted(p for p in HERE.iterdir() if (p / "rank_0.log").exists()):
        pattern = PATTERNS.get(directory.name)
        expected = {"pattern": pattern, "log": read_log(directory, pattern), "files": read_files(directory)}
        (directory / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
        print(f"wrote {directory.name}/expected.json")  # noqa: T201


if __name__ == "__main__":
    main()
