"""The quickstart's helpers: a local demo node and a first admin."""

from __future__ import annotations

import io

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from cluster.models import Node

pytestmark = pytest.mark.django_db


def test_demo_node_is_added_once(settings):
    out = io.StringIO()
    call_command("demo_node", stdout=out)
    node = Node.objects.get()
    assert node.transport == Node.Transport.LOCAL and node.role == Node.Role.MASTER
    assert "added demo node 'local'" in out.getvalue()
    call_command("demo_node", stdout=out)
    assert Node.objects.count() == 1


def test_first_admin_is_created_with_a_printed_password(settings, tmp_path):
    settings.DATA_DIR = tmp_path
    out = io.StringIO()
    call_command("ensure_admin", stdout=out)
    user = get_user_model().objects.get(username="admin")
    password = (tmp_path / "admin_password.txt").read_text().split()[1]
    assert user.is_superuser and user.check_password(password) and password in out.getvalue()
    call_command("ensure_admin", stdout=out)
    assert get_user_model().objects.filter(is_superuser=True).count() == 1
