"""Job files through the API: the server reads them, with jobs/spec.py's table (one reader for every surface).

`ugro launch -f job.yaml` sends the file's text and the options typed beside it to `POST /api/v1/spec/launch`,
which answers the resolved spec (the API's fields), the file's `sync:` directory and the spec in the file's
own form (YAML); the client uploads that directory and launches with the fields. `POST /api/v1/jobs/` and
`/sweeps/` still take a file's text as `spec`, the fields given beside it winning. `GET
/api/v1/spec/launch.schema.json` describes the file's keys for editors that complete YAML from a schema.
"""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ValidationError

from jobs import spec as launch_spec
from jobs.spec import SpecError

OPTIONS = {"launch": launch_spec.LAUNCH, "sweep": launch_spec.SWEEP}
WHAT = {"launch": "job file", "sweep": "sweep file"}
NOT_TYPED = ("spec", "spec_dir", "sync")  # what the client says about the file, not options of the job


def _read(body: dict, kind: str) -> tuple[dict[str, Any], str]:
    text = body["spec"]
    if not isinstance(text, str):
        raise ValidationError(f"spec: the {WHAT[kind]}'s text")
    try:
        values, sync = launch_spec.read_text(text, OPTIONS[kind], WHAT[kind])
    except SpecError as exc:
        raise ValidationError(str(exc)) from None
    return launch_spec.with_typed(values, {k: v for k, v in body.items() if k not in NOT_TYPED}), sync


def merged(body: Any, kind: str) -> Any:
    """The request body with its `spec` (a job file's text) read under it: the body's own fields win. A body
    without `spec` is returned as it is; a bad file is a ValidationError in one line."""
    if not isinstance(body, dict) or "spec" not in body:
        return body
    values, sync = _read(body, kind)
    if sync and sync != "none" and not values.get("sync_upload"):
        raise ValidationError(
            f"{WHAT[kind]}: sync: {sync[:200]!r} is a directory beside the file: `ugro launch -f` uploads it; "
            "through the API, upload it (POST /api/v1/sync) and give its digest as sync_upload"
        )
    return values


def resolved(body: Any, kind: str) -> dict[str, Any]:
    """`POST /api/v1/spec/KIND`: a file (`spec`) and the options typed beside it as the resolved spec, the
    directory to sync (a typed `sync` wins; a file's is relative to `spec_dir`, where the file is) and YAML."""
    if not isinstance(body, dict) or not isinstance(body.get("spec"), str):
        raise ValidationError(f"spec: the text of a {WHAT[kind]} is required")
    values, sync = _read(body, kind)
    values.pop("dry_run", None)
    if body.get("sync"):
        sync = str(body["sync"])
    elif sync and body.get("spec_dir"):
        sync = launch_spec.sync_path(sync, str(body["spec_dir"]))
    try:
        text = launch_spec.to_yaml(values, OPTIONS[kind], sync)
    except SpecError as exc:
        raise ValidationError(str(exc)) from None
    return {"spec": values, "sync": sync, "yaml": text}


def _property(option: launch_spec.Option) -> dict[str, Any]:
    number = {"minimum": option.low, "maximum": option.high} if option.low is not None else {}
    listed = {"type": ["array", "string"], "items": {"type": "string"}}
    return {
        "name": {"type": "string"},
        "text": {"type": "string"},
        "duration": {"type": "string"},
        "size": {"type": ["string", "integer"]},
        "keep": {"type": ["string", "integer"]},
        "dir": {"type": "string"},
        "int": {"type": "integer", **number},
        "count": {"type": "integer", **number},
        "float": {"type": "number", **number},
        "bool": {"type": "boolean"},
        "names": listed,
        "args": listed,
        "paths": listed,
        "kinds": listed,
        "weights": {"type": ["object", "string"], "additionalProperties": {"type": "number"}},
        "choice": {"enum": list(option.choices)},
        "grid": {"type": ["object", "array", "string"]},
        "random": {"type": ["object", "array", "string"]},
    }[option.kind]


def json_schema(kind: str, title: str) -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of a job (or sweep) file: every key the table gives, dashed or not."""
    props: dict[str, Any] = {}
    for option in OPTIONS[kind]:
        for key in option.file_keys:
            prop = {**_property(option), "description": f"{option.help or option.flag}; takes {option.what()}"}
            if key in props:  # `nodes`: a count or a list of names
                both = f"{props[key]['description']}; or {prop['description']}"
                prop = {"anyOf": [props[key], prop], "description": both}
            props[key] = prop
    for key in list(props):
        props.setdefault(key.replace("_", "-"), props[key])
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": title,
        "type": "object",
        "properties": props,
        "required": ["name"],
        "additionalProperties": False,
    }
