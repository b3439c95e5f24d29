"""The REST API (api/) and its tokens: schema and docs, launch/status/logs/results/cancel/queue/health,
one-line errors, tokens hashed at rest, revocable, last-used; `token` and `audit` commands."""

from __future__ import annotations

import hashlib
import io

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from accounts.models import ApiToken, AuditEvent
from accounts.tokens import create_token
from cluster.models import ClusterSettings, Node
from jobs.models import Job, Rank


@pytest.fixture
def lab(db, settings, tmp_path):
    settings.JOBS_DIR = tmp_path / "jobs"
    for i in (1, 2):
        Node.objects.create(name=f"n{i}", address=f"127.0.0.{i + 1}", role=Node.Role.MASTER if i == 1 else "worker")
    user = User.objects.create_user("carol")
    user.groups.add(Group.objects.get(name="launcher"))
    _, token = create_token(user, "laptop", "launch")
    return {"user": user, "token": token}


def api(lab, method: str, path: str, body=None, token: str | None = None):
    client = Client()
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token or lab['token']}"}
    if method == "get":
        return client.get(path, body or {}, **headers)
    return client.post(path, body or {}, content_type="application/json", **headers)


def test_schema_is_openapi_and_docs_need_a_login(lab):
    schema = api(lab, "get", "/api/schema", {"format": "json"}).json()
    assert schema["openapi"].startswith("3.")
    for path in ("/api/v1/jobs/", "/api/v1/jobs/{name}/logs", "/api/v1/jobs/{name}/cancel", "/api/v1/health",
                 "/api/v1/queue", "/api/v1/jobs/{name}/results"):  # fmt: skip
        assert path in schema["paths"], path
    assert Client().get("/api/docs").status_code == 302  # to the login page
    client = Client()
    client.force_login(lab["user"])
    page = client.get("/api/docs")
    assert page.status_code == 200 and b"swagger" in page.content.lower()


def test_launch_records_owner_audit_argv_and_refuses_in_one_line(lab):
    done = api(lab, "post", "/api/v1/jobs/", {"name": "exp1", "count": 2, "epochs": 2, "extra_args": ["--x", "a b"]})
    assert done.status_code == 201, done.content
    job = Job.objects.get(name="exp1")
    assert job.owner == lab["user"] and job.state == Job.State.QUEUED and done.json()["owner"] == "carol"
    event = AuditEvent.objects.get(action="launch", target="exp1")
    assert event.username == "carol" and event.argv == [job.script, *job.script_args]
    assert event.source.startswith("api 127.0.0.1 token ")
    assert event.argv[-2:] == ["--x", "a b"]
    # bad input: one line, nothing created, never a 500
    for body, message in [
        ({"name": "exp2", "priority": 10**22}, "priority: Ensure this value is less than or equal to 100."),
        ({"name": "exp2", "priority": 70}, "priority 70 is out of range for carol: 0-50"),
        ({"name": "$(id)"}, "name: job name: use letters"),
        ({"name": "exp1"}, "a job named 'exp1' already exists; choose another name"),
        ({"name": "exp2", "count": 9}, "asked for 9 nodes but the cluster has 2 enabled"),
    ]:
        response = api(lab, "post", "/api/v1/jobs/", body)
        assert response.status_code in (400, 403), (body, response.content)
        assert response.json()["error"].startswith(message), response.json()
    assert list(Job.objects.values_list("name", flat=True)) == ["exp1"]


def test_dry_run_shows_commands_and_creates_nothing(lab):
    response = api(lab, "post", "/api/v1/jobs/", {"name": "dry1", "count": 1, "dry_run": True})
    assert response.status_code == 200
    assert response.json()["lines"][0] == "dry run of job dry1: nothing was created or started"
    assert not Job.objects.exists()


def running(lab, name: str = "run1", lines: dict[int, bytes] | None = None) -> Job:
    job = Job.objects.create(name=name, script="train.py", owner=lab["user"], state=Job.State.RUNNING,
                             started_at=timezone.now(), running_at=timezone.now())  # fmt: skip
    for i, node in enumerate(Node.objects.order_by("name")):
        rank = Rank.objects.create(job=job, node=node, index=i, state=Rank.State.RUNNING)
        write_log(rank, (lines or {}).get(i, b""))
    return job


def write_log(rank: Rank, text: bytes) -> None:
    rank.local_log.parent.mkdir(parents=True, exist_ok=True)
    with open(rank.local_log, "ab") as fh:
        fh.write(text)
    Rank.objects.filter(pk=rank.pk).update(log_offset=rank.local_log.stat().st_size)


def test_logs_tail_then_follow_by_offsets_sees_each_line_once(lab):
    job = running(lab, lines={0: b"a0\na1\n", 1: b"b0\n"})
    first = api(lab, "get", "/api/v1/jobs/run1/logs").json()
    assert sorted(text for _, _, text in first["lines"]) == ["a0", "a1", "b0"] and not first["settled"]
    since = ",".join(f"{k}:{v}" for k, v in first["offsets"].items())
    assert api(lab, "get", "/api/v1/jobs/run1/logs", {"since": since}).json()["lines"] == []
    # when rank 1 writes two more lines, and one more half line (not yet committed past the offset)
    write_log(job.ranks.get(index=1), b"b1\n<script>b2</script>\n")
    nxt = api(lab, "get", "/api/v1/jobs/run1/logs", {"since": since}).json()
    assert [(rank, text) for _, rank, text in nxt["lines"]] == [(1, "b1"), (1, "<script>b2</script>")]
    assert nxt["offsets"]["0"] == first["offsets"]["0"] and nxt["offsets"]["1"] > first["offsets"]["1"]
    assert api(lab, "get", "/api/v1/jobs/run1/logs", {"since": "0:x"}).json()["error"].startswith("since must")
    assert api(lab, "get", "/api/v1/jobs/run1/logs", {"rank": 7}).json() == {"error": "job run1 has no rank 7"}


def test_status_list_detail_results_queue_health(lab):
    running(lab)
    Job.objects.create(name="waits", script="s.py", priority=5)
    rows = api(lab, "get", "/api/v1/jobs/").json()
    assert [(r["name"], r["state"], r["owner"]) for r in rows] == [
        ("waits", "queued", None),
        ("run1", "running", "carol"),
    ]
    assert rows[1]["nodes"] == ["n1", "n2"]
    one = api(lab, "get", "/api/v1/jobs/run1/").json()
    assert [r["node"] for r in one["ranks"]] == ["n1", "n2"] and one["lines"][0].startswith("job run1 (id ")
    assert api(lab, "get", "/api/v1/jobs/ghost/").json() == {"error": "no job named 'ghost'"}
    results = api(lab, "get", "/api/v1/jobs/run1/results").json()
    assert results["exit_codes"] == {"0": None, "1": None} and any("checkpoints: 0" in ln for ln in results["lines"])
    assert [j["name"] for j in api(lab, "get", "/api/v1/queue").json()] == ["waits"]
    health = api(lab, "get", "/api/v1/health").json()
    assert [(n["name"], n["job"]) for n in health] == [("n1", "run1"), ("n2", "run1")]


def test_cancel_own_job_goes_cancelling_and_a_second_cancel_of_an_ended_job_is_a_conflict(lab, monkeypatch):
    monkeypatch.setattr("jobs.lifecycle.dispatch_teardown", lambda job: None)  # no node in this test
    running(lab)
    done = api(lab, "post", "/api/v1/jobs/run1/cancel")
    assert done.status_code == 200 and done.json()["state"] == "cancelling"
    Job.objects.create(name="old", script="s.py", owner=lab["user"], state=Job.State.SUCCEEDED)
    again = api(lab, "post", "/api/v1/jobs/old/cancel")
    assert again.status_code == 409 and again.json() == {"error": "job old already succeeded"}
    assert AuditEvent.objects.filter(action="cancel", target="run1", username="carol").exists()


def test_tokens_are_hashed_at_rest_revocable_and_record_last_use(lab):
    row = ApiToken.objects.get(name="laptop")
    token = lab["token"]
    assert token not in (row.digest, row.prefix) and row.digest == hashlib.sha256(token.encode()).hexdigest()
    assert row.last_used_at is None
    assert api(lab, "get", "/api/v1/me").json() == {"username": "carol", "role": "launcher", "scope": "launch"}
    row.refresh_from_db()
    assert row.last_used_at is not None and row.last_used_from == "127.0.0.1"
    wrong = token[:-4] + ("aaaa" if not token.endswith("aaaa") else "bbbb")
    assert api(lab, "get", "/api/v1/me", token=wrong).status_code == 401
    out = io.StringIO()
    call_command("token", "revoke", row.prefix, "--as", "carol", stdout=out)
    response = api(lab, "get", "/api/v1/me")
    assert response.status_code == 401 and response.json() == {"error": "the API token is unknown or revoked"}
    assert Client().get("/api/v1/jobs/").status_code == 401


def test_token_command_creates_shows_once_lists_and_saves_0600(lab, tmp_path):
    out = io.StringIO()
    path = tmp_path / "cfg" / "token"
    call_command("token", "create", "ci", "--scope", "read", "--save", str(path), "--as", "carol", stdout=out)
    token = out.getvalue().splitlines()[1]
    assert path.read_text().strip() == token and (path.stat().st_mode & 0o777) == 0o600
    assert api(lab, "get", "/api/v1/me", token=token).json()["scope"] == "read"
    listing = io.StringIO()
    call_command("token", "list", "--as", "carol", stdout=listing)
    assert "ci" in listing.getvalue() and token not in listing.getvalue()
    with pytest.raises(CommandError, match="^carol is not a superuser: only your own tokens$"):
        call_command("token", "create", "x", "--for", "root", "--as", "carol", stdout=io.StringIO())
    assert AuditEvent.objects.filter(action="token_create", username="carol").count() == 1


def test_audit_command_and_api_show_who_what_where(lab, os_account):
    api(lab, "post", "/api/v1/jobs/", {"name": "exp9", "count": 1})
    out = io.StringIO()
    call_command("audit", stdout=out)  # the OS user's account: an operator
    line = out.getvalue().splitlines()[0]
    assert "carol" in line and "launch" in line and "exp9" in line and "api 127.0.0.1" in line and "argv:" in line
    refused = "carol has role launcher: not allowed to read the audit log"
    assert api(lab, "get", "/api/v1/audit").json() == {"error": refused}
    with pytest.raises(CommandError, match=refused):
        call_command("audit", "--as", "carol", stdout=io.StringIO())


def test_drain_and_undrain_a_node(lab):
    op = User.objects.create_user("olga")
    op.groups.add(Group.objects.get(name="operator"))
    _, token = create_token(op, "ops", "operate")
    assert api(lab, "post", "/api/v1/nodes/n2/drain", token=token).json()["enabled"] is False
    assert not Node.objects.get(name="n2").enabled
    assert api(lab, "post", "/api/v1/nodes/n2/undrain", token=token).json()["enabled"] is True
    assert list(AuditEvent.objects.order_by("pk").values_list("action", "target")) == [
        ("drain", "n2"),
        ("undrain", "n2"),
    ]


def test_admin_creates_a_token_shown_once_and_revokes_it(lab, admin_client):
    response = admin_client.post("/admin/accounts/apitoken/add/", {"user": lab["user"].pk, "name": "ci box",
                                                                  "scope": "read"}, follow=True)  # fmt: skip
    shown = [str(m) for m in response.context["messages"] if "shown once" in str(m)]
    token = shown[0].rsplit(" ", 1)[1]
    row = ApiToken.objects.get(name="ci box")
    assert token.startswith(f"ugro_{row.prefix}_") and row.digest == hashlib.sha256(token.encode()).hexdigest()
    assert token not in admin_client.get(f"/admin/accounts/apitoken/{row.pk}/change/").content.decode()
    assert api(lab, "get", "/api/v1/me", token=token).json()["scope"] == "read"
    admin_client.post("/admin/accounts/apitoken/", {"action": "revoke_tokens", "_selected_action": [row.pk]})
    assert api(lab, "get", "/api/v1/me", token=token).status_code == 401
    assert [e.action for e in AuditEvent.objects.order_by("pk")] == ["token_create", "token_revoke"]
    assert admin_client.get("/admin/accounts/auditevent/").status_code == 200


def test_viewers_see_no_launch_link_and_no_cancel_or_relaunch_button(lab):
    job = running(lab)
    client = Client()
    client.force_login(User.objects.create_user("vic"))  # a new account: viewer
    for url in ("/jobs/", f"/jobs/{job.pk}/"):
        html = client.get(url).content.decode()
        assert 'href="/jobs/launch/"' not in html and "/cancel/" not in html and "/relaunch/" not in html, url
    client.force_login(lab["user"])
    for url in ("/jobs/", f"/jobs/{job.pk}/"):
        html = client.get(url).content.decode()
        assert f"/jobs/{job.pk}/cancel/" in html and f"/jobs/{job.pk}/relaunch/" in html, url
    assert 'href="/jobs/launch/"' in client.get("/jobs/").content.decode()


def test_the_jobs_list_costs_the_same_few_queries_for_many_ended_jobs(lab, django_assert_max_num_queries):
    node = Node.objects.get(name="n1")
    for i in range(30):
        now = timezone.now()
        job = Job.objects.create(name=f"old{i}", script="s.py", state=Job.State.FAILED, owner=lab["user"],
                                 started_at=now, running_at=now, finished_at=now)  # fmt: skip
        Rank.objects.create(job=job, node=node, index=0, state=Rank.State.EXITED, active=False)
    ClusterSettings.load()  # as every running cluster has it (its price prices the energy)
    # 8, and the energy of every job at once: the price, attempts, ranks, samples (jobs/energy.py energy_records)
    with django_assert_max_num_queries(12):
        rows = api(lab, "get", "/api/v1/jobs/", {"limit": 30}).json()
    assert len(rows) == 30 and rows[0]["nodes"] == ["n1"]


def test_resume_makes_the_next_attempt_from_a_checkpoint_and_results_list_them(lab, monkeypatch):
    from jobs.models import Checkpoint

    monkeypatch.setattr("jobs.scheduler.send_task", lambda *a, **k: None)  # nothing starts here
    node = Node.objects.get(name="n1")
    job = Job.objects.create(name="broke", script="s.py", owner=lab["user"], state=Job.State.FAILED, tag="broke-1")
    Rank.objects.create(job=job, node=node, index=0, state=Rank.State.EXITED, exit_code=1, active=False)
    Checkpoint.objects.create(job=job, node=node, path="/w/outputs/broke/checkpoint_step40.pt", size=9, mtime=0,
                              step=40, ready=True)  # fmt: skip
    results = api(lab, "get", "/api/v1/jobs/broke/results").json()
    assert results["checkpoints"] == [{"node": "n1", "path": "/w/outputs/broke/checkpoint_step40.pt", "size": 9}]
    # bad input: one line, nothing changed
    for body, code, message in [({"from": "7"}, 409, "no complete checkpoint at step 7"),
                                ({"nodes": "n1"}, 400, "nodes must be a list")]:  # fmt: skip
        response = api(lab, "post", "/api/v1/jobs/broke/resume", body)
        assert response.status_code == code and message in response.json()["error"], response.content
    assert Job.objects.get(pk=job.pk).attempt == 1
    done = api(lab, "post", "/api/v1/jobs/broke/resume", {"from": "40"})
    assert done.status_code == 200 and done.json()["state"] == "queued" and done.json()["attempt"] == 2
    job.refresh_from_db()
    assert job.resume_step == 40 and job.resume_path == "/w/outputs/broke/checkpoint_step40.pt"
    assert AuditEvent.objects.filter(action="resume", target="broke", username="carol").exists()


def test_curves_by_token_names_then_points_paged_as_json_or_csv(lab):
    import csv as csv_module

    from metrics.models import MetricPoint

    job = Job.objects.create(name="curve1", script="x.py", state=Job.State.SUCCEEDED, owner=lab["user"])
    now = timezone.now()
    for step in range(1, 6):
        for rank in (0, 1):
            MetricPoint.objects.create(job=job, rank=rank, step=step, name="loss", value=1.0 / step + rank, time=now)
    MetricPoint.objects.create(job=job, rank=0, step=5, name="lr", value=0.001, time=now)
    MetricPoint.objects.create(job=job, rank=0, step=None, name="train_loss", value=0.7, time=now)  # a bar's
    MetricPoint.objects.create(job=job, rank=0, step=9, name="loss", value=9.0, time=now, superseded=True)
    # the names first
    assert api(lab, "get", "/api/v1/jobs/curve1/metrics").json() == {
        "job": "curve1", "names": ["loss", "lr", "train_loss"]}  # fmt: skip
    # then the points of the names asked, a page at a time until `next` is null
    got, after = [], 0
    while True:
        page = api(lab, "get", "/api/v1/jobs/curve1/metrics", {"name": ["loss", "train_loss"], "limit": 4,
                                                                 "after": after}).json()  # fmt: skip
        got += page["points"]
        if page["next"] is None:
            break
        after = page["next"]
    assert len(got) == 11 and {p["name"] for p in got} == {"loss", "train_loss"}
    assert [(p["rank"], p["step"], p["value"]) for p in got if p["name"] == "loss"][:2] == [(0, 1, 1.0), (1, 1, 2.0)]
    assert [p["step"] for p in got if p["name"] == "train_loss"] == [None]
    assert all(p["step"] != 9 for p in got)  # superseded by a resume: off the curve
    # CSV, as pandas.read_csv reads it; one rank
    answer = api(lab, "get", "/api/v1/jobs/curve1/metrics", {"name": "loss", "format": "csv", "rank": 1})
    assert answer["Content-Type"].startswith("text/csv") and "X-Next-After" not in answer
    rows = list(csv_module.DictReader(answer.content.decode().splitlines()))
    assert [(r["step"], float(r["value"])) for r in rows] == [(str(s), 1.0 / s + 1) for s in range(1, 6)]
    # bad input is one line
    bad = api(lab, "get", "/api/v1/jobs/curve1/metrics", {"name": "loss", "limit": "x"})
    assert bad.status_code == 400 and bad.json() == {"error": "rank, after and limit must be integers"}
    assert api(lab, "get", "/api/v1/jobs/nope/metrics").status_code == 404
