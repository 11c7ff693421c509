"""Request checks from the OpenAPI document's own schemas (JSON Schema).

Each route's request body is validated against the schema that
api/openapi.py publishes for it, so the document and the checks cannot
drift apart. OpenAPI 3.0's `nullable` is turned into JSON Schema's
`"type": [..., "null"]` first. fastjsonschema (which nbformat depends on)
compiles each schema into Python once, on first use: importing it costs a
server start about 5 ms and checking a body microseconds.
"""

import functools

import fastjsonschema

from snapkernel.api import openapi
from snapkernel.api.errors import BadRequest


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


def _compile(schema):
    """A function that raises JsonSchemaValueException when its argument does not fit.

    use_default=False: a check must never fill defaults into the request.
    """
    return fastjsonschema.compile(_json_schema(schema), use_default=False)


@functools.cache
def _validator(path, method):
    """The validator of `method path`'s request body."""
    operation = openapi.document()["paths"][path][method.lower()]
    return _compile(operation["requestBody"]["content"]["application/json"]["schema"])


@functools.cache
def _state_name_validator():
    """The validator of one state name."""
    return _compile(openapi.STATE_NAME)


def _message(error, what):
    """A short message naming the field at fault (`what` when it is the whole value)."""
    where = "".join(f"[{p}]" if isinstance(p, int) or p.isdigit() else f".{p}"
                    for p in error.path[1:])
    field = f"field {where[1:] if where.startswith('.') else where!r}" if where else what
    if error.rule == "required":
        present = error.value if isinstance(error.value, dict) else {}
        missing = [name for name in error.rule_definition if name not in present]
        prefix = f"{where[1:]}." if where.startswith(".") else where
        return ", ".join(f"field {prefix + name!r}" for name in missing) + \
            (" is missing" if len(missing) == 1 else " are missing")
    if error.rule == "pattern" and error.rule_definition == openapi.STATE_NAME["pattern"]:
        return f"{field} must not contain control characters"
    if error.rule == "oneOf" and all("type" in d for d in error.rule_definition):
        return f"{field} must be " + " or ".join(d["type"] for d in error.rule_definition)
    # fastjsonschema names the value "data.a.b"; say which field instead.
    text = error.message.removeprefix(error.name).strip()
    return f"{field} {text if len(text) <= 200 else text[:200] + '...'}"


def check_body(path, method, data):
    """Raise BadRequest unless `data` fits the request schema of `method path`."""
    try:
        _validator(path, method)(data)
    except fastjsonschema.JsonSchemaValueException as error:
        raise BadRequest(_message(error, "the body")) from None


def check_state_name(value, what):
    """Raise BadRequest unless `value` is a valid state name; return it."""
    try:
        _state_name_validator()(value)
    except fastjsonschema.JsonSchemaValueException as error:
        raise BadRequest(_message(error, what)) from None
    return value
