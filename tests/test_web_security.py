"""Issue 10's web and storage findings: login throttling (django-axes), the full password validators,
no password reset without mail, websocket origin checked with scheme, host and port, and a data
directory only its user can read."""

from __future__ import annotations

import importlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.test import Client
from django.urls import clear_url_caches

from ugro_site.asgi import application

REPO = Path(__file__).resolve().parent.parent


def attempt(client: Client, username: str, password: str):
    return client.post("/accounts/login/", {"username": username, "password": password})


@pytest.mark.django_db
def test_repeated_failed_logins_lock_out_even_the_right_password(settings):
    limit = settings.AXES_FAILURE_LIMIT
    User.objects.create_user("alice", password="a-long-passphrase-1")
    client = Client(REMOTE_ADDR="10.0.0.7")
    # when someone guesses alice's password `limit` times from one address
    for _ in range(limit - 1):
        assert attempt(client, "alice", "guess").status_code == 200  # the form again, with its error
    assert attempt(client, "alice", "guess").status_code == 429  # the limit-th failure locks
    # then even the right password is refused from there (429, no session)
    locked = attempt(client, "alice", "a-long-passphrase-1")
    assert locked.status_code == 429 and "_auth_user_id" not in client.session
    # and alice from her own machine still logs in
    other = Client(REMOTE_ADDR="10.0.0.8")
    assert attempt(other, "alice", "a-long-passphrase-1").status_code == 302


@pytest.mark.django_db
def test_a_successful_login_resets_the_failure_count(settings):
    limit = settings.AXES_FAILURE_LIMIT
    User.objects.create_user("bob", password="a-long-passphrase-2")
    client = Client(REMOTE_ADDR="10.0.0.9")
    for _ in range(limit - 1):
        attempt(client, "bob", "typo")
    assert attempt(client, "bob", "a-long-passphrase-2").status_code == 302
    client.logout()
    for _ in range(limit - 1):
        attempt(client, "bob", "typo")
    assert attempt(client, "bob", "a-long-passphrase-2").status_code == 302


@pytest.mark.django_db
@pytest.mark.parametrize(
    "password, why",
    [("short1!", "too short"), ("password123", "too common"), ("84736251904172", "entirely numeric"),
     ("carol-smith-ugro", "too similar")],
)  # fmt: skip
def test_the_full_password_validators_apply(password, why):
    user = User(username="carol-smith-ugro", email="carol@example.org")
    with pytest.raises(ValidationError, match=why):
        validate_password(password, user)
    validate_password("correct horse battery staple", user)


@pytest.mark.django_db
def test_password_reset_is_off_without_mail_and_on_with_it(settings):
    client = Client()
    assert not settings.PASSWORD_RESET_ENABLED
    assert client.get("/accounts/password_reset/").status_code == 404
    assert client.get("/accounts/login/").status_code == 200
    import ugro_site.urls

    try:
        settings.PASSWORD_RESET_ENABLED = True
        importlib.reload(ugro_site.urls)
        clear_url_caches()
        assert client.get("/accounts/password_reset/").status_code == 200
    finally:
        settings.PASSWORD_RESET_ENABLED = False
        importlib.reload(ugro_site.urls)
        clear_url_caches()


def ws_connects(origin: bytes | None, host: bytes = b"localhost:8099", cookie: str = "", scheme: str = "ws") -> bool:
    headers = [(b"host", host)] + ([(b"origin", origin)] if origin is not None else [])
    if cookie:
        headers.append((b"cookie", cookie.encode()))

    async def run() -> bool:
        communicator = WebsocketCommunicator(application, "/ws/cluster/", headers=headers)
        communicator.scope["scheme"] = scheme
        connected, _ = await communicator.connect(timeout=5)
        await communicator.disconnect()
        return connected

    return async_to_sync(run)()


@pytest.mark.django_db(transaction=True)
def test_websocket_origin_must_match_scheme_host_and_port(settings):
    settings.ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
    settings.CSRF_TRUSTED_ORIGINS = ["https://ugro.lab.example"]
    client = Client()
    client.force_login(User.objects.create_user("alice", password="pw-alice-123"))
    cookie = f"sessionid={client.cookies['sessionid'].value}"
    # the dashboard's own origin: accepted
    assert ws_connects(b"http://localhost:8099", cookie=cookie)
    # another port on the same host (any other local web page), another scheme, another host: refused
    assert not ws_connects(b"http://localhost:8080", cookie=cookie)
    assert not ws_connects(b"https://localhost:8099", cookie=cookie)
    assert not ws_connects(b"http://127.0.0.1:8099", cookie=cookie)
    assert not ws_connects(b"http://evil.example:8099", cookie=cookie)
    assert not ws_connects(None, cookie=cookie)
    # a Host that is not allowed, even with a matching Origin: refused
    assert not ws_connects(b"http://evil.example:8099", host=b"evil.example:8099", cookie=cookie)
    # over TLS the origin is https; a listed trusted origin is accepted as it is
    assert ws_connects(b"https://localhost:8443", host=b"localhost:8443", cookie=cookie, scheme="wss")
    assert ws_connects(b"https://ugro.lab.example", cookie=cookie)


def run_manage(data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "UGRO_TEST_DB_NAME")}
    env["UGRO_DATA_DIR"] = str(data_dir)
    return subprocess.run(
        [sys.executable, str(REPO / "manage.py"), *args], env=env, capture_output=True, text=True, timeout=120
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_fresh_data_directory_is_private_and_a_loose_one_is_warned_about(private_data_dir):
    data = private_data_dir
    # when UGRO starts on a fresh data directory (its own PostgreSQL) with a permissive umask around it
    old = os.umask(0o022)
    try:
        started = subprocess.run([sys.executable, "-m", "ugro_site.localdb", "start"], cwd=REPO, capture_output=True,
                                 text=True, env={**os.environ, "UGRO_DATA_DIR": str(data)}, timeout=120)  # fmt: skip
        assert started.returncode == 0, started.stderr
        done = run_manage(data, "migrate", "-v0")
    finally:
        os.umask(old)
    assert done.returncode == 0, done.stderr
    # then the directory is 0700 (0710 for the server's account when UGRO runs as root), the database's 0700
    # and the secret key 0600
    assert mode(data) == (0o710 if os.geteuid() == 0 else 0o700)
    assert mode(data / "postgres") == 0o700 and mode(data / "secret_key") == 0o600
    assert "ugro.W001" not in run_manage(data, "check").stderr
    # when someone loosens them, the start-time check says so, naming each path
    data.chmod(0o755)
    (data / "secret_key").chmod(0o644)
    checked = run_manage(data, "check")
    assert checked.returncode == 0
    assert f"data directory {data} is 0755" in checked.stderr
    assert f"{data / 'secret_key'} is 0644" in checked.stderr


PINNED = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAII97vnnKxgG2FINp93piuEsNg/e3jYb7HKVk1L7dxrGu"
PINNED_FP = "SHA256:esD8IQRFIqz3WWf2qruqbNtMH7CV4D8NmAsC3CxVizQ"  # what `ssh-keygen -lf` printed for it


@pytest.mark.django_db
def test_the_pinned_host_key_fingerprint_is_shown_in_admin_and_on_the_node_card_and_cannot_be_edited():
    from cluster.models import Node

    node = Node.objects.create(name="gpu1", address="10.0.0.1", host_key=PINNED, host_key_source="first use")
    assert node.host_key_fingerprint == PINNED_FP
    client = Client()
    client.force_login(User.objects.create_superuser("root-admin", password="pw-admin-12345"))
    page = client.get(f"/admin/cluster/node/{node.pk}/change/").content.decode()
    assert PINNED_FP in page and 'name="host_key"' not in page  # shown, not a form field
    assert PINNED_FP in client.get("/").content.decode()
