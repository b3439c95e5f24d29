"""The README's configuration table is every variable the server reads, and no more than 20 of them: each other
knob is a named constant beside its code. Read statically: Python by its syntax tree, the start scripts by their
`${NAME}` expansions."""

from __future__ import annotations

import ast
import re

import pytest

from .conftest import REPO

MOST = 20
ENV_HELPERS = {"env_str", "env_int", "env_float", "env_bool", "env_list", "env_choice", "env_email_url"}
# the server's code: the controller's packages, its entry points and its start scripts (not the node agent, which
# runs on the nodes, nor the training script, which reads what UGRO gives each rank)
SERVER_PACKAGES = ("ugro_site", "cluster", "jobs", "metrics", "accounts", "api", "serving")
SERVER_SCRIPTS = ("bin/start", "bin/worker")
# Test-only: set by bin/test and by tests for the controllers they start, read by tests/settings.py and
# tests/controller.py alone; never a user's setting, so never in the table.
TEST_ONLY = {"UGRO_TEST_DB_NAME", "UGRO_TEST_CONSTANTS"}
SYSTEM = {"XDG_CONFIG_HOME"}  # the desktop's own: where the client keeps its token


def readme_tables() -> tuple[set[str], set[str]]:
    """(the server's variables, the client's), from the two tables under "## Configuration (environment)"."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Configuration (environment)", 1)[1].split("\n## ", 1)[0]
    tables: list[set[str]] = []
    for block in re.split(r"\n\s*\n", section):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        if rows:
            tables.append({name for row in rows[2:] for name in re.findall(r"`([A-Z][A-Z0-9_]*)`", row.split("|")[1])})
    server, client = tables
    return server, client


def python_reads(paths) -> dict[str, str]:
    """Every environment variable these modules read by name: {name: where}. A read whose name is not a
    literal fails here, as the table could not be checked against it (the helpers' own `name` excepted)."""
    found: dict[str, str] = {}
    for path in paths:
        tree = ast.parse(path.read_text())
        helpers = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in ENV_HELPERS}
        for node in ast.walk(tree):
            arg = _env_name_arg(node)
            if arg is None:
                continue
            where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{node.lineno}"
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found[arg.value] = where
            elif not (helpers and isinstance(arg, ast.Name) and arg.id == "name"):
                raise AssertionError(f"{where}: an environment read whose name is not a literal")
    return found


def _env_name_arg(node: ast.AST) -> ast.expr | None:
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ENV_HELPERS:
            return node.args[0]
        if isinstance(func, ast.Attribute) and (
            (func.attr == "get" and _is_environ(func.value)) or (func.attr == "getenv" and _is_name(func.value, "os"))
        ):
            return node.args[0]
    if isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
        return node.slice
    if isinstance(node, ast.Compare) and len(node.comparators) == 1 and _is_environ(node.comparators[0]):
        return node.left
    return None


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and _is_name(node.value, "os")


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def script_reads(path) -> set[str]:
    """The upper-case variables a shell script expands and does not set itself."""
    text = path.read_text()
    expanded = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", text))
    assigned = set(re.findall(r"^\s*(?:export\s+)?([A-Z][A-Z0-9_]*)=", text, re.MULTILINE))
    return expanded - assigned


def server_reads() -> dict[str, str]:
    modules = [REPO / "manage.py"]
    for package in SERVER_PACKAGES:
        modules += [p for p in sorted((REPO / package).rglob("*.py")) if "node" not in p.relative_to(REPO).parts]
    found = python_reads(modules)
    for script in SERVER_SCRIPTS:
        found.update({name: script for name in script_reads(REPO / script) if name not in found})
    return found


def test_the_readme_table_is_every_variable_the_server_reads_and_at_most_twenty():
    table, _ = readme_tables()
    read = server_reads()
    assert set(read) - table == set(), {n: read[n] for n in set(read) - table}  # read, with no row in the table
    assert table - set(read) == set()  # a row that nothing reads
    assert len(table) <= MOST, sorted(table)


def test_the_settings_module_reads_only_table_variables():
    table, _ = readme_tables()
    settings_reads = python_reads([REPO / "ugro_site" / "settings.py", REPO / "ugro_site" / "env.py"])
    assert set(settings_reads) <= table and len(settings_reads) >= 10, settings_reads


def test_the_client_table_is_every_variable_the_client_reads():
    _, client = readme_tables()
    read = python_reads(sorted((REPO / "ugro_client").rglob("*.py")))
    assert set(read) - SYSTEM == client, read


def test_test_only_variables_stay_with_the_tests():
    table, client = readme_tables()
    assert not TEST_ONLY & (table | client | set(server_reads()))
    assert set(python_reads([REPO / "tests" / "settings.py", REPO / "tests" / "controller.py"])) == TEST_ONLY


def test_a_new_read_without_a_row_is_caught(tmp_path):
    # given a module that reads a variable the table does not name
    module = tmp_path / "knob.py"
    module.write_text('import os\nX = env_float("UGRO_NEW_KNOB_S", 1.0)\nY = os.environ.get("UGRO_OTHER", "")\n')
    (tmp_path / "dynamic.py").write_text('key = "x"\nZ = env_float(f"UGRO_{key}", 1.0)\n')
    # then both names are found, and a name built at run time is refused
    assert set(python_reads([module])) == {"UGRO_NEW_KNOB_S", "UGRO_OTHER"}
    with pytest.raises(AssertionError, match="not a literal"):
        python_reads([tmp_path / "dynamic.py"])


def test_mail_is_one_url_and_a_bad_one_is_refused_naming_the_variable(monkeypatch):
    from ugro_site.env import EnvError, env_email_url

    # given no EMAIL_URL: this machine's mail server, and no password reset
    monkeypatch.delenv("EMAIL_URL", raising=False)
    mail = env_email_url("EMAIL_URL")
    assert (mail.options["host"], mail.options["port"], mail.configured) == ("localhost", 25, False)
    # given a STARTTLS server with a password that needs escaping and a sender
    monkeypatch.setenv("EMAIL_URL", "smtp+tls://ops:p%40ss@mail.lab.example:587?from=ugro@lab.example")
    mail = env_email_url("EMAIL_URL")
    assert mail.backend.endswith("smtp.EmailBackend") and mail.configured and mail.sender == "ugro@lab.example"
    assert {k: mail.options[k] for k in ("host", "port", "username", "password", "use_tls")} == {
        "host": "mail.lab.example", "port": 587, "username": "ops", "password": "p@ss", "use_tls": True}  # fmt: skip
    # when the URL is not one UGRO can use: one line naming the variable, never the password
    for bad in ("ftp://ops:secret@mail", "smtp://ops:secret@mail:twenty", "smtp://ops:secret@mail?tls=1"):
        monkeypatch.setenv("EMAIL_URL", bad)
        with pytest.raises(EnvError, match="^EMAIL_URL") as refused:
            env_email_url("EMAIL_URL")
        assert "secret" not in str(refused.value) and "\n" not in str(refused.value)
