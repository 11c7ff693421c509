"""Request checks from the OpenAPI document's own schemas (JSON Schema).

Each route's request body is validated against the schema that
api/openapi.py publishes for it (OpenAPI 3.1: plain JSON Schema), so the
document and the checks cannot drift apart. fastjsonschema (which nbformat depends on)
compiles each schema into Python once, on first use: importing it costs a
server start about 5 ms and checking a body microseconds.
"""

import functools
import re

import fastjsonschema

from snapkernel.api import openapi
from snapkernel.api.errors import BadRequest


def _compile(schema):
    """A function that raises JsonSchemaValueException when its argument does not fit.

    use_default=False: a check must never fill defaults into the request.
    """
    return fastjsonschema.compile(schema, use_default=False)


# A lone surrogate: what a JSON escape such as "\\ud800" or a path's invalid UTF-8 decodes
# to. Refused everywhere (I-JSON, RFC 7493), rather than by each schema: no schema pattern
# can say it in a way every JSON Schema tool reads alike.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(data):
    """True if any string of the JSON value `data` (keys too) holds a lone surrogate."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return True
        elif isinstance(value, dict):
            stack.extend(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


@functools.cache
def _validator(path, method):
    """The validator of `method path`'s request body."""
    operation = openapi.document()["paths"][path][method.lower()]
    return _compile(operation["requestBody"]["content"]["application/json"]["schema"])


@functools.cache
def _state_name_validator():
    """The validator of one state name."""
    return _compile(openapi.json_schema(openapi.STATE_NAME))


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
    if isinstance(error.definition, dict) and "x-message" in error.definition:
        return f"{field}: {error.definition['x-message']}"  # the schema's own words
    if error.rule == "propertyNames":
        names = fastjsonschema.compile(error.rule_definition)
        bad = [k for k in error.value if not _valid(names, k)] \
            if isinstance(error.value, dict) else []
        return (f"{field}: {', '.join(map(repr, bad))}: " if bad else f"{field}: ") + \
            error.rule_definition.get("description", "a key is not allowed")
    if error.rule == "oneOf" and all("type" in d for d in error.rule_definition):
        return f"{field} must be " + " or ".join(d["type"] for d in error.rule_definition)
    # fastjsonschema names the value "data.a.b"; say which field instead.
    text = error.message.removeprefix(error.name).strip()
    return f"{field} {text if len(text) <= 200 else text[:200] + '...'}"


def check_body(path, method, data):
    """Raise BadRequest unless `data` fits the request schema of `method path`."""
    if _lone_surrogate(data):
        raise BadRequest("the body holds a lone surrogate (a \\ud800 to \\udfff escape "
                         "outside a pair): strings must be valid Unicode")
    try:
        _validator(path, method)(data)
    except fastjsonschema.JsonSchemaValueException as error:
        raise BadRequest(_message(error, "the body")) from None


def check_state_name(value, what):
    """Raise BadRequest unless `value` is a valid state name; return it."""
    if _SURROGATE.search(value):
        raise BadRequest(f"{what} must be valid UTF-8")
    try:
        _state_name_validator()(value)
    except fastjsonschema.JsonSchemaValueException as error:
        raise BadRequest(_message(error, what)) from None
    return value


def _valid(check, value):
    """Whether `value` passes the compiled schema `check`."""
    try:
        check(value)
        return True
    except fastjsonschema.JsonSchemaException:
        return False
