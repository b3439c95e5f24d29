"""Settings of the test process and of the controllers its tests start (pyproject names this module; pytest-django
exports it, so a worker or command a test starts reads it too): UGRO's own, and two variables only tests set,
which tests/test_settings_table.py lists as test-only:

- UGRO_TEST_DB_NAME (bin/test): the test database's name, one per run, as runs may overlap;
- UGRO_TEST_CONSTANTS: {"module.NAME": value, ...} as JSON, set in a controller a test starts (tests/controller.py),
  so that a worker under test can get faster timeouts than ship without a setting users could reach.
"""

from __future__ import annotations

import os

from ugro_site.settings import *  # noqa: F403
from ugro_site.settings import DATABASES, INSTALLED_APPS

if test_db := os.environ.get("UGRO_TEST_DB_NAME", ""):
    DATABASES["default"]["TEST"] = {"NAME": test_db}
INSTALLED_APPS = [*INSTALLED_APPS, "tests.controller.TestConstants"]
# MD5 first for passwords made and checked by tests and the controllers they start (daphne for the browser
# tests), as Django's testing docs suggest: PBKDF2 at Django's iteration count costs over a second of CPU per
# user made and per login on this 2-core machine. Django's own hashers follow, so a shipped hash still checks;
# tests/test_newcomer_e2e.py runs the shipped settings.
PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.MD5PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2SHA1PasswordHasher",
    "django.contrib.auth.hashers.Argon2PasswordHasher",
    "django.contrib.auth.hashers.BCryptSHA256PasswordHasher",
    "django.contrib.auth.hashers.ScryptPasswordHasher",
]
