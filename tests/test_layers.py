"""The apps depend on each other one way (docs/architecture.md, Layers): every import in the product code, at
module level and inside functions, is checked against the declared order."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("ugro_site", "accounts", "cluster", "jobs", "metrics", "api", "serving")
OUTSIDE = ("tests", "bench")  # the test rig (tests/loopback.py) and benchmarks: the product never imports them

# Lowest first: a module imports from its own layer and the layers below it. The longest prefix decides.
LAYERS = (
    ("site", ("ugro_site",)),  # settings, env, database, the Celery app, publish: what every app stands on
    ("cluster", ("cluster",)),  # nodes, links, agent, health
    ("job records", ("jobs.models", "jobs.events", "jobs.logs")),  # what metrics' rows hang off
    ("metrics", ("metrics",)),
    ("jobs", ("jobs",)),  # launch, follow, lifecycle, scheduler: they feed and read metrics
    ("accounts", ("accounts",)),  # who may do what: its rules name jobs (owner, queue quota)
    ("serving", ("serving",)),  # services: replicas on held GPUs from jobs' checkpoints; nothing below imports it
)
# Surfaces sit on top of every layer: pages, JSON, websockets, admin, commands, the REST API, the site's routes.
SURFACE_PARTS = {"views", "admin", "urls", "consumers", "routing", "asgi", "management"}
SURFACE_PACKAGES = ("api",)
# Never, surfaces included: cluster knows nothing of jobs or metrics; metrics nothing of cluster.
APART = {"cluster": ("jobs", "metrics"), "metrics": ("cluster",)}
# Imports that break the order today, each with its reason; one that is gone must leave this list too.
KNOWN: dict[tuple[str, str], str] = {}  # (module, import) -> why it may go up the order, for now


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_surface(module: str) -> bool:
    parts = module.split(".")
    return parts[0] in SURFACE_PACKAGES or any(
        p in SURFACE_PARTS or p.endswith(("_view", "_views")) for p in parts[1:]
    )


def layer(module: str) -> int:
    """The index in LAYERS of the longest prefix that names `module` (or a package above it)."""
    best, length = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = index, len(prefix)
    return best


def product_files() -> list[Path]:
    return sorted(
        p
        for package in PACKAGES
        for p in (REPO / package).rglob("*.py")
        if "migrations" not in p.parts and "tests" not in p.parts
    )


def _is_module(dotted: str) -> bool:
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imported(path: Path, tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, at any depth, relative ones resolved."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            subs = [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")]
            found += [(node.lineno, m) for m in subs] or [(node.lineno, base)]
    return sorted((line, m) for line, m in found if m.split(".")[0] in PACKAGES + OUTSIDE)


def offences() -> tuple[list[str], set[tuple[str, str]]]:
    bad, known = [], set()
    for path in product_files():
        source = module_name(path)
        top = source.split(".")[0]
        for line, target in imported(path, ast.parse(path.read_text())):
            where = f"{path.relative_to(REPO)}:{line}: imports {target}"
            if target.split(".")[0] in OUTSIDE:
                bad.append(f"{where} (the product never imports {target.split('.')[0]})")
            elif target.split(".")[0] in APART.get(top, ()):
                bad.append(f"{where} ({top} never imports {target.split('.')[0]})")
            elif is_surface(target) and not is_surface(source):
                bad.append(f"{where} (a surface, from below)")
            elif is_surface(source) or is_surface(target):
                continue
            elif layer(target) > layer(source):
                if (source, target) in KNOWN:
                    known.add((source, target))
                    continue
                bad.append(f"{where} ({LAYERS[layer(target)][0]} is above {LAYERS[layer(source)][0]})")
    return bad, known


def test_every_product_module_has_a_layer():
    assert [m for m in map(module_name, product_files()) if layer(m) < 0 and not is_surface(m)] == []


def test_every_import_goes_down_the_layers():
    bad, known = offences()
    assert bad == [], "imports against docs/architecture.md's layers:\n" + "\n".join(bad)
    assert sorted(set(KNOWN) - known) == [], "no longer imported: take them out of KNOWN"


def test_the_check_sees_imports_inside_functions_and_relative_ones(tmp_path):
    # given a function-level import and a relative one, as cluster/monitor.py once had
    tree = ast.parse("def f():\n    from jobs.models import Job\nfrom .models import Node\nfrom . import links\n")

    # when the imports of a cluster module are listed
    found = imported(REPO / "cluster" / "monitor.py", tree)

    # then each one is there, with its line
    assert found == [(2, "jobs.models"), (3, "cluster.models"), (4, "cluster.links")]
