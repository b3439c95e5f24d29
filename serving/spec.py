"""The serve spec: every option a service is started with, written once, and the one reader of service files.

`manage.py serve` builds its flags from SERVE; a service file (`manage.py serve -f chat.yaml`, and `ugro serve -f`,
whose file the server reads: the client sends its text as `spec`) takes its keys, and the API's body its fields:

    name: chat
    from: sft-run:latest
    min-replicas: 0
    idle-after: 15m

A key is the command line's name (`from`, `min-replicas` or `min_replicas`) or the API's (`source`); the options
typed beside the file win. The reading is jobs/spec.py's (unknown keys with the close one, types, size, a file that
is not a mapping); the bounds and the checks between options (min above max, idle under a minute) stay
serving/requests.py's, the same for a file's values as for flags.
"""

from __future__ import annotations

from typing import Any

from jobs.spec import Option, SpecError, read_text, read_values

from .models import Service
from .requests import ServeError, ServeRequest

WHAT = "service file"

# fmt: off
SERVE: tuple[Option, ...] = (
    Option("name", "NAME", "name", example="chat", keys=("name",), shown_default="required",
           help="the service's name: its endpoint is /serve/NAME/v1/"),
    Option("source", "--from", "text", example="sft-run:latest", keys=("from", "source"), shown_default="required",
           help="the checkpoint to serve: JOB, JOB:STEP or JOB:latest"),
    Option("replicas", "--replicas", "int", example=2, shown_default="--min-replicas, at least 1",
           help="how many start (default: --min-replicas, at least 1; 0 with --min-replicas 0: asleep)"),
    Option("gpus_per_replica", "--gpus-per-replica", "int", example=1, shown_default="1", help="default 1"),
    Option("engine", "--engine", "choice", example="vllm", choices=tuple(Service.Engine.values),
           shown_default="transformers", help="default transformers"),
    Option("command", "--command", "text", example="{python} -m my_server --port {port} --model {model}",
           help="with --engine custom: {model} {host} {port} {gpus} {name} {python}"),
    Option("min_replicas", "--min-replicas", "int", example=0, shown_default="--replicas",
           help="0: it sleeps when idle (--idle-after) and wakes on a request; default --replicas"),
    Option("max_replicas", "--max-replicas", "int", example=2, shown_default="--replicas or --min-replicas",
           help="added with the load up to this; default --replicas"),
    Option("target_outstanding", "--target-outstanding", "int", example=4, shown_default="4",
           help="requests in flight per replica above which another is added (default 4)"),
    Option("idle_after", "--idle-after", "duration", example="15m", shown_default="15m (with --min-replicas 0)",
           help="with --min-replicas 0: sleep after this long without a request (default 15m; at least 1m)"),
    Option("cold_start_timeout", "--cold-start-timeout", "duration", example="5m", shown_default="the engine's",
           help="how long a request waits for a sleeping service to wake (default: the engine's)"),
)
# fmt: on


def serve_request(text: str | None, typed: dict[str, Any], what: str = WHAT) -> ServeRequest:
    """The request a service file's text (None: no file) and the options typed beside it make, the typed ones
    winning; ServeError in one line for a file or a value that cannot be read, or no name or checkpoint."""
    try:
        values = read_text(text, SERVE, what)[0] if text is not None else {}
    except SpecError as exc:
        raise ServeError(str(exc)) from None
    values.update(typed)
    filed = text is not None
    if not values.get("name"):
        raise ServeError(f"{what}: name the service: `name: chat`, or NAME typed beside the file" if filed
                         else "name the service: NAME (or `name:` in a service file)")  # fmt: skip
    if not values.get("source"):
        raise ServeError(f"{what}: name the checkpoint to serve: `from: JOB[:STEP|latest]`, or --from typed beside "
                         "the file" if filed else "--from JOB[:STEP|latest] names the checkpoint to serve")  # fmt: skip
    return ServeRequest(**values)


def request_of_body(body: Any) -> ServeRequest:
    """`POST /api/v1/services/`: its fields (the API's names, or the command line's; empty ones not given), and under
    them the text of a service file as `spec` (what `ugro serve -f` sends); ServeError in one line."""
    body = body.dict() if hasattr(body, "dict") else body  # a form-encoded body (QueryDict): its last values
    fields = dict(body) if isinstance(body, dict) else {}
    text = fields.pop("spec", None)
    fields = {key: value for key, value in fields.items() if value != ""}
    if text is not None and not isinstance(text, str):
        raise ServeError("spec: the text of a service file")
    try:
        typed = read_values(fields, SERVE, "request")[0]
    except SpecError as exc:
        raise ServeError(str(exc)) from None
    return serve_request(text, typed)
