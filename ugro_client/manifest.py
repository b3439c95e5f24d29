"""The manifest of a directory to sync to every node: each file's path, sha256, size and mode.

Built where the directory is (the controller for `manage.py launch --sync`, the laptop for `ugro launch
--sync`), with the same rules on both: `.gitignore` files respected (each for its own subtree, git's
pattern rules through the `pathspec` library), EXCLUDED names never entered, and symlinks allowed only
when they point inside the tree. What the manifest lists is what every node's copy holds, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
from dataclasses import dataclass, field

import pathspec

# Never synced: version control, caches, environments, and what runs write (outputs and checkpoints are a
# node's own; copying them back out would move gigabytes).
EXCLUDED = {
    ".git", ".hg", ".svn", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints",
    "node_modules", ".venv", "venv", "outputs", "checkpoints", "lightning_logs", "wandb", "mlruns", "runs",
    ".DS_Store",
}  # fmt: skip
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".safetensors")
LIMIT_BYTES = 200 * 1024 * 1024  # a code directory, not a dataset: over this, the biggest files are named
LIMIT_FILES = 20_000
GIT_DIFF_MAX = 256 * 1024  # the uncommitted diff kept with a job


class ManifestError(ValueError):
    """A directory that cannot be synced, in one line."""


@dataclass
class Manifest:
    root: str
    files: list[dict] = field(default_factory=list)  # {"path", "sha256", "size", "mode"}, sorted by path
    links: list[dict] = field(default_factory=list)  # {"path", "target"}: symlinks inside the tree

    @property
    def total_bytes(self) -> int:
        return sum(f["size"] for f in self.files)

    def as_dict(self) -> dict:
        return {"files": self.files, "links": self.links}

    @property
    def digest(self) -> str:
        """The sha256 of the manifest itself: equal digests, equal trees."""
        return digest_of(self.as_dict())


def digest_of(manifest: dict) -> str:
    body = json.dumps({"files": manifest["files"], "links": manifest.get("links", [])}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _ignore_spec(directory: str) -> pathspec.PathSpec | None:
    try:
        with open(os.path.join(directory, ".gitignore"), encoding="utf-8", errors="replace") as fh:
            return pathspec.GitIgnoreSpec.from_lines(fh)
    except OSError:
        return None


def build(root: str, limit_bytes: int | None = None, limit_files: int | None = None) -> Manifest:
    """The manifest of the tree at root (at most LIMIT_BYTES in LIMIT_FILES files unless told otherwise);
    ManifestError for a tree that cannot be synced as it is."""
    limit_bytes = LIMIT_BYTES if limit_bytes is None else limit_bytes
    limit_files = LIMIT_FILES if limit_files is None else limit_files
    root = os.path.abspath(os.path.expanduser(root))
    if not os.path.isdir(root):
        raise ManifestError(f"--sync {root}: not a directory")
    real_root = os.path.realpath(root)
    out = Manifest(root=root)
    specs: list[tuple[str, pathspec.PathSpec]] = []  # (directory relative to root, its .gitignore)

    def ignored(rel: str, is_dir: bool) -> bool:
        for base, spec in specs:
            if base and not rel.startswith(base + "/"):
                continue
            sub = rel[len(base) + 1 :] if base else rel
            if spec.match_file(sub + "/" if is_dir else sub):
                return True
        return False

    def walk(directory: str, rel_dir: str) -> None:
        spec = _ignore_spec(directory)
        if spec is not None:
            specs.append((rel_dir, spec))
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            raise ManifestError(f"--sync: cannot read {directory}: {exc.strerror}") from None
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if entry.name in EXCLUDED:
                continue
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                target = os.path.realpath(entry.path)
                if not (target == real_root or target.startswith(real_root + os.sep)):
                    raise ManifestError(f"--sync: {rel} is a symlink out of the tree (to {target})")
                if not ignored(rel, os.path.isdir(entry.path)):
                    here = os.path.realpath(directory)
                    out.links.append({"path": rel, "target": os.path.relpath(target, here)})
                continue
            if stat.S_ISDIR(st.st_mode):
                if not ignored(rel, True):
                    walk(entry.path, rel)
                continue
            if not stat.S_ISREG(st.st_mode) or ignored(rel, False) or entry.name.endswith(CHECKPOINT_SUFFIXES):
                continue
            out.files.append({"path": rel, "size": st.st_size, "mode": st.st_mode & 0o777})
            if len(out.files) > limit_files:
                raise ManifestError(f"--sync {root}: more than {limit_files} files; exclude some in .gitignore")
        if spec is not None:
            specs.pop()

    walk(root, "")
    total = out.total_bytes
    if total > limit_bytes:
        biggest = sorted(out.files, key=lambda f: -f["size"])[:3]
        names = ", ".join(f"{f['path']} ({f['size'] / 1e6:.1f} MB)" for f in biggest)
        raise ManifestError(
            f"--sync {root}: {total / 1e6:.1f} MB is over the {limit_bytes / 1e6:.0f} MB limit; biggest: {names}"
        )
    for f in out.files:
        f["sha256"] = file_sha256(os.path.join(root, f["path"]))
    return out


def git_info(directory: str, git=None) -> dict:
    """The commit, branch, uncommitted diff and untracked files of the git work tree holding directory
    ({} when it is not in one, or git is not installed). git(*args) runs `git -C directory ARGS` and gives
    its output, None when it failed: here by default (a node's agent runs it for the controller)."""

    def here(*args: str):
        try:
            done = subprocess.run(["git", "-C", directory, *args], capture_output=True, timeout=10,
                                  stdin=subprocess.DEVNULL)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.decode("utf-8", "replace") if done.returncode == 0 else None

    git = git or here
    head = git("rev-parse", "HEAD", "--abbrev-ref", "HEAD")
    if not head:
        return {}
    commit, _, branch = head.strip().partition("\n")
    diff = git("diff", "HEAD", "--", ".") or ""
    untracked = [p for p in (git("ls-files", "--others", "--exclude-standard", "--", ".") or "").splitlines() if p]
    return {
        "commit": commit, "branch": branch.strip(), "dirty": bool(diff or untracked),
        "diff": diff[:GIT_DIFF_MAX], "diff_truncated": len(diff) > GIT_DIFF_MAX, "untracked": untracked[:100],
    }  # fmt: skip
