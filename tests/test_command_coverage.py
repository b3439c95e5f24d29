"""Every management command UGRO adds is exercised by at least one test (a missing one fails here)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_command_has_a_test():
    commands = {p.stem for app in ("cluster", "jobs", "metrics", "accounts", "serving") for p in
                (REPO / app / "management" / "commands").glob("*.py") if p.stem != "__init__"}  # fmt: skip
    tests = "\n".join(p.read_text() for p in (REPO / "tests").glob("test_*.py"))
    untested = sorted(c for c in commands if not re.search(rf"""\(\s*["']{c}["']""", tests))
    assert untested == [], f"commands without a test: {untested}"
