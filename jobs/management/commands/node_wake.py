from __future__ import annotations

from .node_sleep import Command as SleepCommand


class Command(SleepCommand):
    verb = "wake"
    help = (
        "Wake an asleep node now (its Wake-on-LAN magic packet, or its wake command on the controller); it is awake "
        "when its probe answers, DOWN with an alert past its wake_timeout (docs/power.md)."
    )
