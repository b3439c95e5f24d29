"""Every end-to-end test says, in a `Covers:` line of its docstring, the path it alone covers.

An end-to-end test (real sshd, torchrun, Chromium or bin/start) costs 5-60 s of a CI run that must stay
under 12 minutes, so it earns its place by driving a path no faster test drives; the rest runs against
the fake agent (tests/fake_agent.py). This reads the test files with `ast` and imports none of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def is_e2e_mark(node: ast.AST) -> bool:
    """True where an expression holds `pytest.mark.e2e` (or `mark.e2e`), called or not."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr == "e2e":
            owner = sub.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "mark") or (
                isinstance(owner, ast.Name) and owner.id == "mark"
            ):
                return True
    return False


def _marked_by_pytestmark(body: list[ast.stmt]) -> bool:
    for stmt in body:
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets = [stmt.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets) and is_e2e_mark(stmt.value):
            return True
    return False


def _decorated(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> bool:
    return any(is_e2e_mark(d) for d in node.decorator_list)


def e2e_tests(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """The module's end-to-end test functions, each with its pytest id (`test` or `Class::test`)."""
    found = []
    module_e2e = _marked_by_pytestmark(tree.body)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            if module_e2e or _decorated(node):
                found.append((node.name, node))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            class_e2e = module_e2e or _decorated(node) or _marked_by_pytestmark(node.body)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    if class_e2e or _decorated(item):
                        found.append((f"{node.name}::{item.name}", item))
    return found


def says_what_it_covers(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """True where the docstring has a line `Covers: <something>`."""
    doc = ast.get_docstring(func) or ""
    return any(
        line.strip().startswith("Covers:") and line.strip()[len("Covers:") :].strip() for line in doc.splitlines()
    )


def offenders(source: str, name: str) -> list[str]:
    """`name::test` for each end-to-end test in `source` whose docstring has no `Covers:` line."""
    tree = ast.parse(source, filename=name)
    return [f"{name}::{test}" for test, func in e2e_tests(tree) if not says_what_it_covers(func)]


def test_every_e2e_test_says_which_path_it_alone_covers():
    # given every test module of the suite
    bad = []
    for path in sorted(TESTS.glob("test_*.py")):
        # when each end-to-end test's docstring is read
        bad += offenders(path.read_text(), f"tests/{path.name}")
    # then each names, in a `Covers:` line, the path no faster test covers
    assert not bad, (
        "end-to-end tests without a 'Covers:' line in their docstring (say which path no faster test covers, "
        "or move the test onto the fake agent, tests/fake_agent.py):\n" + "\n".join(bad)
    )


def test_the_check_finds_e2e_tests_however_they_are_marked():
    # given e2e tests marked at module level, on a class, on a function, and a fast test beside them
    marked_module = '''
import pytest
pytestmark = [pytest.mark.browser, pytest.mark.e2e]
def test_bare(): pass
def test_told():
    """Launches on sshd.

    Covers: a launch over real SSH.
    """
def test_empty_covers():
    """Covers:"""
'''
    marked_here = '''
import pytest
def test_fast(): pass
@pytest.mark.e2e
def test_decorated(): pass
@pytest.mark.e2e
class TestNodes:
    def test_in_class(self):
        """Nothing said."""
class TestMixed:
    pytestmark = pytest.mark.e2e
    def test_class_mark(self): pass
'''
    # when the check reads them
    # then it names each e2e test without a Covers: line, and neither the fast nor the told one
    assert offenders(marked_module, "m.py") == ["m.py::test_bare", "m.py::test_empty_covers"]
    assert offenders(marked_here, "h.py") == [
        "h.py::test_decorated",
        "h.py::TestNodes::test_in_class",
        "h.py::TestMixed::test_class_mark",
    ]
