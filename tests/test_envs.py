"""Environments from a lock file (jobs/envs.py, cluster/node/envs.py) on nodes whose agents are local processes:
locks read and refused, wheels fetched once by the controller (pip, offline: a find-links directory of wheels
built here), sent by the transfer path and built with uv on each node once per working directory, kept for the
next launch, the installed sets recorded and compared, and failures in one line naming the node and package."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from tests import test_sync
from tests.test_sync import local_nodes

recorded = test_sync.recorded  # a fixture

pytestmark = pytest.mark.django_db


def make_wheel(folder: Path, name: str, version: str, body: str = "", requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel built by hand: module `name` whose VERSION is `version`."""
    files = {
        f"{name}/__init__.py": (body or f"VERSION = {version!r}\n").encode(),
        f"{name}-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires)
        ).encode(),
        f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    files[f"{name}-{version}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return out


@pytest.fixture
def wheels(tmp_path, monkeypatch, settings):
    """A find-links directory of small wheels, and pip told to use it alone (no index, no network)."""
    folder = tmp_path / "wheelhouse"
    make_wheel(folder, "tinya", "1.0")
    make_wheel(folder, "tinyb", "2.0")
    make_wheel(folder, "tinyb", "2.1")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("PIP_CONSTRAINT", "")
    settings.DATA_DIR = str(tmp_path / "data")
    return folder


def job_with(lock_path: Path, name: str = "envjob"):
    from jobs import envs
    from jobs.models import Job, JobCode

    job = Job.objects.create(name=name, script="train.py")
    JobCode.objects.create(job=job, envs={"lock": envs.read_lock(str(lock_path)).as_dict()})
    return job


def test_a_lock_must_pin_every_package_and_each_format_is_read(tmp_path):
    from jobs import envs

    req = tmp_path / "requirements.txt"
    req.write_text(
        "# pinned\ntinya==1.0 \\\n    --hash=sha256:" + "a" * 64 + "\ntinyb==2.0 ; python_version >= '3.8'\n"
    )
    lock = envs.read_lock(str(req))
    assert [p[:2] for p in lock.pins] == [["tinya", "1.0"], ["tinyb", "2.0"]]
    assert lock.pins[0][3] == "sha256:" + "a" * 64 and lock.pins[1][2] == "python_version >= '3.8'"
    for bad, why in (
        ("tinya>=1.0\n", "is not pinned"),
        ("tinya\n", "is not pinned"),
        ("\n# none\n", "names no"),
        ("--index-url http://x\ntinya==1\n", "is not taken"),
        ("a==1\na==2\n", "named twice"),
    ):
        req.write_text(bad)
        with pytest.raises(envs.EnvError, match=why) as err:
            envs.read_lock(str(req))
        assert "\n" not in str(err.value)
    pylock = tmp_path / "pylock.toml"
    pylock.write_text('lock-version = "1.0"\n[[packages]]\nname = "tinya"\nversion = "1.0"\n'
                      '[[packages.wheels]]\nname = "tinya-1.0-py3-none-any.whl"\nhashes = {sha256 = "' + "b" * 64
                      + '"}\n')  # fmt: skip
    got = envs.read_lock(str(pylock))
    assert got.format == "pylock" and got.pins == [["tinya", "1.0", "", "sha256:" + "b" * 64]]
    pylock.write_text('[[packages]]\nname = "tinya"\n')
    with pytest.raises(envs.EnvError, match="tinya has no version"):
        envs.read_lock(str(pylock))
    with pytest.raises(envs.EnvError, match="no such file"):
        envs.read_lock(str(tmp_path / "nope.txt"))


def test_uv_lock_is_exported_with_its_pyproject(tmp_path, wheels):
    from jobs import envs

    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text('[project]\nname = "proj"\nversion = "0.1"\nrequires-python = ">=3.8"\n'
                                            'dependencies = ["tinya==1.0"]\n')  # fmt: skip
    out = subprocess.run([envs.uv_binary(), "lock", "--offline", "--no-index", "--find-links", str(wheels),
                          "--directory", str(project)], capture_output=True, text=True,
                         env=dict(os.environ, UV_NO_CACHE="1"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    lock = envs.read_lock(str(project / "uv.lock"))
    assert lock.format == "uv.lock" and [p[:2] for p in lock.pins] == [["tinya", "1.0"]]
    (project / "pyproject.toml").unlink()
    with pytest.raises(envs.EnvError, match="needs its pyproject.toml"):
        envs.read_lock(str(project / "uv.lock"))


def test_an_environment_is_built_once_per_workdir_kept_recorded_and_nodes_that_differ_are_refused(
    tmp_path, wheels, recorded
):
    from jobs import envs
    from jobs.models import JobCode

    a, b = local_nodes({"a": tmp_path / "shared", "b": tmp_path / "shared"})
    (c,) = local_nodes({"c": tmp_path / "own"})
    sent = recorded(envs)
    req = tmp_path / "requirements.txt"
    req.write_text("tinya==1.0\ntinyb==2.0\n")
    job = job_with(req)
    built = envs.prepare(job, [a, b, c])
    assert built[a.pk] == built[b.pk] and built[a.pk].startswith(str(tmp_path / "shared/.ugro/envs/"))
    builds = [name for name, op in sent if op == "env_build"]
    assert sorted(builds) == ["a", "c"]  # b shares a's working directory: built once there
    for path in (built[a.pk], built[c.pk]):
        out = subprocess.run([f"{path}/bin/python", "-c", "import tinya, tinyb; print(tinya.VERSION, tinyb.VERSION)"],
                             capture_output=True, text=True)  # fmt: skip
        assert out.stdout.split() == ["1.0", "2.0"], out.stderr
        assert not [p for p in os.listdir(os.path.dirname(path)) if ".part-" in p]
    rec = JobCode.objects.get(job=job).envs
    wheel_sha = hashlib.sha256((wheels / "tinya-1.0-py3-none-any.whl").read_bytes()).hexdigest()
    assert ["tinya", "1.0", wheel_sha] in rec["nodes"]["c"]["packages"]
    assert rec["nodes"]["a"]["packages"] == rec["nodes"]["b"]["packages"] == rec["nodes"]["c"]["packages"]
    from jobs.models import Job
    from jobs.report import code_lines

    shown = code_lines(
        Job.objects.get(pk=job.pk)
    )  # where the code's provenance is shown (status NAME, results, the job page)
    assert any("packages: " in line and "3 pinned" not in line for line in shown)
    assert sum("env on " in line and "2 packages, built in" in line for line in shown) == 2  # a and c
    assert any(line.strip().startswith("env on b:") and line.endswith("kept") for line in shown)
    cached = sorted(os.listdir(envs.cache_dir()))
    assert cached == ["tinya-1.0-py3-none-any.whl", "tinyb-2.0-py3-none-any.whl"]

    sent.clear()  # a second launch builds nothing and sends nothing
    again = job_with(req, "envjob2")
    assert envs.prepare(again, [a, b, c]) == built
    assert not [op for _, op in sent if op in ("env_build", "xfer_listen")]
    assert all(n["kept"] for n in JobCode.objects.get(job=again).envs["nodes"].values())

    # c's environment changed by hand (another tinyb): the next job does not start, naming the package
    site = next(Path(built[c.pk]).glob("lib/python*/site-packages"))
    meta = site / "tinyb-2.0.dist-info" / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 2.0", "Version: 2.0.post1"))
    with pytest.raises(envs.EnvError, match=r"tinyb is 2.0 on a and 2.0.post1 on c"):
        envs.prepare(job_with(req, "envjob3"), [a, b, c])


def test_a_package_without_a_wheel_or_a_failed_build_names_the_node_and_package_and_leaves_no_env(
    tmp_path, wheels, recorded
):
    from jobs import envs
    from jobs.models import JobCode

    (a,) = local_nodes({"a": tmp_path / "wa"})
    req = tmp_path / "requirements.txt"
    req.write_text("tinya==1.0\nnowhere==3.0\n")
    with pytest.raises(envs.EnvError, match=r"^a: no wheel of nowhere==3.0 for Python 3\.\d+ on ") as err:
        envs.prepare(job_with(req), [a])
    assert "\n" not in str(err.value)
    # a wheel that needs a package the lock does not name: uv's --strict check fails the build on the node
    make_wheel(wheels, "needy", "1.0", requires=("absent>=1",))
    req.write_text("needy==1.0\n")
    with pytest.raises(envs.EnvError, match=r"building the environment failed on a: .*absent") as err:
        envs.prepare(job_with(req, "envjob2"), [a])
    root = tmp_path / "wa/.ugro/envs"
    assert not [p for p in os.listdir(root) if not p.startswith(".")]  # no env, no part left
    # a build cut off midway (its agent killed) left a part: never used, removed by the next build of that key
    import shutil
    import socket

    req.write_text("tinya==1.0\n")
    job = job_with(req, "envjob3")
    envs.prepare(job, [a])
    key = JobCode.objects.get(job=job).envs["nodes"]["a"]["key"]
    shutil.rmtree(root / key)
    cut = root / f"{key}.part-{socket.gethostname()}-999999999"
    (cut / "env" / "bin").mkdir(parents=True)
    assert [e["whole"] for e in envs.listing(a)] == [False]
    envs.prepare(job_with(req, "envjob4"), [a])
    assert sorted(os.listdir(root)) == [".uv", key] and (root / key / ".ugro-env.json").exists()


def test_envs_are_listed_and_unused_ones_removed_never_one_a_live_job_names(tmp_path, wheels, recorded, monkeypatch):
    import time

    from cluster.models import ClusterSettings
    from jobs import envs
    from jobs.models import Job

    (a,) = local_nodes({"a": tmp_path / "wa"})
    req = tmp_path / "requirements.txt"
    req.write_text("tinya==1.0\n")
    live = job_with(req, "live")
    envs.prepare(live, [a])
    req.write_text("tinyb==2.1\n")
    ended = job_with(req, "ended")
    envs.prepare(ended, [a])
    Job.objects.filter(name="ended").update(state=Job.State.SUCCEEDED)
    Job.objects.filter(name="live").update(state=Job.State.RUNNING)
    listed = envs.listing(a)
    assert len(listed) == 2 and all(e["whole"] and e["bytes"] > 0 for e in listed)
    assert sorted(j for e in listed for j in e["jobs"]) == ["live"]
    shown_by_surface(a.name, monkeypatch)
    old = time.time() - 30 * 86400
    for e in listed:
        used = tmp_path / "wa/.ugro/envs" / e["key"] / ".ugro-env-used"
        os.utime(used, (old, old))
    cs = ClusterSettings.load()
    cs.paths = {**(cs.paths or {}), "env_ttl": "14d"}
    removed = envs.trim([a], cs)
    kept = [e["key"] for e in envs.listing(a)]
    assert len(removed["a"]) == 1 and len(kept) == 1 and removed["a"][0] not in kept
    assert envs.listing(a)[0]["jobs"] == ["live"]


def shown_by_surface(node: str, monkeypatch) -> None:
    """`node envs NAME` through manage.py, the API (operators only) and the client: the same lines."""
    import io
    import json

    from django.contrib.auth.models import Group, User
    from django.core.management import CommandError, call_command
    from django.test import Client as DjangoClient

    from accounts.tokens import create_token
    from ugro_client import cli

    operator = User.objects.create_user("olga")
    operator.groups.add(Group.objects.get(name="operator"))
    launcher = User.objects.create_user("lars")
    launcher.groups.add(Group.objects.get(name="launcher"))
    out = io.StringIO()
    call_command("node_envs", node, "--as", "olga", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"{node}: 2 environments in ") and "removed after 14 days" in lines[0]
    assert len(lines) == 3 and sum("named by live" in ln for ln in lines) == 1
    assert all("1 packages" in ln and "last used 0.0 h ago" in ln for ln in lines[1:])
    out = io.StringIO()
    call_command("node_envs", node, "--json", "--as", "olga", stdout=out)
    assert len(json.loads(out.getvalue())["envs"]) == 2
    with pytest.raises(CommandError, match="no node named 'nope'"):
        call_command("node_envs", "nope", "--as", "olga")
    _, op_token = create_token(operator, "ops", "operate")
    _, l_token = create_token(launcher, "cli", "launch")
    web = DjangoClient()
    denied = web.get(f"/api/v1/nodes/{node}/envs", HTTP_AUTHORIZATION=f"Bearer {l_token}")
    assert denied.status_code == 403
    answer = web.get(f"/api/v1/nodes/{node}/envs", HTTP_AUTHORIZATION=f"Bearer {op_token}")
    assert answer.status_code == 200 and answer.json()["lines"][0] == lines[0]

    def get(self, path, **params):
        got = web.get(f"/api/v1/{path}", params, HTTP_AUTHORIZATION=f"Bearer {op_token}")
        assert got.status_code == 200, got.content
        return got.json()

    monkeypatch.setattr(cli.Client, "get", get)
    monkeypatch.setenv("UGRO_TOKEN", op_token)
    shown = io.StringIO()
    monkeypatch.setattr("sys.stdout", shown)
    assert cli.run(["node", "envs", node]) == 0
    assert shown.getvalue().splitlines()[0] == lines[0]


def test_uv_cache_unpacks_a_wheel_once_per_node_and_the_trims_bound_it_and_the_controllers_wheels(
    tmp_path, wheels, recorded
):
    """uv's cache beside the store: two environments sharing a wheel hold one unpacked copy (hard links); the trim
    bounds that cache only while no build runs, and the environments keep their files; the controller's wheel
    cache is trimmed under its store limit, never a wheel a live job's lock pins."""
    import fcntl
    import time

    from cluster.models import ClusterSettings
    from jobs import cache, envs
    from jobs.models import Job

    (a,) = local_nodes({"a": tmp_path / "wa"})
    req = tmp_path / "requirements.txt"
    req.write_text("tinya==1.0\n")
    first = envs.prepare(job_with(req, "one"), [a])[a.pk]
    req.write_text("tinya==1.0\ntinyb==2.0\n")
    second = envs.prepare(job_with(req, "two"), [a])[a.pk]
    assert first != second
    files = [next(Path(p).glob("lib/python*/site-packages/tinya/__init__.py")) for p in (first, second)]
    assert files[0].stat().st_ino == files[1].stat().st_ino  # tinya unpacked once: both link uv's copy
    ugro = tmp_path / "wa/.ugro"
    assert len(list((ugro / "uv-wheels").iterdir())) == 2 and (ugro / "uv-cache").is_dir()

    cs = ClusterSettings.load()
    assert envs.trim_uv_caches([a], cs)["a"]["removed"] is False  # far under 1/4 of the default 50GB
    cs.paths = {**(cs.paths or {}), "cache_limit": "4B"}
    cs.save()
    fd = os.open(ugro / "uv-cache.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_SH)  # as a build holds it
    try:
        assert envs.trim_uv_caches([a], cs)["a"] == {"busy": True}
        assert (ugro / "uv-cache").is_dir() and (ugro / "uv-wheels").is_dir()
    finally:
        os.close(fd)
    got = envs.trim_uv_caches([a], cs)["a"]
    assert got["removed"] is True and got["before"] > got["limit"] == 1 and got["after"] == 0
    assert not (ugro / "uv-cache").exists() and not (ugro / "uv-wheels").exists()
    assert not [p for p in os.listdir(ugro) if ".gone-" in p]
    for path in (first, second):  # the environments keep their files (they were links)
        out = subprocess.run([f"{path}/bin/python", "-c", "import tinya; print(tinya.VERSION)"], capture_output=True,
                             text=True)  # fmt: skip
        assert out.stdout.strip() == "1.0", out.stderr
    req.write_text("tinyb==2.1\n")
    envs.prepare(job_with(req, "three"), [a])  # a build after the trim makes the cache again
    assert (ugro / "uv-cache").is_dir()

    # the controller's wheels: over paths.store_limit, the least recently used go, never one a live job pins
    Job.objects.filter(name="two").update(state=Job.State.RUNNING)
    Job.objects.exclude(name="two").update(state=Job.State.SUCCEEDED)
    old = time.time() - 3600
    for whl in envs.cache_dir().iterdir():
        os.utime(whl, (old, old))
    done = cache.trim_controller(limit=1)
    assert done["wheels"] == 1 and sorted(os.listdir(envs.cache_dir())) == [
        "tinya-1.0-py3-none-any.whl",
        "tinyb-2.0-py3-none-any.whl",
    ]  # tinyb 2.1 went; tinya 1.0 and tinyb 2.0 are job two's
    Job.objects.filter(name="two").update(state=Job.State.SUCCEEDED)
    assert cache.trim_controller(limit=1)["wheels"] == 2 and not os.listdir(envs.cache_dir())
