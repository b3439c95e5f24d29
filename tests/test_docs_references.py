"""Docs that cannot drift: what README.md and docs/*.md name in the code exists in the code.

Read statically (the markdown as text, Python by its syntax tree), no server, no database. The rules:

1. Paths. Every `dir/...` whose first part is a top-level directory of the checkout (`jobs/lifecycle.py`,
   `cluster/node/`, `bin/start`, `bench/results/x.json`), in prose, code spans or code blocks, exists;
   `<...>`, `{...}` and `*` in it match anything. Directories made at run time (`data/`, `outputs/`, ...)
   are not checked; `app/0002_name` (or `app/0002`) is that app's migration. A file named alone in backticks
   (`page_load.py`) exists somewhere in the checkout. Every relative markdown link target exists (relative to
   its page).
2. Environment variables. Every `UGRO_...` name anywhere in the docs occurs in the code.
3. Code names in backticks, where they occur in the code (see CODE_SUFFIXES) as a word unless they are
   outside UGRO's code (EXTERNAL):
   - an upper-case name with an underscore (`RETRY_BACKOFF_S`, `DATABASE_URL`);
   - a lower-case name with an underscore or called (`_move`, `create_job`, `launch()`);
   - a dotted name whose first part is one of UGRO's packages, modules or classes: the rest is defined there
     (`lifecycle.judge`, `jobs.Job`, `cluster.tasks.poll_health`, `Rank.metric_step`).
4. A name tied to a file: "`jobs/recovery.py` `RETRY_BACKOFF_S`", "`FOLLOW_LEASE_S` in `jobs/follow.py`" and
   "`STARTING_GRACE_S` (60 s, `jobs/lifecycle.py`)" mean the name is defined in that file.

`ugro ...` and `manage.py ...` command lines are tests/test_docs_commands.py's; the README's settings table is
tests/test_settings_table.py's.
"""

from __future__ import annotations

import ast
import os
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Where names are looked up: the code, its scripts and pages (not the docs, nor recorded results, nor what runs make)
CODE_SUFFIXES = {".py", ".js", ".html", ".css", ".sh", ".toml", ".yml", ".yaml", ".cfg", ""}
SKIPPED = {"data", "docs", "outputs", "test-artifacts", "bench/results", "bench/out", "static/vendor"}
# Top-level directories that exist only at run time (a user's data dir, a job's outputs): paths in them are not
# the checkout's
RUNTIME_ROOTS = {"data", "outputs", "test-artifacts"}
# Names from outside UGRO's code that the docs mention on purpose (those its code also uses need no entry). Keep
# it short: a UGRO name that went away must not hide here.
EXTERNAL = {
    "NCCL_SOCKET_IFNAME", "brpop_timeout", "recently_deleted()",  # NCCL's, channels_redis', the kernel's
    "add_scalar", "flush_logs_every_n_steps", "logging_dir", "save_dir",  # TensorBoard's, Lightning's, the Trainer's
    "bench_rank.py",  # the rank script the benchmarks write into each node's workdir
}  # fmt: skip
# Written like a path, not one: TensorBoard's metric names
NOT_PATHS = {"train/loss", "train/loss_scale", "train/weight_norm"}

IDENT = r"[A-Za-z_]\w*"
SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^\s*```")
UPPER = re.compile(r"[A-Z][A-Z0-9]*_[A-Z0-9_]*[A-Z0-9]")
SNAKE = re.compile(r"_?[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?:\(\))?|[a-z_]\w*\(\)")
DOTTED = re.compile(rf"{IDENT}(?:\.{IDENT})+(?:\(\))?")
ENV = re.compile(r"\bUGRO_[A-Z0-9_]*[A-Z0-9]\b")
FILE_NAME = re.compile(r"[\w.-]+\.(?:py|sh|js|html|css)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FILE_EXT = re.compile(r"\.(py|md|json|jsonl|csv|log|txt|yaml|yml|sh|js|html|pt|pth|ckpt|bin|safetensors|toml|cfg|"
                      r"sqlite3|socket)$")  # fmt: skip
# "`jobs/x.py` `NAME`", "`NAME` in `jobs/x.py`", "`NAME` (60 s, `jobs/x.py`)"
TIED = [
    re.compile(rf"`(?P<path>[\w/.-]+\.py)`\s+`(?P<name>{IDENT})(?:\(\))?`"),
    re.compile(rf"`(?P<name>{IDENT})(?:\(\))?`\s+in\s+`(?P<path>[\w/.-]+\.py)`"),
    re.compile(rf"`(?P<name>{IDENT})(?:\(\))?`\s+\((?:[^`()]*,\s*)?`(?P<path>[\w/.-]+\.py)`"),
]


def roots() -> set[str]:
    """The checkout's top-level directories whose paths the docs may name."""
    return {p.name for p in REPO.iterdir() if p.is_dir() and p.name not in RUNTIME_ROOTS | {"__pycache__"}
            and (not p.name.startswith(".") or p.name == ".ci")}  # fmt: skip


@cache
def code_files() -> tuple[Path, ...]:
    """The checkout's code: every text file of a CODE_SUFFIXES kind (scripts in bin/ and .ci/ have none)."""
    found = []
    for top, dirs, files in os.walk(REPO):
        here = Path(top)
        rel = here.relative_to(REPO).as_posix()
        dirs[:] = [d for d in dirs if d != "__pycache__" and (rel != "." or not d.startswith(".") or d == ".ci")
                   and f"{rel}/{d}".removeprefix("./") not in SKIPPED]  # fmt: skip
        for name in files:
            path = here / name
            if path.suffix not in CODE_SUFFIXES or path == Path(__file__).resolve():  # its made-up names are not code
                continue
            if path.suffix or here.name in ("bin", ".ci") or name == "Dockerfile":
                found.append(path)
    return tuple(sorted(found))


@cache
def code_words() -> frozenset[str]:
    words: set[str] = set()
    for path in code_files():
        words.update(re.findall(r"[A-Za-z_]\w*", path.read_text(errors="replace")))
    return frozenset(words)


def _bound(body: list[ast.stmt]) -> set[str]:
    """Names a module or class body defines: defs, classes, assignments (Django fields included); not what it
    imports, so "`NAME` in `x.py`" means x.py is where NAME is."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            for t in node.targets:
                if isinstance(t, ast.Tuple):
                    names.update(e.id for e in t.elts if isinstance(e, ast.Name))
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.If | ast.Try):  # a definition under `if` or `try`
            names |= _bound(node.body) | _bound(node.orelse)
    return names


@cache
def defined_in(path: Path) -> frozenset[str]:
    """Names a Python file defines, at its top or in its classes."""
    tree = ast.parse(path.read_text(), str(path))
    names = _bound(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names |= _bound(node.body)
    return frozenset(names)


@cache
def class_attributes(name: str) -> frozenset[str] | None:
    """What the classes of this name in the checkout define (None: there is none)."""
    attrs: set[str] | None = None
    for file in class_files().get(name, []):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.ClassDef) and node.name == name:
                attrs = (attrs or set()) | _bound(node.body)
    return None if attrs is None else frozenset(attrs)


@cache
def class_files() -> dict[str, list[Path]]:
    """Class name -> the Python files that define a class of that name."""
    found: dict[str, list[Path]] = {}
    for files in python_files().values():
        for file in files:
            for name in set(re.findall(r"^\s*class (\w+)", file.read_text(), re.M)):
                found.setdefault(name, []).append(file)
    return found


@cache
def python_files() -> dict[str, list[Path]]:
    """Module stem (a package's: its directory's name) -> its files, over every Python file of the checkout."""
    stems: dict[str, list[Path]] = {}
    for path in code_files():
        if path.suffix == ".py":
            stems.setdefault(path.parent.name if path.name == "__init__.py" else path.stem, []).append(path)
    return stems


def _modules(dotted: list[str]) -> list[Path] | None:
    """The files a dotted module path names (`jobs`, `jobs.models`, `lifecycle`), or None."""
    if len(dotted) > 1 or (REPO / dotted[0]).is_dir():
        base = REPO.joinpath(*dotted)
        if (base / "__init__.py").exists():
            return [base / "__init__.py", *sorted(base.glob("*.py"))]  # a package: any of its modules
        return [base.with_suffix(".py")] if base.with_suffix(".py").is_file() else None
    return python_files().get(dotted[0])


def dotted_problem(span: str) -> str | None:
    """Why a dotted name of UGRO's does not resolve, or None (it resolves, or it is not UGRO's)."""
    parts = span.removesuffix("()").split(".")
    if (REPO / parts[0]).is_dir() and _modules(parts):  # a module: jobs.models
        return None
    for cut in range(len(parts) - 1, 0, -1):  # the longest module path first: cluster.tasks.poll_health
        files = _modules(parts[:cut])
        if files is None:
            continue
        rest = parts[cut:]
        if len(rest) > 1 and _modules(parts[: cut + 1]):
            continue
        if any(rest[0] in defined_in(f) for f in files):
            if len(rest) == 1 or rest[1] in (class_attributes(rest[0]) or ()):
                return None
        return f"`{span}`: {'.'.join(parts[:cut])} has no {'.'.join(rest)}"
    if (attrs := class_attributes(parts[0])) is not None:
        if parts[1] in attrs:
            return None
        return f"`{span}`: class {parts[0]} has no {parts[1]}"
    return None  # not UGRO's (a cluster.yaml key, a framework's API, a file name)


def path_problem(text: str) -> str | None:
    """Why a checkout path named in the docs does not exist, or None."""
    path = text.rstrip(".,:;")
    if path in NOT_PATHS:
        return None
    if m := re.fullmatch(r"(\w+)/(?:migrations/)?(\d{4})(_\w+)?", path):  # a migration: accounts/0002_roles, jobs/0009
        path = f"{m[1]}/migrations/{m[2]}{m[3] or '_*'}.py"
    if re.search(r"[<{*]", path):
        pattern = re.sub(r"<[^>/]*>|\{[^}/]*\}", "*", path).rstrip("/")
        return None if next(REPO.glob(pattern), None) else f"{path}: nothing matches"
    return None if (REPO / path).exists() else f"{path}: no such file or directory"


def paragraphs(text: str) -> list[tuple[int, str, bool]]:
    """(first line number, text, is code) of each paragraph and code block; a table row is a paragraph."""
    out: list[tuple[int, str, bool]] = []
    lines = text.splitlines()
    start, chunk, fenced = 1, [], False

    def flush(code: bool) -> None:
        if chunk:
            out.append((start, "\n".join(chunk), code))
            chunk.clear()

    for number, line in enumerate(lines, 1):
        if FENCE.match(line):
            flush(fenced)
            fenced = not fenced
            start = number + 1
            continue
        if not fenced and (not line.strip() or line.lstrip().startswith("|")):
            flush(False)
            if line.strip():
                out.append((number, line, False))
            start = number + 1
            continue
        if not chunk:
            start = number
        chunk.append(line)
    flush(fenced)
    return out


def problems(text: str, where: str, page: Path = REPO / "README.md") -> list[str]:
    """Every reference to the code in this markdown that the code lacks, as "where:line: why"."""
    found: list[str] = []
    words = code_words()
    path_re = re.compile(rf"(?<![\w./~$@-])((?:{'|'.join(map(re.escape, sorted(roots())))})/[\w.*<>{{}}/-]*)")
    for number, para, code in paragraphs(text):
        lines = para.splitlines()

        def report(why: str, needle: str, first: int = number, lines: list[str] = lines) -> None:
            found.append(f"{where}:{first + next((i for i, ln in enumerate(lines) if needle in ln), 0)}: {why}")

        for match in path_re.finditer(para):
            if why := path_problem(match.group(1)):
                report(why, match.group(1))
        for target in [] if code else LINK.findall(para):
            target = target.split("#", 1)[0]
            if target and not re.match(r"[a-z]+:|/", target) and not (page.parent / target).exists():
                report(f"link to {target}: no such file", target)
        for name in set(ENV.findall(para)) - words:
            report(f"{name}: no code reads or sets it", name)
        if code:
            continue
        for span in SPAN.findall(para):
            span = span.strip()
            if span in EXTERNAL:
                continue
            if FILE_NAME.fullmatch(span):
                if span not in {p.name for p in code_files()}:
                    report(f"`{span}`: no file of that name", span)
                continue
            if (UPPER.fullmatch(span) and not ENV.fullmatch(span)) or SNAKE.fullmatch(span):  # UGRO_*: above
                if span.removesuffix("()") not in words:
                    report(f"`{span}`: no such name in the code", span)
            elif DOTTED.fullmatch(span) and not FILE_EXT.search(span):
                if why := dotted_problem(span):
                    report(why, span)
        flat = " ".join(para.split())
        for pattern in TIED:
            for m in pattern.finditer(flat):
                file = REPO / m["path"]
                if file.is_file() and m["name"] not in defined_in(file) and m["name"] in words:
                    report(f"`{m['name']}` is not defined in {m['path']}", m["name"])
    return sorted(found, key=lambda p: int(p.split(":")[1]))


@pytest.mark.parametrize("page", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_every_code_reference_in_the_docs_exists(page: Path):
    where = str(page.relative_to(REPO))
    assert problems(page.read_text(), where, page) == []


def test_the_docs_name_code_of_every_kind():
    # the rules find something to check: paths, links, variables, constants, functions and dotted names
    text = "\n".join(p.read_text() for p in DOCS)
    assert len(set(ENV.findall(text))) > 15 and text.count("`jobs/") > 20
    spans = SPAN.findall(text)
    ours = {
        s for s in spans if DOTTED.fullmatch(s) and (_modules(s.split(".")[:1]) or class_attributes(s[: s.find(".")]))
    }
    assert len(ours) > 20, ours
    assert sum(bool(UPPER.fullmatch(s)) for s in spans) > 40 and sum(bool(SNAKE.fullmatch(s)) for s in spans) > 40


def test_a_stale_reference_of_each_kind_is_found():
    # given a page that names things the code does not have, one of each kind
    page = "\n".join([
        "The follower lives in `jobs/watch.py`, its pages in templates/no_such/ and [its doc](no-such.md).",  # 1
        "Set UGRO_NO_SUCH_KNOB to 3.",  # 2
        "The backoff (`RETRY_BACKOFF_GONE_S`) and `no_such_function()` decide.",  # 3
        "`lifecycle.no_such` and `jobs.NoSuchModel` and `Rank.no_such_field`.",  # 4
        "",
        "| a | `jobs/recovery.py` `HANG_FACTOR_GONE` |",  # 6
        "`FOLLOW_LEASE_S` in `jobs/lifecycle.py`, and `STARTING_GRACE_S` (60 s, `jobs/follow.py`).",  # 7
        "Run `gone_helper.py` once, after migration jobs/0999.",  # 8
        "```",
        "bin/no-such-script --flag",  # 10
        "```",
    ])  # fmt: skip
    # when it is checked
    found = problems(page, "page.md", REPO / "docs" / "page.md")
    # then each is named with its line
    assert found == [
        "page.md:1: jobs/watch.py: no such file or directory",
        "page.md:1: templates/no_such/: no such file or directory",
        "page.md:1: link to no-such.md: no such file",
        "page.md:2: UGRO_NO_SUCH_KNOB: no code reads or sets it",
        "page.md:3: `RETRY_BACKOFF_GONE_S`: no such name in the code",
        "page.md:3: `no_such_function()`: no such name in the code",
        "page.md:4: `lifecycle.no_such`: lifecycle has no no_such",
        "page.md:4: `jobs.NoSuchModel`: jobs has no NoSuchModel",
        "page.md:4: `Rank.no_such_field`: class Rank has no no_such_field",
        "page.md:6: `HANG_FACTOR_GONE`: no such name in the code",
        "page.md:7: `FOLLOW_LEASE_S` is not defined in jobs/lifecycle.py",
        "page.md:7: `STARTING_GRACE_S` is not defined in jobs/follow.py",
        "page.md:8: jobs/migrations/0999_*.py: nothing matches",
        "page.md:8: `gone_helper.py`: no file of that name",
        "page.md:10: bin/no-such-script: no such file or directory",
    ], found
    # and what exists is not
    real = "`jobs/recovery.py` `RETRY_BACKOFF_S`, `lifecycle.judge`, `_move`, `jobs.Job`, cluster/node/, jobs/0001"
    assert problems(real, "real.md") == []
