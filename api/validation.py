"""Request checks from the OpenAPI document's own schemas (JSON Schema).

Each route's request body is validated against the schema that
api/openapi.py publishes for it, so the document and the checks cannot
drift apart. OpenAPI 3.0's `nullable` is turned into JSON Schema's
`"type": [..., "null"]` first.
"""

import functools
import sys

# jsonschema imports optional format checkers at import time; rfc3987_syntax (when
# installed) builds a grammar for 2 to 3 s, which every server start would pay. Our
# schemas use no IRI format, so it is kept out (only if nothing imported it already).
sys.modules.setdefault("rfc3987_syntax", None)
import jsonschema  # noqa: E402

from api import openapi
from api.errors import BadRequest


def _json_schema(schema):
    """An OpenAPI 3.0 schema as plain JSON Schema (nullable -> a null type)."""
    if isinstance(schema, list):
        return [_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _json_schema(v) for k, v in schema.items() if k != "nullable"}
    if schema.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        elif "oneOf" in out:
            out["oneOf"] = out["oneOf"] + [{"type": "null"}]
    return out


@functools.cache
def _validator(path, method):
    """The validator of `method path`'s request body."""
    operation = openapi.document()["paths"][path][method.lower()]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft7Validator(_json_schema(schema))


@functools.cache
def _state_name_validator():
    """The validator of one state name."""
    return jsonschema.Draft7Validator(_json_schema(openapi.STATE_NAME))


def _message(error, what):
    """A short message naming the field at fault."""
    where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in error.path)
    field = f"field {where[1:] if where.startswith('.') else where!r}" if where else what
    if error.validator == "required":
        return error.message.replace("is a required property", "is missing")
    if error.validator == "pattern":
        return f"{field} must not contain control characters"
    text = error.message
    return f"{field}: {text if len(text) <= 200 else text[:200] + '...'}"


def check_body(path, method, data):
    """Raise BadRequest unless `data` fits the request schema of `method path`."""
    error = jsonschema.exceptions.best_match(_validator(path, method).iter_errors(data))
    if error is not None:
        raise BadRequest(_message(error, "the body"))


def check_state_name(value, what):
    """Raise BadRequest unless `value` is a valid state name; return it."""
    error = jsonschema.exceptions.best_match(_state_name_validator().iter_errors(value))
    if error is not None:
        raise BadRequest(_message(error, what))
    return value
