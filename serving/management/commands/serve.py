from __future__ import annotations

import time

from django.core.management.base import CommandError

from accounts import policy
from accounts.commands import UserCommand
from jobs.spec import MAX_FILE_BYTES, add_arguments
from serving.models import Service
from serving.requests import ServeError, describe, listing, start_service, stop_service
from serving.spec import SERVE, serve_request
from ugro_site.celery import NoWorker

STOP_WAIT_S = 120.0  # the worker stops each replica (TERM, grace, KILL) and frees its GPUs
UPDATE_WAIT_S = 900.0  # a rolling update starts each new replica (a cold start) and drains an old one


class Command(UserCommand):
    action = "view"  # --list; starting and stopping need `serve` (serving/requests.py)
    help = (
        "Serve a job's checkpoint through an inference engine's OpenAI-compatible server: N replicas on the "
        "cluster's GPUs behind one endpoint, /serve/NAME/v1/. --stop stops it; --list shows every service."
    )

    def add_arguments(self, parser):
        parser.add_argument("--file", "-f", metavar="FILE", help="a service file (YAML: these options by name, "
                            "docs/serving.md); typed ones win")  # fmt: skip
        add_arguments(parser, SERVE)  # every serve option, from the serve spec
        parser.add_argument("--stop", action="store_true", help="stop the service: no process left, GPUs freed")
        parser.add_argument("--list", action="store_true", help="every service and the state of each replica")

    def handle(self, **o):
        typed = {opt.field: o[opt.field] for opt in SERVE if opt.field in o}
        if o["list"]:
            return self.show(typed.get("name"))
        if o["stop"]:
            if not typed.get("name"):
                raise CommandError("name the service: manage.py serve NAME --stop")
            return self.stop(typed["name"])
        if not o["file"] and not typed.get("name"):
            raise CommandError("name the service: manage.py serve NAME --from JOB (or -f FILE, or --list)")
        try:
            req = serve_request(self._read_file(o["file"]) if o["file"] else None, typed,
                                f"service file {o['file']}")  # fmt: skip
            updating = Service.objects.filter(name=req.name, state__in=Service.AWAKE_OR_ASLEEP).exists()
            service = start_service(self.user, req, self.source)
        except (ServeError, NoWorker, policy.Refused) as exc:
            raise CommandError(str(exc)) from None
        if updating:
            return self.update(service)
        c = service.checkpoint
        count = "asleep until its first request," if service.state == Service.State.SLEEPING else \
            f"{service.replicas} replica(s) of"  # fmt: skip
        self.stdout.write(
            f"service {service.name}: {count} {service.engine} serving "
            f"{c.node.name}:{c.path} (step {c.step}); endpoint /serve/{service.name}/v1/ "
            f"(manage.py serve --list shows when they are ready)"
        )

    @staticmethod
    def _read_file(path: str) -> str:
        """A service file's text (at most MAX_FILE_BYTES + 1 bytes read: the reader refuses a larger one)."""
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.read(MAX_FILE_BYTES + 1)
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"cannot read service file {path}: {getattr(exc, 'strerror', None) or exc}") from None

    def update(self, service: Service) -> None:
        """Wait for a rolling update to end (bounded): done, or failed in one line, the old replicas serving on."""
        deadline = time.monotonic() + UPDATE_WAIT_S
        while service.next_checkpoint_id and time.monotonic() < deadline:
            time.sleep(0.3)
            service.refresh_from_db()
        if service.next_checkpoint_id:
            raise CommandError(f"service {service.name} is still updating ({service.note}): manage.py serve --list")
        if " failed: " in service.note:
            raise CommandError(f"service {service.name}: {service.note}")
        self.stdout.write(f"service {service.name}: {service.note}")

    def stop(self, name: str) -> None:
        service = Service.objects.filter(name=name).first()
        if service is None:
            raise CommandError(f"no service named {name!r}")
        try:
            stop_service(self.user, service, self.source)
        except (ServeError, NoWorker, policy.Refused) as exc:
            raise CommandError(str(exc)) from None
        deadline = time.monotonic() + STOP_WAIT_S
        while service.state != Service.State.STOPPED and time.monotonic() < deadline:
            time.sleep(0.2)
            service.refresh_from_db()
        if service.state != Service.State.STOPPED:
            notes = "; ".join(r.note for r in service.replica_set.exclude(state="stopped") if r.note)
            raise CommandError(f"service {name} is still stopping: {notes or 'the worker has not got to it yet'}")
        self.stdout.write(f"service {name} stopped; no process of it remains and its GPUs are free")

    def show(self, name: str | None) -> None:
        services = Service.objects.select_related("checkpoint__node", "job").order_by("name")
        if name:
            services = services.filter(name=name)
            if not services:
                raise CommandError(f"no service named {name!r}")
        lines = listing([describe(s) for s in services]) or ["no services"]
        self.stdout.write("\n".join(lines))
