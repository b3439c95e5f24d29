"""No tests here any more (a dead worker started again: tests/test_start_script.py; Ctrl-C: tests/test_newcomer_e2e.py).

Kept only while tests/test_newcomer_e2e.py imports started_by from this module; it lives in tests/conftest.py.
"""

from __future__ import annotations

from .conftest import started_by

__all__ = ["started_by"]
