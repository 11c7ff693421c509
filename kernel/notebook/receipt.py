"""The receipt of a fresh run: what ran, in which environment, and how it ended.

A receipt is JSON that a CI pipeline keeps beside its artifacts. It holds
hashes, counts, timings, limits and names, never the notebook's source, its
outputs or a traceback (a failed cell is described by its exception's class
name). SCHEMA is its JSON Schema, printed in docs/fresh-runs.md; `check` holds
every receipt to it before it leaves the process.
"""

import functools
import json

import fastjsonschema

from snapkernel.kernel import __version__
from snapkernel.kernel import files
from snapkernel.kernel.notebook.model import FRESH_STATUSES, CellStatus

FORMAT = 2  # 2: "parameters"

# Why a run failed: exactly one of these, or null on success.
CATEGORIES = ("SYNTAX_ERROR", "CELL_ERROR", "WORKER_DIED", "CELL_TIMEOUT", "RUN_TIMEOUT",
              "OUTPUT_LIMIT", "MEMORY_FUSE", "TOO_MANY_CELLS", "NO_CODE", "ALL_SKIPPED",
              "SOURCE_CHANGED", "OUTPUT_EXISTS", "ENVIRONMENT_MISMATCH", "CLEANUP_FAILED",
              "BAD_INPUT")

_SHA256 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_COUNT = {"type": "integer", "minimum": 0}
_SECONDS = {"type": "number", "minimum": 0}


def _object(properties, nullable=False):
    """A closed object schema whose properties are all required."""
    schema = {"type": ["object", "null"] if nullable else "object",
              "required": list(properties), "additionalProperties": False,
              "properties": properties}
    return schema


def _nullable(schema):
    """`schema` or null."""
    return {"anyOf": [schema, {"type": "null"}]}


SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "Receipt of a fresh notebook run",
    **_object({
        "format": {"const": FORMAT},
        "success": {"type": "boolean"},
        "category": {"enum": list(CATEGORIES) + [None]},
        "message": {"type": "string"},
        "package": _object({"name": {"type": "string"}, "version": {"type": "string"}}),
        "source": _object({"path": {"type": ["string", "null"]}, "sha256": _nullable(_SHA256)}),
        "output": _object({"path": {"type": "string"}, "sha256": _nullable(_SHA256),
                           "written": {"type": "boolean"}}, nullable=True),
        "lock": _object({"path": {"type": "string"}, "sha256": _SHA256}, nullable=True),
        # The run's parameters as given (papermill's -p, -f, -y; the API's), null for none.
        "parameters": {"type": ["object", "null"]},
        "kernel": _object({
            "executable": {"type": "string"},
            "interpreter_sha256": _SHA256,
            "python_version": {"type": "string"},
            "version": {"type": "string"},
            "implementation": {"type": "string"},
            "distributions": _COUNT,
            "environment_sha256": _SHA256}, nullable=True),
        "environment": _object({
            "variables": {"type": "array", "items": {"type": "string"}},
            "cwd": {"type": ["string", "null"]},
            "expected_sha256": _nullable(_SHA256)}),
        "counts": _object({name: _COUNT for name in (
            "code_cells", "attempted", "completed", "failed", "skipped", "empty",
            "not_run")}),
        "cells": {"type": "array", "items": _object({
            "index": _COUNT,
            "id": {"type": "string"},
            "status": {"enum": [s.value for s in FRESH_STATUSES]},
            "seconds": _SECONDS,
            "execution_count": {"type": ["integer", "null"]},
            "category": {"enum": list(CATEGORIES) + [None]},
            "ename": {"type": ["string", "null"]}})},
        "started_at": {"type": "string", "format": "date-time"},
        "ended_at": {"type": "string", "format": "date-time"},
        "seconds": _SECONDS,
        "limits": _object({
            "timeout_s": {"type": "number", "exclusiveMinimum": 0},
            "cell_timeout_s": _SECONDS,
            "max_output_bytes": _COUNT,
            "max_code_cells": _COUNT,
            "memory_fuse_mb": _COUNT,
            "cleanup_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 30}},
            nullable=True),
        "output_bytes": _COUNT,
        "peak_memory_mb": _SECONDS,
        "cleanup": _object({
            "status": {"enum": ["ok", "failed"]},
            "seconds": _SECONDS,
            "processes_observed": _COUNT,
            "processes_left": _COUNT,
            "files_removed": {"type": "boolean"}}),
        "scope": _object({
            "processes": {"const": "observed"},
            "network_isolation": {"const": "UNAVAILABLE"},
            "process_isolation": {"const": "UNAVAILABLE"}}),
    }),
}

SCOPE = {"processes": "observed", "network_isolation": "UNAVAILABLE",
         "process_isolation": "UNAVAILABLE"}


def package():
    """{name, version} of this package (the code that runs, installed or not)."""
    return {"name": "snapshot-kernel-server", "version": __version__}


def build(run, source, output=None, lock=None, cwd=None, parameters=None):
    """The receipt of a finished FreshRun (kernel/notebook/fresh.py).

    `source` is {path, sha256}; `output` {path, sha256, written} or None when
    no executed notebook was asked for; `lock` {path, sha256} or None; `cwd`
    the working directory as the receipt names it; `parameters` the run's.
    """
    cells = run.cells
    def count(*statuses):
        """How many cells ended with one of `statuses`."""
        return sum(c.status in statuses for c in cells)

    counts = {"code_cells": len(cells),
              "attempted": count(CellStatus.RAN, CellStatus.FAILED),
              "completed": count(CellStatus.RAN), "failed": count(CellStatus.FAILED),
              "skipped": count(CellStatus.SKIPPED), "empty": count(CellStatus.EMPTY),
              "not_run": count(CellStatus.NOT_RUN)}
    limits = run.limits
    receipt = {
        "format": FORMAT,
        "success": run.success,
        "category": run.category,
        "message": run.message or "every code cell that was not skipped completed",
        "package": package(),
        "source": source,
        "output": output,
        "lock": lock,
        "parameters": parameters or None,
        "kernel": run.interpreter,
        "environment": {"variables": run.env_names, "cwd": cwd,
                        "expected_sha256": run.expected_environment},
        "counts": counts,
        "cells": [{"index": c.index, "id": c.id, "status": c.status, "seconds": c.took_s,
                   "execution_count": c.execution_count, "category": c.category,
                   "ename": c.error["ename"] if c.error else None} for c in cells],
        "started_at": run.started_at,
        "ended_at": run.ended_at,
        "seconds": run.seconds,
        "limits": None if limits is None else {
            "timeout_s": limits.timeout_s, "cell_timeout_s": limits.cell_timeout_s,
            "max_output_bytes": limits.max_output_bytes,
            "max_code_cells": limits.max_code_cells,
            "memory_fuse_mb": limits.memory_fuse_mb, "cleanup_s": limits.cleanup_s},
        "output_bytes": run.output_bytes,
        "peak_memory_mb": round(run.peak_bytes / 2 ** 20, 1),
        "cleanup": run.cleanup,
        "scope": dict(SCOPE),
    }
    check(receipt)
    return receipt


@functools.cache
def _checker():
    """SCHEMA compiled (about 50 ms: on first use, not at every server start)."""
    return fastjsonschema.compile(SCHEMA, use_default=False)


def check(receipt):
    """Raise fastjsonschema.JsonSchemaValueException unless `receipt` fits SCHEMA
    (formats such as date-time included)."""
    _checker()(receipt)


def write(receipt, path):
    """Check `receipt` and write it to `path` (replaced atomically)."""
    check(receipt)
    data = (json.dumps(receipt, indent=2) + "\n").encode()
    files.promote(files.stage(path, data), path, overwrite=True)
