"""The safe charset for names that end up in paths, environments and command lines."""

from __future__ import annotations

import re

from django.core.exceptions import ValidationError

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SAFE_NAME_HELP = "1-64 characters: letters, digits, '.', '_' or '-', starting with a letter or digit"


def check_name(value: str, what: str = "name") -> str:
    """Return value if safe, else raise ValueError with a one-line reason."""
    if not isinstance(value, str) or not SAFE_NAME.match(value):
        raise ValueError(f"{what} {value!r} is not allowed: use {SAFE_NAME_HELP}")
    return value


def validate_safe_name(value: str) -> None:
    """Django field validator form of check_name."""
    try:
        check_name(value)
    except ValueError as exc:
        raise ValidationError(str(exc)) from None
