"""Job files: a launch (or sweep) written once as YAML, read by the API the way its JSON body is read.

`ugro launch -f job.yaml` sends the file's text as `spec` and the flags the user typed beside it; the
flags win. The keys are the API's own field names (dashes may stand for underscores: `time-limit`), so
one JSON Schema, made from the serializer, describes the file (`GET /api/v1/spec/launch.schema.json`,
for editors that complete YAML from a schema).
"""

from __future__ import annotations

from typing import Any

import yaml
from rest_framework import serializers
from rest_framework.exceptions import ValidationError

MAX_SPEC_BYTES = 64 * 1024
NOT_IN_FILES = {"dry_run"}  # how one command runs, not what the job is


def merged(body: Any, serializer_class: type[serializers.Serializer]) -> Any:
    """The request body with its `spec` (YAML text) read under it: the body's own fields win. A body
    without `spec` is returned as it is; a bad file is a ValidationError in one line."""
    if not isinstance(body, dict) or "spec" not in body:
        return body
    text = body["spec"]
    if not isinstance(text, str) or len(text.encode()) > MAX_SPEC_BYTES:
        raise ValidationError(f"spec: the job file must be text of at most {MAX_SPEC_BYTES // 1024} KiB")
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValidationError(f"spec: not valid YAML{where}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ValidationError("spec: the job file must be a mapping of field: value")
    fields = set(serializer_class().fields) - NOT_IN_FILES
    values = {}
    for key, value in loaded.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ValidationError(f"spec: unknown field {str(key)[:60]!r} (fields: {', '.join(sorted(fields))})")
        values[name] = value
    return {**values, **{k: v for k, v in body.items() if k != "spec"}}


_TYPES = {
    serializers.BooleanField: "boolean",
    serializers.IntegerField: "integer",
    serializers.FloatField: "number",
    serializers.ListField: "array",
}


def json_schema(serializer_class: type[serializers.Serializer], title: str) -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of a job file, from the serializer's fields, their bounds and help."""
    props: dict[str, Any] = {}
    required = []
    for name, field in serializer_class().fields.items():
        if name in NOT_IN_FILES:
            continue
        kind = next((t for cls, t in _TYPES.items() if isinstance(field, cls)), "string")
        prop: dict[str, Any] = {"type": [kind, "null"] if getattr(field, "allow_null", False) else kind}
        if isinstance(field, serializers.ChoiceField):
            prop["enum"] = list(field.choices)
        for attr, key in (("min_value", "minimum"), ("max_value", "maximum"), ("max_length", "maxLength")):
            value = getattr(field, attr, None)
            if value is not None:
                prop["maxItems" if key == "maxLength" and kind == "array" else key] = value
        if kind == "array":
            prop["items"] = {"type": "string"}
        if field.help_text:
            prop["description"] = str(field.help_text)
        if field.required:
            required.append(name)
        props[name] = prop
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": title,
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }
