"""The notebook-run model: the request, a cell, the run's record.

One model for incremental runs (kernel/notebook/incremental.py), fresh runs
(kernel/notebook/fresh.py), the `run` command, POST /notebooks/run and the
stored records. `to_json()` is the one JSON form of each, `from_json()` the
one reader of it.
"""

import dataclasses
import datetime
import enum
import math
import re
from dataclasses import dataclass, field

from snapkernel.kernel.errors import InvalidRequest


class CellStatus(enum.StrEnum):
    """What became of a cell in a notebook run (a str: it is its JSON form)."""
    PENDING = "pending"    # only while the run goes on
    RUNNING = "running"    # only while the run goes on
    RAN = "ran"
    REUSED = "reused"      # its stored result stands; incremental runs only
    FAILED = "failed"
    FAILED_AS_EXPECTED = "failed_as_expected"  # tagged raises-exception, and raised
    BLOCKED = "blocked"    # a static error, or a cell it needs failed
    NOT_RUN = "not_run"    # the run stopped before it
    SKIPPED = "skipped"    # tagged no-execute or skip-execution; fresh runs only
    EMPTY = "empty"        # nothing but blank lines and comments; fresh runs only


# The statuses a fresh run's receipt may give a cell.
FRESH_STATUSES = (CellStatus.RAN, CellStatus.FAILED, CellStatus.SKIPPED, CellStatus.EMPTY,
                  CellStatus.NOT_RUN)
# A cell with one of these holds a stored result (its outputs live there).
WITH_RESULT = (CellStatus.RAN, CellStatus.REUSED, CellStatus.FAILED_AS_EXPECTED)
ORDERS = ("notebook", "dataflow")
# What GET /states?kind= lists: every state (the default), the user's, notebook runs'.
STATE_KINDS = ("all", "user", "notebook")
# A notebook run names the state of each cell's result by the cell's key (SHA-256, hex).
NOTEBOOK_STATE_PREFIX = "nb-"
_NOTEBOOK_STATE = re.compile(f"{NOTEBOOK_STATE_PREFIX}[0-9a-f]{{64}}")


def is_notebook_state(name):
    """True for the name of a state a notebook run made (nb-KEY)."""
    return _NOTEBOOK_STATE.fullmatch(name) is not None
# Tags that make a fresh run skip a cell, as nbclient's users tag them.
SKIP_TAGS = ("no-execute", "skip-execution")
# The tag of a cell that may raise without stopping a run (nbclient's, papermill's).
RAISES_TAG = "raises-exception"
# The metadata of a FreshOptions field that only the command takes, and of one that
# incremental runs take too.
COMMAND_ONLY = {"command_only": True}
SHARED = {"shared": True}


def now():
    """The current UTC time, ISO 8601 (a record's `started` and `finished`)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def timing_stamp():
    """The current UTC time as nbclient's cell timings write it
    (2024-05-01T12:00:00.123456Z)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def timings(busy, idle):
    """A cell's metadata.execution, nbclient's record_timing keys: `busy` when the cell
    was handed to its process (iopub.status.busy, iopub.execute_input), `idle` when it
    answered (shell.execute_reply, iopub.status.idle)."""
    return {"iopub.status.busy": busy, "iopub.execute_input": busy,
            "shell.execute_reply": idle, "iopub.status.idle": idle}


@dataclass
class NotebookCell:
    """One code cell of a notebook run: what was asked, then what became of it.

    `source`, `index` (its position among all the notebook's cells) and
    `tags` are the request's; `category` is a fresh run's failure category.
    None of these four is in the JSON form.
    """
    id: str
    key: str | None = None
    status: CellStatus = CellStatus.PENDING
    took_s: float | None = None
    outputs: list = field(default_factory=list)
    error: dict | None = None
    execution_count: int | None = None
    state_name: str | None = None
    # nbclient's record_timing keys ({"iopub.status.busy": ISO time, ...}) of the run that
    # made the cell's result (for a reused cell, the run that stored it).
    execution: dict | None = None
    # Why the cell ran ({"kind", "message"}: incremental.REASONS), or, for a reused cell,
    # what its stored result cannot know (it reads the clock, an unseeded generator).
    reason: dict | None = None
    source: str = field(default="", repr=False)
    index: int = 0
    tags: tuple = ()
    category: str | None = None

    @property
    def skip(self):
        """True when the cell is tagged to be skipped (fresh runs honour it)."""
        return bool(set(self.tags) & set(SKIP_TAGS))

    @property
    def may_raise(self):
        """True when the cell is tagged raises-exception: an incremental run goes on
        past its error (a fresh run does not)."""
        return RAISES_TAG in self.tags

    def to_json(self):
        """The cell as answers and records show it."""
        return {f: getattr(self, f) for f in CELL_FIELDS}

    @classmethod
    def from_json(cls, data):
        """A cell from its JSON form (a stored record's cells may lack `outputs`)."""
        return cls(**{f: data[f] for f in CELL_FIELDS if f in data})


# The fields of a cell's JSON form.
CELL_FIELDS = ("id", "key", "status", "took_s", "outputs", "error", "execution_count",
               "state_name", "execution", "reason")


@dataclass
class FreshOptions:
    """How a fresh run is run: the options only a fresh run takes.

    Those marked `COMMAND_ONLY` name files on the caller's side and are the
    `run --fresh` command's alone; the others POST /notebooks/run takes too.
    """
    # The whole run's deadline and one cell's, s; 0 = none (fresh.timeout_s and
    # fresh.cell_timeout_s). Incremental runs take them too (NotebookRequest).
    timeout: float | None = field(default=None, metadata=SHARED)
    cell_timeout: float | None = field(default=None, metadata=SHARED)
    env: list = field(default_factory=list)  # names passed from the caller's environment
    cwd: str | None = field(default=None, metadata=SHARED)  # the cells' working directory
    expected_environment: str | None = None  # the environment SHA-256 the kernel must have
    receipt: str | None = field(default=None, metadata=COMMAND_ONLY)  # where it goes
    lock: str | None = field(default=None, metadata=COMMAND_ONLY)  # a lock file to record
    overwrite: bool = field(default=False, metadata=COMMAND_ONLY)  # replace the output
    keep_states: str | None = field(default=None, metadata=COMMAND_ONLY)  # a store folder

    @classmethod
    def names(cls, command=True, shared=True):
        """The options' names (without `command`: only those the API takes too; without
        `shared`: only those incremental runs do not take)."""
        return [f.name for f in dataclasses.fields(cls)
                if (command or not f.metadata.get("command_only"))
                and (shared or not f.metadata.get("shared"))]


@dataclass
class NotebookRequest:
    """A run of a notebook's code cells: POST /notebooks/run's body, or the command's.

    `notebook` names it (the command: the file's absolute path); `cells`
    are NotebookCell with id, source, index and tags; `cwd` the notebook's
    folder, where the cells run (a fresh run takes it as `fresh.cwd`).
    `order`, `rerun` and `allow_errors` (go on past a failing cell, as
    nbclient's allow_errors does) are for incremental runs, as are `timeout`
    (the whole run's, s) and `cell_timeout` (one cell's, s; 0 or None: none
    but limits.cell_timeout_s); `fresh` (FreshOptions, with timeouts of its
    own) makes it a fresh run. `parameters` ({name: value}, papermill's) go
    into a cell tagged injected-parameters (kernel/notebook/parameters.py).
    """
    notebook: str
    cells: list
    order: str = "notebook"
    rerun: list = field(default_factory=list)
    exec_id: str | None = None
    fresh: FreshOptions | None = None
    cwd: str | None = None
    allow_errors: bool = False
    parameters: dict | None = None
    timeout: float | None = None
    cell_timeout: float | None = None

    # Options an incremental run takes and a fresh run does not.
    INCREMENTAL_ONLY = ("order", "rerun", "exec_id", "allow_errors")

    def to_json(self):
        """The request as POST /notebooks/run's body (without `stream`, which is how the
        answer travels, not what is run). A cell's `index` is not sent: the server
        numbers the cells as they come."""
        data = {"notebook": self.notebook, "cwd": self.cwd, "parameters": self.parameters,
                "cells": [{"id": c.id, "source": c.source, "tags": list(c.tags)}
                          for c in self.cells]}
        if self.fresh is None:
            data.update({k: getattr(self, k)
                         for k in (*self.INCREMENTAL_ONLY, "timeout", "cell_timeout")})
        else:
            data["fresh"] = True
            data.update({k: getattr(self.fresh, k) for k in FreshOptions.names(command=False)
                         if k != "cwd"})
        return data

    @classmethod
    def from_json(cls, data):
        """The request of a POST /notebooks/run body that fits its schema (which the HTTP
        layer checks; it refuses the options of the other kind of run); InvalidRequest
        for cells that are not one notebook's (see check)."""
        fresh = None
        if data.get("fresh"):
            fresh = FreshOptions(**{k: data[k] for k in FreshOptions.names(command=False)
                                    if data.get(k) is not None})
        cells = [NotebookCell(id=c["id"], source=c["source"], index=n,
                              tags=tuple(c.get("tags") or ()))
                 for n, c in enumerate(data["cells"])]
        request = cls(data["notebook"], cells, order=data.get("order") or "notebook",
                      rerun=data.get("rerun") or [], exec_id=data.get("exec_id"),
                      fresh=fresh, cwd=data.get("cwd"),
                      allow_errors=bool(data.get("allow_errors")),
                      parameters=data.get("parameters") or None,
                      timeout=None if fresh else data.get("timeout"),
                      cell_timeout=None if fresh else data.get("cell_timeout"))
        request.check()
        return request

    def check(self):
        """InvalidRequest unless the cells are one notebook's (each with an id of its own
        and a source), an incremental run's timeouts are seconds and its order and
        reruns name what there is, and the parameters are papermill's
        (kernel/notebook/parameters.py). The runners check each request they take:
        the command builds its own."""
        for name in ("timeout", "cell_timeout"):  # a fresh run's are its FreshOptions'
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0 or
                                      (name == "timeout" and value == 0)):
                raise InvalidRequest(f"{name} must be a number of seconds, "
                                     f"{'0 (none) or more' if name == 'cell_timeout' else 'more than 0'}, "
                                     f"not {value}")
        if self.fresh is None and self.order not in ORDERS:
            raise InvalidRequest(f"unknown order {self.order!r}: use "
                                 f"{' or '.join(repr(o) for o in ORDERS)}")
        seen = set()
        for n, cell in enumerate(self.cells):
            if not isinstance(cell.id, str) or not cell.id:
                raise InvalidRequest(f"cells[{n}] needs an id (a non-empty string)")
            if not isinstance(cell.source, str):
                raise InvalidRequest(f"cell {cell.id!r} needs a source (a string)")
            if cell.id in seen:
                raise InvalidRequest(f"cell id {cell.id!r} appears more than once")
            seen.add(cell.id)
        unknown = [r for r in self.rerun if r not in seen]
        if unknown:
            raise InvalidRequest(f"rerun names cell(s) not in the notebook: "
                                 f"{', '.join(repr(u) for u in unknown)}")
        if self.parameters is not None:
            # Imported here: parameters.py makes cells of this model.
            from snapkernel.kernel.notebook import parameters
            try:
                parameters.check(self.parameters)
            except parameters.ParameterError as exc:
                raise InvalidRequest(str(exc)) from None


@dataclass
class NotebookRun:
    """A notebook run's record: the answer of POST /notebooks/run and of GET
    /notebooks/NAME, and what the store keeps of the last run."""
    notebook: str
    cells: list  # NotebookCell
    order_kind: str = "notebook"
    exec_id: str | None = None
    running: bool = True
    started: str = field(default_factory=now)
    finished: str | None = None
    order: list = field(default_factory=list)  # cell ids, in the order the run took them
    diagnostics: list = field(default_factory=list)
    state_name: str | None = None
    # The metadata.language_info of the interpreter that ran the cells (ipykernel's).
    language_info: dict | None = None
    receipt: dict | None = None  # a fresh run's

    def to_json(self):
        """The record as answers show it (a fresh run's adds its receipt)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["cells"] = [c.to_json() for c in self.cells]
        if self.receipt is None:
            del data["receipt"]
        return data

    def stored_form(self):
        """The record as the store keeps it: a cell with a stored result leaves its
        outputs to that result."""
        data = self.to_json()
        for cell in data["cells"]:
            if cell["status"] in WITH_RESULT:
                del cell["outputs"]
        return data

    @classmethod
    def from_json(cls, data):
        """A record from its JSON form (or its stored form)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**dict({k: v for k, v in data.items() if k in fields},
                          cells=[NotebookCell.from_json(c) for c in data["cells"]]))

    def copy(self):
        """A copy deep enough for its reader to keep while the run goes on (outputs are
        never changed in place)."""
        return dataclasses.replace(self, cells=[dataclasses.replace(c) for c in self.cells],
                                   order=list(self.order), diagnostics=list(self.diagnostics))
