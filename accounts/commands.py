"""Management commands run as a named UGRO account: `--as USER`, by default the OS user's own account."""

from __future__ import annotations

import getpass
import os
import re
import select
import sys
from argparse import ArgumentParser
from functools import partial
from typing import NoReturn

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from . import policy
from .audit import cli_source

EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE: what the shell reports for a program whose reader went away (head)


def os_username() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""


def command_user(name: str | None):
    """The active account named `name`, else the OS user's; CommandError (one line) if there is none."""
    given = bool(name)
    name = name or os_username()
    user = get_user_model().objects.filter(username=name, is_active=True).first() if name else None
    if user is None:
        if given:
            raise CommandError(f"no active UGRO account named {name!r} (--as)")
        raise CommandError(
            f"no active UGRO account named {name!r} (your OS user): pass --as USER, or create it "
            f"(manage.py createsuperuser --username {name or 'NAME'}, then give it a role in admin)"
        )
    return user


class UserCommand(BaseCommand):
    """A command run as a UGRO account (`self.user`), refused in one line when the policy says no; its output
    piped to a reader that goes away (`manage.py status | head -1`) ends it quietly."""

    action = "view"  # checked before handle(); job-level rules are checked by accounts.actions

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.add_argument(
            "--as", dest="as_user", metavar="USER", default=None,
            help="the UGRO account to act as (default: the account named like your OS user)",
        )  # fmt: skip
        if parser.called_from_command_line:  # call_command raises CommandError("Error: ..."): one line already
            parser.error = partial(one_line_error, parser)
        return parser

    def execute(self, *args, **options):
        self.user = command_user(options.get("as_user"))
        self.source = cli_source()
        try:
            policy.check(self.user, self.action)
        except policy.Refused as exc:
            raise CommandError(str(exc)) from None
        try:
            try:
                return super().execute(*args, **options)
            finally:
                sys.stdout.flush()  # a closed pipe shows here, inside the try, not at exit as a traceback
        except BrokenPipeError:
            if not stdout_closed():
                raise  # a pipe to a node's ssh, say: a real failure, not the reader leaving
            # the signal module docs' "Note on SIGPIPE": what is still buffered goes nowhere, no second error at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_PIPE_CLOSED)


    def named_node(self, name: str):
        """The node named so, or the one-line refusal every node command gives."""
        from cluster.models import Node

        found = Node.objects.filter(name=name).first()
        if found is None:
            raise CommandError(f"no node named {name!r}")
        return found


_INVALID = re.compile(r"argument (?P<option>\S+?): invalid (?P<type>int|float) value: (?P<value>.*)")
_TAKES = {"int": "a whole number", "float": "a number"}


def one_line_error(parser: ArgumentParser, message: str) -> NoReturn:
    """A bad option as one line (the option, the value, what it takes) and where to read more, exit 2: the
    usage block argparse prints first is dozens of lines for launch (`--help` still shows it)."""
    m = _INVALID.fullmatch(message)
    if m:
        message = f"{m['option']} {m['value']}: takes {_TAKES[m['type']]}"
    message = re.sub(r"^argument (\S+?): (?=')", r"\1 ", message).removeprefix("argument ")  # --lr 'abc': takes ...
    parser.exit(2, f"{parser.prog}: {message} (see {parser.prog} --help)\n")


def stdout_closed() -> bool:
    """Whether stdout is a pipe or socket whose reader went away (poll says POLLERR or POLLHUP)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False
