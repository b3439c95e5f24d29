"""Roles x actions x surfaces: every cell asserts allowed or refused (accounts/policy.py decides for all).

Surfaces: page (Django test client, session), json (the pages' JSON endpoints), api (REST API with a
token of the widest scope), command (management command run --as the user), websocket (own test below).
"""

from __future__ import annotations

import io

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command
from django.test import Client

from accounts import policy
from accounts.models import AuditEvent
from accounts.tokens import create_token
from cluster.models import Node
from jobs.models import Job

ROLES = ("none", "viewer", "launcher", "operator", "superuser")
SURFACES = ("page", "api", "command")

# (action, who may do it)
EXPECTED = {
    "view": {"viewer", "launcher", "operator", "superuser"},
    "launch": {"launcher", "operator", "superuser"},
    "cancel_own": {"launcher", "operator", "superuser"},
    "cancel_other": {"operator", "superuser"},
    "priority_60": {"operator", "superuser"},
    "nodes": {"operator", "superuser"},
    "audit": {"operator", "superuser"},
}


def make_user(role: str, name: str = "") -> User:
    name = name or f"u-{role}"
    if role == "superuser":
        return User.objects.create_superuser(name, email="", password=None)
    user = User.objects.create_user(name)  # no password: force_login is enough, and hashing one is slow
    user.groups.clear()  # new accounts start as viewers (UGRO_DEFAULT_ROLE)
    if role != "none":
        user.groups.add(Group.objects.get(name=role))
    return user


@pytest.fixture
def world(db, settings, tmp_path):
    settings.JOBS_DIR = tmp_path / "jobs"
    Node.objects.create(name="n1", address="127.0.0.2", role=Node.Role.MASTER)
    other = make_user("launcher", "someone-else")
    return {"other_job": Job.objects.create(name="theirs", script="s.py", owner=other)}


def attempt(surface: str, action: str, user: User, world: dict) -> bool:
    """Try `action` as `user` through `surface`; True if it was done, False if refused."""
    client = Client()
    client.force_login(user)
    _, token = create_token(user, "t", "operate")
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    own = Job.objects.create(name=f"mine-{user.pk}", script="s.py", owner=user)
    target = own if action == "cancel_own" else world["other_job"]
    if action == "view":
        if surface == "page":
            return client.get("/jobs/").status_code == 200 and client.get(f"/api/jobs/{own.pk}/logs").status_code == 200
        if surface == "api":
            return client.get("/api/v1/jobs/", **auth).status_code == 200
        return _command(user, "status")
    if action in ("launch", "priority_60"):
        priority = 60 if action == "priority_60" else 10
        name = f"new-{user.pk}"
        if surface == "page":
            client.post("/jobs/launch/", {"name": name, "count": "1", "priority": str(priority)})
        elif surface == "api":
            body = {"name": name, "count": 1, "priority": priority}
            client.post("/api/v1/jobs/", body, content_type="application/json", **auth)
        else:
            return _command(user, "launch", "--name", name, "--nodes", "1", "--priority", str(priority), "--dry-run")
        return Job.objects.filter(name=name, owner=user, priority=priority).exists()
    if action in ("cancel_own", "cancel_other"):
        if surface == "page":
            client.post(f"/jobs/{target.pk}/cancel/")
        elif surface == "api":
            client.post(f"/api/v1/jobs/{target.name}/cancel", **auth)
        else:
            _command(user, "cancel", target.name)
        target.refresh_from_db()
        return target.state == Job.State.CANCELLED
    if surface == "page" and action in ("nodes", "audit"):
        # the admin (staff status given here: the role's permissions decide)
        user.is_staff = True
        user.save()
        node = Node.objects.get(name="n1")
        url = f"/admin/cluster/node/{node.pk}/change/" if action == "nodes" else "/admin/accounts/auditevent/"
        return client.get(url).status_code == 200
    if action == "nodes":
        if surface == "api":
            client.post("/api/v1/nodes/n1/drain", **auth)
        else:
            return _command(user, "import_cluster", "/nonexistent/cluster.yaml", refusal="not allowed")
        return not Node.objects.get(name="n1").enabled
    if action == "audit":
        if surface == "api":
            return client.get("/api/v1/audit", **auth).status_code == 200
        return _command(user, "audit")
    raise AssertionError(action)


def _command(user: User, *args: str, refusal: str = "") -> bool:
    try:
        call_command(*args, "--as", user.username, stdout=io.StringIO())
    except CommandError as exc:
        if refusal and refusal not in str(exc):
            return True  # refused later, for another reason (the file is missing): the policy let it through
        assert "\n" not in str(exc)
        return False
    return True


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("action", list(EXPECTED))
def test_role_action_surface(world, role, action, surface):
    user = make_user(role)
    assert attempt(surface, action, user, world) is (role in EXPECTED[action]), (role, action, surface)


def test_launcher_quota_of_queued_jobs(world, monkeypatch):
    monkeypatch.setattr(policy, "LAUNCHER_MAX_QUEUED", 2)
    user = make_user("launcher")
    client = Client()
    client.force_login(user)
    for i in range(3):
        client.post("/jobs/launch/", {"name": f"q{i}", "count": "1"})
    assert sorted(Job.objects.filter(owner=user).values_list("name", flat=True)) == ["q0", "q1"]
    refused = AuditEvent.objects.get(action="launch", target="q2")
    assert refused.outcome == "refused: u-launcher already has 2 queued jobs (quota 2)"


def test_a_token_is_narrowed_to_its_scope(world):
    user = make_user("operator")
    _, read = create_token(user, "ro", "read")
    client = Client()
    response = client.post("/api/v1/jobs/", {"name": "x1", "count": 1}, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {read}")  # fmt: skip
    assert response.status_code == 403
    assert response.json() == {"error": "this token's scope is read: it cannot launch"}
    assert client.get("/api/v1/jobs/", HTTP_AUTHORIZATION=f"Bearer {read}").status_code == 200
    # an action that is no verb of its own is named in words: what README's set-up token must be able to do
    _, launch = create_token(user, "lt", "launch")
    response = client.post("/api/v1/nodes/gpu1/drain", {}, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {launch}")  # fmt: skip
    assert response.json() == {"error": "this token's scope is launch: it cannot manage nodes"}


def test_commands_run_as_the_os_users_account_and_refuse_without_one(world, os_account):
    call_command("status", stdout=io.StringIO())  # the OS user's account (an operator here)
    os_account.is_active = False
    os_account.save()
    with pytest.raises(CommandError, match=r"^no active UGRO account named .* \(your OS user\): pass --as USER"):
        call_command("status", stdout=io.StringIO())
    with pytest.raises(CommandError, match=r"^no active UGRO account named 'ghost' \(--as\)$"):
        call_command("status", "--as", "ghost", stdout=io.StringIO())


def test_a_refused_page_action_says_why_in_one_line(world):
    client = Client()
    client.force_login(make_user("viewer"))
    response = client.post(f"/jobs/{world['other_job'].pk}/cancel/")
    assert response.status_code == 403
    assert "u-viewer has role viewer: not allowed to cancel" in response.content.decode()
    response = client.get(f"/api/jobs/{world['other_job'].pk}/logs")
    assert response.status_code == 200
    client.force_login(make_user("none"))
    assert client.get(f"/api/jobs/{world['other_job'].pk}/logs").json() == {
        "error": "u-none has no role (ask an operator for one): not allowed to view the cluster"
    }


@pytest.mark.django_db(transaction=True)
def test_websockets_need_the_view_permission():
    job = Job.objects.create(name="demo", script="s.py")

    def cookie(role: str) -> str:
        client = Client()
        client.force_login(make_user(role))
        return f"sessionid={client.cookies['sessionid'].value}"

    async def connect(path: str, cookie: str):
        headers = [(b"origin", b"http://localhost"), (b"host", b"localhost"), (b"cookie", cookie.encode())]
        from ugro_site.asgi import application

        communicator = WebsocketCommunicator(application, path, headers=headers)
        connected, code = await communicator.connect(timeout=5)
        await communicator.disconnect()
        return connected, code

    cookies = {role: cookie(role) for role in ("none", "viewer")}
    for path in (f"/ws/jobs/{job.pk}/", "/ws/cluster/"):
        assert async_to_sync(connect)(path, cookies["none"]) == (False, 4403)
        assert async_to_sync(connect)(path, cookies["viewer"])[0] is True
