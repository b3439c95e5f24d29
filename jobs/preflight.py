"""Checks run on every chosen node before any rank starts. Each problem is one line naming its node."""

from __future__ import annotations

import os

from .models import Job, Rank
from .nodes import node_request, on_each


def _script_path(job: Job, rank: Rank) -> str:
    if os.path.isabs(job.script) or job.script.startswith("~"):
        return job.script
    return f"{rank.node.workdir.rstrip('/')}/{job.script}"


def run_preflight(job: Job, ranks: list[Rank]) -> list[str]:
    """Return the problems found (empty when the job may start)."""

    def check(rank: Rank) -> list[str]:
        node = rank.node
        path = _script_path(job, rank)
        problems = []
        found = node_request(node, "stat", timeout=10, paths=[node.workdir, path])["exists"]
        if not found.get(node.workdir):
            problems.append(f"{node.name}: working directory {node.workdir} does not exist")
        elif not found.get(path):
            problems.append(f"{node.name}: script {path} not found")
        return problems

    out: list[str] = []
    for rank, problems, err in on_each(ranks, check):
        if err:
            out.append(f"{rank.node.name}: {err}")
        else:
            out.extend(problems)
    return out
