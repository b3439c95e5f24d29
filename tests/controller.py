"""The app that gives a controller started by a test (worker, command, web server) the constants that test asked
for in UGRO_TEST_CONSTANTS (tests/settings.py), once every app is loaded and before any work is done."""

from __future__ import annotations

import importlib
import json
import os

from django.apps import AppConfig
from django.core.exceptions import ImproperlyConfigured


class TestConstants(AppConfig):
    name = "tests"
    label = "ugro_tests"

    def ready(self) -> None:
        for target, value in json.loads(os.environ.get("UGRO_TEST_CONSTANTS", "") or "{}").items():
            module_name, name = target.rsplit(".", 1)
            module = importlib.import_module(module_name)
            if not name.isupper() or not hasattr(module, name):
                raise ImproperlyConfigured(f"UGRO_TEST_CONSTANTS: {module_name} has no constant {name}")
            setattr(module, name, value)


def with_constants(env: dict[str, str], values: dict[str, object]) -> dict[str, str]:
    """A controller's environment with these constants ({"cluster.links.CONNECT_TIMEOUT_S": 1.5}) added to those
    it already asks for."""
    asked = json.loads(env.get("UGRO_TEST_CONSTANTS", "") or "{}")
    return {**env, "UGRO_TEST_CONSTANTS": json.dumps({**asked, **values})}
