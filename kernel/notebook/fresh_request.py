"""A fresh run asked for over HTTP: POST /notebooks/run with "fresh": true.

The notebook comes as its code cells ({id, source, tags?}); its source
SHA-256 in the receipt is over their ids, sources and skip flags. The
answer has the shape of every /notebooks/run answer (cells with their
status, outputs and error), plus the receipt; fresh runs keep no state, so
every `state_name` and `key` is null.
"""

import os

from kernel.errors import InvalidRequest
from kernel.notebook import receipt
from kernel.notebook.fresh import SKIP_TAGS, Cell, FreshRun, Limits, Refused, source_digest


def run_request(data, settings):
    """The answer to a checked request body `data`; InvalidRequest for bad input."""
    cells, ids = [], set()
    for n, cell in enumerate(data["cells"]):
        if cell["id"] in ids:
            raise InvalidRequest(f"two cells have the id {cell['id']!r}")
        ids.add(cell["id"])
        cells.append(Cell(index=n, id=cell["id"], source=cell["source"],
                          skip=bool(set(cell.get("tags") or []) & set(SKIP_TAGS))))
    cwd = data.get("cwd")
    if cwd is not None and not os.path.isabs(cwd):
        raise InvalidRequest("cwd must be an absolute path on the server")
    try:
        limits = Limits.of(settings, data.get("timeout"), data.get("cell_timeout"))
    except Refused as exc:
        raise InvalidRequest(str(exc)) from None
    run = FreshRun(cells, settings, limits, variables=data.get("env") or [], cwd=cwd,
                   expected_environment=data.get("expected_environment")).run()
    if run.category == "BAD_INPUT":
        raise InvalidRequest(run.message)
    return {
        "notebook": data["notebook"],
        "order": [c.id for c in cells if c.status in ("ran", "failed")],
        "diagnostics": [],
        "cells": [{"id": c.id, "key": None, "status": c.status, "took_s": c.seconds,
                   "outputs": c.outputs, "error": c.error,
                   "execution_count": c.execution_count, "state_name": None}
                  for c in cells],
        "state_name": None,
        "receipt": receipt.build(run, {"path": None, "sha256": source_digest(cells)},
                                 cwd=cwd),
    }
