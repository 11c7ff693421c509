"""The OpenAPI 3 document of the server's HTTP API, served at GET /openapi.json.

It describes every route of docs/api.md's table with its request and
answer schemas, the JSON error every failure is answered with, and the two
ways of passing the token (query parameter `token`, `Authorization: Bearer`).
/openapi.json itself needs the token, like every route but /health: it
tells nothing secret, but "only /health is open" is a rule easy to check.
"""

import dataclasses
import keyword

from snapkernel.kernel import __version__
from snapkernel.kernel.notebook.environment import REFUSED_PARTS
from snapkernel.kernel.notebook.model import (CELL_FIELDS, ORDERS, STATE_KINDS, CellStatus,
                                              FreshOptions, NotebookRequest, NotebookRun)
from snapkernel.kernel.notebook.reasons import NOTES, REASONS
from snapkernel.kernel.protocol import ExecuteAnswer
from snapkernel.kernel.server.registry import MAX_NAME_BYTES

MAX_NAME = 200

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
    }},
}

STATE_NAME = {
    "type": "string", "minLength": 1, "maxLength": MAX_NAME,
    "pattern": "^[^\\x00-\\x1f\\x7f-\\x9f]*$",
    "description": f"1 to {MAX_NAME} characters and at most {MAX_NAME_BYTES} bytes in "
                   f"UTF-8, no control characters; slashes and any Unicode are fine",
}
_STATE_NAME = STATE_NAME

_EXEC_ID = {"description": "Identifies the execution for /interrupt and 409 on reuse",
            "oneOf": [{"type": "string"}, {"type": "integer"}]}

_NAMES = {"type": "array", "items": {"type": "string"}}
_HEALTH = {"type": "object", "required": ["status", "server"], "properties": {
    "status": {"type": "string", "enum": ["ok", "draining"]},
    "server": {"type": "object", "required": ["id", "pid"], "properties": {
        "id": {"type": "string"}, "pid": {"type": "integer"}}}}}
# A variable a fresh run may be given: a name, and none that may hold a secret.
_ENV_NAME = {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$",
             "not": {"pattern": "|".join("".join(f"[{c}{c.lower()}]" for c in part)
                                         for part in REFUSED_PARTS)},
             "description": "An environment variable's name; none containing "
                            f"{', '.join(REFUSED_PARTS)} (any case): it may hold a secret",
             "x-message": "must be a variable's name containing none of "
                          f"{', '.join(REFUSED_PARTS)} (any case): such a variable may hold "
                          "a secret"}
# The longest time limit a request may give, in seconds (a year): longer ones overflow
# the clock's arithmetic.
_MAX_SECONDS = 365 * 24 * 3600
_CODE = {"type": "string", "description": "The cell's source (\"\" runs nothing)"}
# A Python identifier, as far as a regular expression can say (str.isidentifier decides).
_IDENTIFIER = {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$",
               "description": "each key must be a Python identifier (ASCII)"}
_CWD = {"type": "string", "nullable": True, "pattern": "^/",
        "description": "The notebook's folder (an absolute path to a folder on the server, "
                       "else 400): the cell runs there, with the folder first on sys.path, "
                       "unless an earlier cell of the state chose another; the states made "
                       "from it keep it"}

_MESSAGE_ID = {"type": "string", "nullable": True, "minLength": 1, "maxLength": 256,
               "pattern": STATE_NAME["pattern"],
               "description": "The id of the Jupyter message the cell answers (1 to 256 "
                              "characters, no control characters): the cell's process gives "
                              "it as its parent message's id, by which an ipywidgets Output "
                              "widget captures what the cell shows"}

_CELL_ERROR = {
    "type": "object", "nullable": True,
    "required": ["ename", "evalue", "traceback"],
    "properties": {"ename": {"type": "string"}, "evalue": {"type": "string"},
                   "traceback": _NAMES},
}

_OUTPUT = {
    "type": "object", "required": ["output_type"],
    "description": "An nbformat 4 output (stream, display_data, execute_result, error)",
    "properties": {"output_type": {"type": "string", "enum": [
        "stream", "display_data", "execute_result", "error", "update_display_data"]}},
}

# The schema of each field of kernel.protocol.ExecuteAnswer (which defines the fields).
_ANSWER_FIELDS = {
    "output": {"type": "array", "items": _OUTPUT},
    "state_name": {"type": "string", "nullable": True,
                   "description": "The new state; null when the cell failed"},
    "error": _CELL_ERROR,
    "accessed_symbols": _NAMES,
    "modified_symbols": _NAMES,
    "deleted_symbols": _NAMES,
    "execution_count": {"type": "integer", "nullable": True},
    "volatile_symbols": _NAMES,
    "files_read": {"type": "array", "items": {"type": "string"},
                   "description": "Files the cell opened for reading (absolute paths; "
                                  "the interpreter's and packages' own left out)"},
    "files_written": {"type": "array", "items": {"type": "string"},
                      "description": "Files the cell opened for writing"},
    "inert_symbols": dict(_NAMES, description="Variables holding open files, sockets, "
                          "processes, connections or memory maps, which a restore of the "
                          "state gives back closed (never reopened for writing, "
                          "reconnected or restarted)"),
}
assert list(_ANSWER_FIELDS) == [f.name for f in dataclasses.fields(ExecuteAnswer)]
_EXECUTE_ANSWER = {"type": "object", "required": list(_ANSWER_FIELDS),
                   "properties": _ANSWER_FIELDS}
_STREAM = {"type": "boolean", "nullable": True,
           "description": "true: answer application/x-ndjson, one line per output item as "
                          "the cell produces it ({\"type\": \"output\", \"output\"} or "
                          "{\"type\": \"clear_output\", \"wait\"}) or comm message "
                          "of a widget ({\"type\": \"comm\", \"msg_type\", \"content\", "
                          "\"metadata\", \"buffers\"}), then {\"type\": \"answer\", "
                          "\"answer\"}"}

# One line of a streamed answer (OpenAPI has no NDJSON: the schema is that of a line).
_STREAM_LINE = {
    "type": "object", "required": ["type"],
    "properties": {"type": {"type": "string",
                            "enum": ["output", "clear_output", "comm", "answer"]},
                   "output": _OUTPUT, "wait": {"type": "boolean"},
                   # A comm message of the cell's process to the front end, as Jupyter's
                   # iopub carries it (kernel/worker/capture/comms.py); buffers base64.
                   "msg_type": {"type": "string",
                                "enum": ["comm_open", "comm_msg", "comm_close"]},
                   "content": {"type": "object"}, "metadata": {"type": "object"},
                   "buffers": {"type": "array", "items": {"type": "string"}},
                   "answer": _EXECUTE_ANSWER},
}

_GROUPS = {
    "type": "object", "required": ["groups", "fingerprints"],
    "properties": {"groups": {"type": "array", "items": _NAMES},
                   "fingerprints": {"type": "array",
                                    "items": {"type": "string", "nullable": True}}},
}


# The schema of each field of a notebook run's cell (kernel.notebook.model.CELL_FIELDS).
_NOTEBOOK_CELL = {
    "type": "object", "required": list(CELL_FIELDS),
    "properties": {
        "id": {"type": "string"},
        "key": {"type": "string", "nullable": True,
                "description": "SHA-256 the cell's result is stored under; null when the "
                               "cell cannot run"},
        "status": {"type": "string", "enum": [s.value for s in CellStatus],
                   "description": "pending and running only while the run goes on; "
                                  "skipped and empty only in fresh runs"},
        "took_s": {"type": "number", "nullable": True},
        "outputs": {"type": "array", "items": _OUTPUT},
        "error": _CELL_ERROR,
        "execution_count": {"type": "integer", "nullable": True},
        "state_name": {"type": "string", "nullable": True,
                       "description": "The state the cell left, for /execute and the others"},
        "execution": {"type": "object", "nullable": True,
                      "additionalProperties": {"type": "string"},
                      "description": "nbclient's timings (iopub.status.busy, "
                                     "iopub.execute_input, shell.execute_reply, "
                                     "iopub.status.idle) of the run that made the cell's "
                                     "result"},
        "reason": {
            "type": "object", "nullable": True, "required": ["kind", "message"],
            "properties": {"kind": {"type": "string", "enum": list(REASONS + NOTES)},
                           "message": {"type": "string"}},
            "description": "Why the cell ran (rerun, volatile, input_ran, wrote_file, new, "
                           "failed_before, result_gone, source_changed, "
                           "environment_changed, module_changed, input_changed, "
                           "file_changed, key_changed), or for a reused cell what its "
                           "result cannot know (reads_clock, unseeded_random); null "
                           "otherwise and in fresh runs"},
    },
}

assert list(_NOTEBOOK_CELL["properties"]) == list(CELL_FIELDS)
_NOTEBOOK_RECORD = {
    "type": "object",
    "required": ["notebook", "order", "diagnostics", "cells", "state_name"],
    "properties": {
        "notebook": {"type": "string"},
        "order": dict(_NAMES, description="Cell ids in the order the run took them"),
        "diagnostics": {"type": "array", "items": {
            "type": "object", "required": ["kind", "cells", "names", "message"],
            "properties": {
                "kind": {"type": "string", "enum": ["syntax_error", "cycle",
                                                    "double_definition",
                                                    "foreign_assignment",
                                                    "no_error_raised"]},
                "cells": _NAMES, "names": _NAMES, "message": {"type": "string"},
                "line": {"type": "integer", "nullable": True},
                "column": {"type": "integer", "nullable": True}}}},
        "cells": {"type": "array", "items": _NOTEBOOK_CELL},
        "state_name": {"type": "string", "nullable": True,
                       "description": "A state with every name as the run left it"},
        "order_kind": {"type": "string", "enum": list(ORDERS)},
        "exec_id": {"type": "string", "nullable": True},
        "running": {"type": "boolean"},
        "started": {"type": "string"},
        "finished": {"type": "string", "nullable": True},
        "language_info": {"type": "object", "nullable": True,
                          "description": "The notebook's metadata.language_info, of the "
                                         "interpreter that ran the cells"},
        "receipt": {"type": "object", "description": "A fresh run's receipt (its JSON "
                                                     "Schema is in docs/fresh-runs.md)"},
    },
}
assert set(_NOTEBOOK_RECORD["properties"]) == {f.name for f in dataclasses.fields(NotebookRun)}
_NOTEBOOK_STREAM = {"type": "boolean", "nullable": True,
                    "description": "true: answer application/x-ndjson, one line per change "
                                   "of a cell's status as the run goes ({\"type\": \"cell\", "
                                   "\"cell\"}), then {\"type\": \"answer\", \"answer\"}"}
_NOTEBOOK_LINE = {
    "type": "object", "required": ["type"],
    "properties": {"type": {"type": "string", "enum": ["cell", "answer"]},
                   "cell": _NOTEBOOK_CELL, "answer": _NOTEBOOK_RECORD},
}

_NOTEBOOK_NAME = [{"name": "name", "in": "path", "required": True, "schema": _STATE_NAME,
                   "description": "The notebook's name, percent-encoded"}]


def _body(properties, required, extra=None):
    """A required JSON request body with these properties (and the `extra` keywords of
    its schema)."""
    return {"required": True, "content": {"application/json": {"schema": dict(
        {"type": "object", "properties": properties, "required": required}, **(extra or {}))}}}


# A notebook run takes the options of its kind only (kernel.protocol says which): with
# "fresh": true, those of incremental runs are absent, null or false; without, those of
# fresh runs are absent or null.
_ONE_KIND_OF_RUN = {
    "if": {"required": ["fresh"], "properties": {"fresh": {"const": True}}},
    "then": {"properties": {k: {"enum": [None, False], "x-message": "not for a fresh run"}
                            for k in NotebookRequest.INCREMENTAL_ONLY}},
    "else": {"properties": {k: {"type": "null", "x-message": "only for a fresh run "
                                                           "(\"fresh\": true)"}
                            for k in FreshOptions.names(command=False, shared=False)}},
}


# What any request may be answered, before its route looks at it: a web page's request
# (403: api/guard.py), a body that is not JSON (415), a request line and headers past
# max_header_kb (431).
_ANY_REQUEST = (403, 415, 431)


def _answer(schema, description, errors=(400, 401), line=None):
    """The responses of an operation: 200 with `schema`, the listed errors as JSON;
    with a `line` schema: or, asked with "stream": true, NDJSON lines of it."""
    content = {"application/json": {"schema": schema}}
    if line is not None:
        content["application/x-ndjson"] = {"schema": line}
    responses = {"200": {"description": description, "content": content}}
    for status in sorted(set(errors) | set(_ANY_REQUEST)):
        responses[str(status)] = {"$ref": f"#/components/responses/E{status}"}
    return responses


def _name_param():
    """The {name} path parameter of /states/{name}."""
    return [{"name": "name", "in": "path", "required": True, "schema": _STATE_NAME,
             "description": "The state's name, percent-encoded (`.` as %2E, since clients "
                            "drop dot segments); a slash, plain or as %2F, is part of it"}]


def json_schema(schema):
    """A schema written with OpenAPI 3.0's `nullable` as JSON Schema (OpenAPI 3.1's):
    nullable becomes a null type."""
    if isinstance(schema, list):
        return [json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: json_schema(v) for k, v in schema.items() if k != "nullable"}
    if schema.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        elif "oneOf" in out:
            out["oneOf"] = out["oneOf"] + [{"type": "null"}]
    return out


def document(version=__version__):
    """The OpenAPI 3.1 document of every route (a new dict on each call)."""
    body_errors = (400, 401, 413)
    paths = {
        "/execute": {"post": {
            "summary": "Run a cell from a state; on success the new state is stored",
            "requestBody": _body({"code": _CODE,
                                  "exec_id": _EXEC_ID,
                                  "state_name": _STATE_NAME,
                                  "new_state_name": dict(_STATE_NAME, nullable=True),
                                  "stream": _STREAM, "cwd": _CWD,
                                  "message_id": _MESSAGE_ID,
                                  "execution_count": {
                                      "type": "integer", "nullable": True, "minimum": 1,
                                      "maximum": 2 ** 31 - 1,
                                      "description": "The cell's In[N], which its "
                                                     "tracebacks and its state show "
                                                     "(default: the input state's + 1)"}},
                                 ["code", "exec_id", "state_name"]),
            "responses": _answer(_EXECUTE_ANSWER, "The cell's outputs and the new state's "
                                 "name; a missing input state is error StateNotFound",
                                 body_errors + (409, 500, 503, 507), _STREAM_LINE)}},
        "/multistate_execute": {"post": {
            "summary": "Run a cell with states under aliases; nothing is stored",
            "requestBody": _body({"code": _CODE,
                                  "exec_id": _EXEC_ID,
                                  "state_mapping": {
                                      "type": "object", "additionalProperties": _STATE_NAME,
                                      "propertyNames": _IDENTIFIER,
                                      "description": "Keys are Python identifiers (the "
                                                     "names the cell sees the states by)"},
                                  "default_state": dict(_STATE_NAME, nullable=True),
                                  "stream": _STREAM},
                                 ["code", "exec_id", "state_mapping"]),
            "responses": _answer(_EXECUTE_ANSWER, "The cell's outputs; state_name is null",
                                 body_errors + (409, 500, 503), _STREAM_LINE)}},
        "/states": {"get": {
            "summary": "Every state name, oldest first",
            "parameters": [{"name": "kind", "in": "query", "required": False,
                            "schema": {"type": "string", "enum": list(STATE_KINDS),
                                       "default": "all"},
                            "description": "all (the default: what the reference server "
                                           "and Plainbook expect); user: leave out the "
                                           "states notebook runs made (nb- and the cell's "
                                           "64-hex key); notebook: only those"}],
            "responses": _answer({"type": "object", "required": ["states"],
                                  "properties": {"states": _NAMES}}, "The names")}},
        "/states/{name}": {
            "get": {
                "summary": "One state's variables and lineage",
                "parameters": _name_param(),
                "responses": _answer({"type": "object", "required": [
                    "name", "timestamp", "variables"], "properties": {
                    "name": {"type": "string"},
                    "timestamp": {"type": "string", "format": "date-time"},
                    "variables": {"type": "object", "additionalProperties": {
                        "type": "object", "properties": {"type": {"type": "string"},
                                                         "repr": {"type": "string"}}}},
                    "modules": {"type": "object"},
                    "parent": {"type": "string", "nullable": True},
                    "execution_count": {"type": "integer"},
                    "volatile_symbols": _NAMES, "live": {"type": "boolean"},
                    "inert": {"type": "object", "description": "Variables whose values "
                              "hold open files, sockets, processes... that a restore gives "
                              "back closed, each with what",
                              "additionalProperties": _NAMES},
                    "python": {"type": "string"},
                    "cwd": {"type": "string", "description": "The folder its cells run in"},
                    "context": dict(_NAMES, description="What the state keeps besides its "
                                    "names (the random generators, library settings, "
                                    "the environment...: docs/state.md)"),
                    "unkept": dict(_NAMES, description="Attributes its cells set on modules "
                                   "whose values could not be stored"),
                    "local_modules": {"type": "object", "description": "Modules its cells "
                                      "imported from files of their own",
                                      "additionalProperties": {
                                          "type": "object",
                                          "properties": {"path": {"type": "string"},
                                                         "sha256": {"type": "string"},
                                                         "changed": {"type": "boolean"}}}}}},
                    "The state", (400, 401, 404))},
            "delete": {
                "summary": "Delete a state (`initial` cannot be deleted: 409)",
                "parameters": _name_param(),
                "responses": _answer({"type": "object", "required": ["deleted"],
                                      "properties": {"deleted": {"type": "string"}}},
                                     "Deleted", (400, 401, 404, 409, 503, 507))}},
        "/symbol_hashes": {"post": {
            "summary": "Content hashes of variables, from the manifest",
            "requestBody": _body({"state_name": _STATE_NAME, "symbols": _NAMES,
                                  "hash_algo": {"type": "string", "enum": ["full"],
                                                "nullable": True}},
                                 ["state_name", "symbols"]),
            "responses": _answer({"type": "object", "required": ["hashes"], "properties": {
                "hashes": {"type": "object", "additionalProperties": {
                    "type": "string", "nullable": True}}}}, "A hash (hex) or null per symbol",
                body_errors + (404,))}},
        "/alias_groups": {"post": {
            "summary": "Alias groups and their fingerprints, from the manifest",
            "requestBody": _body({"state_name": _STATE_NAME}, ["state_name"]),
            "responses": _answer(_GROUPS, "Every variable in exactly one group",
                                 body_errors + (404,))}},
        "/rebuild_state": {"post": {
            "summary": "A state of source_vars from one state and input_vars from another",
            "requestBody": _body({"input_state": _STATE_NAME, "source_state": _STATE_NAME,
                                  "source_vars": _NAMES, "input_vars": _NAMES,
                                  "new_state_name": dict(_STATE_NAME, nullable=True)},
                                 ["input_state", "source_state", "source_vars",
                                  "input_vars"]),
            "responses": _answer(dict(_GROUPS, required=["state_name", "groups",
                                                         "fingerprints"],
                                      properties=dict(_GROUPS["properties"],
                                                      state_name={"type": "string"})),
                                 "The new state", body_errors + (404, 409, 500, 503, 507))}},
        "/reset": {"post": {
            "summary": "Drop every state, stored result and notebook record; an empty "
                       "`initial` remains (no body needed; 409 with a shared remote store)",
            "responses": _answer({"type": "object", "required": ["status"],
                                  "properties": {"status": {"type": "string"}}}, "Done",
                                 (400, 401, 409, 507))}},
        "/interrupt": {"post": {
            "summary": "SIGINT the execution `exec_id` (or the running cell of the notebook "
                       "run `exec_id`, which then stops), SIGKILL after interrupt_grace_s",
            "requestBody": _body({"exec_id": _EXEC_ID}, ["exec_id"]),
            "responses": _answer({"type": "object", "required": ["interrupted"],
                                  "properties": {"interrupted": {"type": "boolean"}}},
                                 "Whether such an execution was running", body_errors)}},
        "/notebooks/run": {"post": {
            "summary": "Bring every cell of a notebook up to date: run only the cells whose "
                       "result could have changed, reuse the others' stored results; "
                       "\"fresh\": true runs them all from scratch in a new interpreter, "
                       "within limits, with a receipt",
            "requestBody": _body({
                "notebook": _STATE_NAME,
                "cells": {"type": "array", "items": {
                    "type": "object", "required": ["id", "source"],
                    "properties": {"id": {"type": "string", "minLength": 1},
                                   "source": {"type": "string"},
                                   "tags": dict(_NAMES, description="fresh runs: no-execute "
                                                "or skip-execution skips the cell")}}},
                "order": {"type": "string", "enum": ["notebook", "dataflow"],
                          "nullable": True},
                "rerun": dict(_NAMES, nullable=True,
                              description="Cell ids to run, with everything downstream, "
                                          "even if nothing changed"),
                "exec_id": dict(_EXEC_ID, nullable=True),
                "stream": _NOTEBOOK_STREAM,
                "allow_errors": {"type": "boolean", "nullable": True,
                                 "description": "Go on past a failing cell (nbclient's "
                                                "allow_errors): it is failed, and the cells "
                                                "after it see what it did before it raised. "
                                                "Not for fresh runs"},
                "parameters": {"type": "object", "nullable": True,
                               "propertyNames": dict(_IDENTIFIER, **{
                                   "not": {"enum": keyword.kwlist},
                                   "description": "each key must be a Python identifier "
                                                  "(ASCII), not a keyword"}),
                               "description": "papermill's parameters {name: value}: a "
                                              "cell tagged injected-parameters assigning "
                                              "them follows the cell tagged parameters (at "
                                              "the top if none is; it replaces a cell "
                                              "tagged injected-parameters). Names must be "
                                              "Python identifiers"},
                "timeout": {"type": "number", "nullable": True, "exclusiveMinimum": 0,
                            "maximum": _MAX_SECONDS,
                            "description": "Whole-run deadline in seconds: the running cell "
                                           "fails with Timeout, the rest do not run "
                                           "(default: none; fresh: fresh.timeout_s)"},
                "cell_timeout": {"type": "number", "nullable": True, "minimum": 0,
                                 "maximum": _MAX_SECONDS,
                                 "description": "Longest cell in seconds, 0 = none: it is "
                                                "interrupted and fails with Timeout, "
                                                "keeping no state (default: "
                                                "limits.cell_timeout_s; fresh: "
                                                "fresh.cell_timeout_s)"},
                "fresh": {"type": "boolean", "nullable": True,
                          "description": "Run every cell from scratch in a new interpreter, "
                                         "within limits, keeping no state; the answer adds "
                                         "the receipt. The options below are for fresh runs "
                                         "only"},
                "env": {"type": "array", "nullable": True, "items": _ENV_NAME,
                        "description": "Variables of the server's environment passed to the "
                                       "run (each must be set there, else 400)"},
                "cwd": dict(_CWD, description="The notebook's folder, absolute: the cells run "
                                              "there (a fresh run's default: a temporary "
                                              "folder)"),
                "expected_environment": {
                    "type": "string", "nullable": True, "pattern": "^[0-9a-f]{64}$",
                    "description": "Refuse to run unless the kernel's environment SHA-256 "
                                   "is this"}},
                ["notebook", "cells"], _ONE_KIND_OF_RUN),
            "responses": _answer(_NOTEBOOK_RECORD, "The run's record (a failed fresh run "
                                                   "answers 200 too: see its receipt)",
                                 body_errors + (409, 503, 507), _NOTEBOOK_LINE)}},
        "/notebooks": {"get": {
            "summary": "Every notebook with a record",
            "responses": _answer({"type": "object", "required": ["notebooks"],
                                  "properties": {"notebooks": _NAMES}}, "The names")}},
        "/notebooks/{name}": {
            "get": {
                "summary": "A notebook's last run (or the one in progress), cell by cell",
                "parameters": _NOTEBOOK_NAME,
                "responses": _answer(_NOTEBOOK_RECORD, "The record", (400, 401, 404))},
            "delete": {
                "summary": "Forget a notebook's record (409 while it runs); stored results "
                           "stay",
                "parameters": _NOTEBOOK_NAME,
                "responses": _answer({"type": "object", "required": ["deleted"],
                                      "properties": {"deleted": {"type": "string"}}},
                                     "Deleted", (400, 401, 404, 409))}},
        "/health": {"get": {
            "summary": "Liveness and which server answered; the only route without the "
                       "token",
            "security": [],
            "responses": dict(
                {str(status): {"$ref": f"#/components/responses/E{status}"}
                 for status in _ANY_REQUEST},
                **{"200": {"description": "Up", "content": {"application/json": {
                    "schema": _HEALTH}}},
                   "503": {"description": "Draining: stopping within server.drain_s",
                           "content": {"application/json": {"schema": _HEALTH}}}})}},
        "/openapi.json": {"get": {
            "summary": "This document",
            "responses": _answer({"type": "object"}, "The OpenAPI document", (401,))}},
    }
    responses = {f"E{status}": {"description": text, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"}}}}
        for status, text in {400: "Bad input", 401: "No or wrong token",
                             404: "Unknown state or notebook", 409: "Conflict",
                             403: "Refused: a web page's request (its Host or Origin "
                                  "is not this server's: server.allowed_hosts, "
                                  "server.allowed_origins)",
                             413: "Body larger than max_body_mb",
                             415: "A body not sent as Content-Type: application/json",
                             431: "Request line and headers larger than max_header_kb",
                             500: "StoreCorrupt: a stored value needed is damaged on disk "
                                  "(NewerFormat: written by a newer server)",
                             503: "Store unavailable, or the server is stopping",
                             507: "StoreFull: max_store_gb or the file system is full"}.items()}
    return json_schema({
        "openapi": "3.1.0",
        "info": {"title": "Snapshot kernel server", "version": version,
                 "description": "Runs notebook cells against named, immutable, persistent "
                                "execution states. Every error is JSON "
                                "{\"error\": {\"type\", \"message\"}}. A body is sent "
                                "as Content-Type: application/json (415 otherwise), and "
                                "its strings are valid Unicode (a lone surrogate escape "
                                "is 400). A request from a web page of another origin, "
                                "or naming another host (DNS rebinding), is refused 403 "
                                "before its token is looked at (docs/api.md)."},
        "security": [{"bearer": []}, {"token": []}],
        "paths": paths,
        "components": {
            "schemas": {"Error": _ERROR},
            "responses": responses,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer",
                           "description": "Authorization: Bearer TOKEN"},
                "token": {"type": "apiKey", "in": "query", "name": "token",
                          "description": "?token=TOKEN (the reference client's way)"},
            },
        },
    })
