from __future__ import annotations

import time

from django.core.management.base import CommandError

from accounts import policy
from accounts.commands import UserCommand
from serving.models import Service
from serving.requests import SHAPE, ServeError, ServeRequest, describe, listing, start_service, stop_service
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
        parser.add_argument("name", nargs="?")
        parser.add_argument("--from", dest="source", metavar="JOB[:STEP|latest]", help="the checkpoint to serve")
        parser.add_argument("--replicas", type=int, help="how many start (default: --min-replicas, at least 1)")
        parser.add_argument("--gpus-per-replica", type=int, help="default 1")
        parser.add_argument("--engine", choices=[e.value for e in Service.Engine], help="default transformers")
        parser.add_argument("--command", help="with --engine custom: {model} {host} {port} {gpus} {name} {python}")
        parser.add_argument("--min-replicas", type=int, help="0: it sleeps when idle (--idle-after) and wakes on a "
                            "request; default --replicas")  # fmt: skip
        parser.add_argument("--max-replicas", type=int, help="added with the load up to this; default --replicas")
        parser.add_argument("--target-outstanding", type=int, help="requests in flight per replica above which "
                            "another is added (default 4)")  # fmt: skip
        parser.add_argument("--idle-after", help="with --min-replicas 0: sleep after this long without a request "
                            "(default 15m; at least 1m)")  # fmt: skip
        parser.add_argument("--cold-start-timeout", help="how long a request waits for a sleeping service to wake "
                            "(default: the engine's)")  # fmt: skip
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
        req = ServeRequest(name=name, source=source, **{key: options[key] for key in SHAPE})
        updating = Service.objects.filter(name=name, state__in=Service.AWAKE_OR_ASLEEP).exists()
        try:
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
