from __future__ import annotations

import time

from django.core.management.base import CommandError

from accounts import policy
from accounts.commands import UserCommand
from serving.models import Service
from serving.requests import ServeError, ServeRequest, describe, listing, start_service, stop_service
from ugro_site.celery import NoWorker

STOP_WAIT_S = 120.0  # the worker stops each replica (TERM, grace, KILL) and frees its GPUs


class Command(UserCommand):
    action = "view"  # --list; starting and stopping need `serve` (serving/requests.py)
    help = (
        "Serve a job's checkpoint through an inference engine's OpenAI-compatible server: N replicas on the "
        "cluster's GPUs behind one endpoint, /serve/NAME/v1/. --stop stops it; --list shows every service."
    )

    def add_arguments(self, parser):
        parser.add_argument("name", nargs="?")
        parser.add_argument("--from", dest="source", metavar="JOB[:STEP|latest]", help="the checkpoint to serve")
        parser.add_argument("--replicas", type=int, default=1)
        parser.add_argument("--gpus-per-replica", type=int, default=1)
        parser.add_argument("--engine", default="transformers", choices=[e.value for e in Service.Engine])
        parser.add_argument("--command", default="", help="with --engine custom: {model} {host} {port} {gpus} "
                            "{name} {python}")  # fmt: skip
        parser.add_argument("--stop", action="store_true", help="stop the service: no process left, GPUs freed")
        parser.add_argument("--list", action="store_true", help="every service and the state of each replica")

    def handle(self, name, source, stop, list, **options):
        if list:
            return self.show(name)
        if not name:
            raise CommandError("name the service: manage.py serve NAME --from JOB (or --list)")
        if stop:
            return self.stop(name)
        if not source:
            raise CommandError("--from JOB[:STEP|latest] names the checkpoint to serve")
        req = ServeRequest(name=name, source=source, replicas=options["replicas"],
                           gpus_per_replica=options["gpus_per_replica"], engine=options["engine"],
                           command=options["command"])  # fmt: skip
        try:
            service = start_service(self.user, req, self.source)
        except (ServeError, NoWorker, policy.Refused) as exc:
            raise CommandError(str(exc)) from None
        c = service.checkpoint
        self.stdout.write(
            f"service {service.name}: {service.replicas} replica(s) of {service.engine} serving "
            f"{c.node.name}:{c.path} (step {c.step}); endpoint /serve/{service.name}/v1/ "
            f"(manage.py serve --list shows when they are ready)"
        )

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
