"""Every message between the server and its worker processes, and the execute answer.

The notebook-run model (requests, cells, records) is kernel/notebook/model.py.

Both sides import this module and nothing else defines a message. A message
is a typed NamedTuple, immutable, sent whole over a worker's channel
(kernel/channel.py pickles it: both ends are our own processes). NamedTuple,
not a frozen dataclass: every server start makes these classes, 15 frozen
dataclasses in about 9 ms, NamedTuples in about 1.5 ms. docs/architecture.md
shows who sends which, in what order.

A worker's first message on its channel is a `Hello` naming its role:

- `ZYGOTE`: a zygote (`warm` once it has imported what cells commonly use);
  the server sends it `Spawn` to fork a holder that restores a state.
- `HOLDER`: the idle process of one live state. Restored by a zygote, it
  names the `Spawn` request (`req`) and then says `Ready` or `Failed`;
  forked by the child whose cell made the state, it has no `req`. The
  server sends it `Fork` for each spare child it wants.
- `SPARE`: a child forked by a holder, waiting for one request
  (`Execute`, `Multistate`, `Rebuild`). While it runs it may send `Phase`
  and, for a streamed request, `Output`; it ends with one `CellResult` or
  `RebuildResult`. A child whose request made a state stays connected as
  that state's first spare and takes the next request on the same channel.

Any worker may send `Exited` (a child of its own ended) and `Log`.
"""

import dataclasses
import json
from dataclasses import dataclass, field
from typing import NamedTuple

ZYGOTE, HOLDER, SPARE = "zygote", "holder", "spare"


class Hello(NamedTuple):
    """A worker introduces itself, first thing on its channel."""
    role: str
    pid: int
    warm: bool = False  # ZYGOTE: its holders' cells start with the common imports done
    req: int | None = None  # HOLDER restored by a zygote: the Spawn it answers
    state_id: str | None = None  # HOLDER: its state; SPARE: its holder's state


# Server -> zygote, holder ----------------------------------------------------------

class Spawn(NamedTuple):
    """Zygote: fork a holder restoring the state of `manifest`."""
    req: int
    manifest: dict


class Fork(NamedTuple):
    """Holder: fork one more spare child; `now` False: a replacement for a spare just
    taken, which a holder still loading its state forks once it is loaded (so that it
    holds the whole state, not a part its next cell might load again)."""
    now: bool = True


# Server -> spare child: the requests ------------------------------------------------

class Execute(NamedTuple):
    """Run `code`; on success store the new state as `new_name`.

    `keep_live` False: the new state gets no holder; the child that made it
    stays as its only process, for the next cell (a notebook run's
    intermediate state), and once that is taken the state is restored from
    the store when run from again. `home`: the notebook's folder; a state
    whose lineage started elsewhere (or nowhere) moves there first (the cell
    runs in it unless an earlier cell of the lineage chose another folder).
    `fresh_imports` (notebook runs): a module of the user's files that
    changed since this process imported it is imported anew by the cell, as
    in a clean Run All (a live kernel would keep the old one).
    `keep_on_error` (notebook runs that go on past a failing cell): a cell
    that raises still stores its state, what it did before it raised, as a
    live kernel keeps it; the answer carries the error and the state.
    `input_holder` False (set by the server, see Pool.take_child): the child
    that made the input state, which has not forked that state's holder yet,
    runs this cell without forking it: a step of a chain, whose input state
    is then restored from the store when run from again.
    `message_id` (the Jupyter kernel): the id of the front end's message the
    cell answers (an execute_request, or a comm_msg from a widget), which the
    cell's process gives as its parent's (ipywidgets' Output captures by it:
    kernel/worker/capture/comms.py).
    `execution_key` (with an exec_id): recorded with the new state and its answer
    (storage/snapshot.py record_execution), so a retry is answered from the store.
    `execution_count` (the Jupyter kernel): the cell's In[N], its tracebacks' and
    its state's count; None: the input state's count + 1.
    """
    code: str
    new_name: str
    auto_named: bool
    exec_id: str | None = None
    stream: bool = False
    keep_live: bool = True
    home: str | None = None
    fresh_imports: bool = False
    keep_on_error: bool = False
    input_holder: bool = True
    message_id: str | None = None
    execution_key: str | None = None
    execution_count: int | None = None

    def failed(self, error):
        """The result that reports `error` for this request."""
        return CellResult(ExecuteAnswer.failed(error))


class Multistate(NamedTuple):
    """Run `code` with the states of `aliases` ({alias: manifest}) as namespaces; store nothing."""
    code: str
    aliases: dict
    exec_id: str | None = None
    stream: bool = False

    def failed(self, error):
        """The result that reports `error` for this request."""
        return CellResult(ExecuteAnswer.failed(error))


class Rebuild(NamedTuple):
    """Make `new_name` of `source_vars` from `source_manifest` and `input_vars` from this state."""
    source_manifest: dict
    source_vars: list
    input_vars: list
    new_name: str
    auto_named: bool
    exec_id: str | None = None
    stream: bool = False

    def failed(self, error):
        """The result that reports `error` for this request."""
        return RebuildResult(error=error)


# Worker -> server -----------------------------------------------------------------

class Ready(NamedTuple):
    """A restored holder has its state's manifest checked and serves."""
    state_id: str


class Failed(NamedTuple):
    """A restored holder cannot serve its state (`ename`: e.g. IncompatibleState)."""
    ename: str
    evalue: str


class Phase(NamedTuple):
    """The child moved on from running the cell (`phase`: "saving")."""
    phase: str


class Output(NamedTuple):
    """One output item of a streamed request, as the cell produced it.

    `item` is a line of the NDJSON answer: {"type": "output", "output": {...}}
    or {"type": "clear_output", "wait": bool}.
    """
    item: dict


@dataclass
class ExecuteAnswer:
    """The answer of /execute and /multistate_execute, built here and nowhere else.

    Its fields are the JSON answer's keys, in the reference's order plus
    ours (`execution_count`, `volatile_symbols`, `files_read`, `files_written`,
    `inert_symbols`).
    """
    output: list = field(default_factory=list)
    state_name: str | None = None
    error: dict | None = None
    accessed_symbols: list = field(default_factory=list)
    modified_symbols: list = field(default_factory=list)
    deleted_symbols: list = field(default_factory=list)
    execution_count: int | None = None
    volatile_symbols: list = field(default_factory=list)
    # The files the cell opened (kernel/worker/opened.py): absolute paths, sorted.
    files_read: list = field(default_factory=list)
    files_written: list = field(default_factory=list)
    # Variables holding open files, sockets, processes... that a restore gives back
    # closed (storage/handles.py).
    inert_symbols: list = field(default_factory=list)

    @classmethod
    def failed(cls, error, execution_count=None):
        """An answer carrying only an error."""
        return cls(error=error, execution_count=execution_count)

    def to_json(self):
        """The answer as the HTTP layer sends it."""
        return dataclasses.asdict(self)


class CellResult(NamedTuple):
    """The end of an Execute or Multistate request; `manifest` when a state was stored.
    `holder` False: the new state gets no holder, whatever the request asked (the
    cell left threads a fork would lose: kernel/worker/process.py threads_lost_on_fork);
    the child that made it is its only process, as with Execute.keep_live False."""
    answer: ExecuteAnswer
    manifest: dict | None = None
    holder: bool = True


class RebuildResult(NamedTuple):
    """The end of a Rebuild request: the new state's manifest, or an error."""
    manifest: dict | None = None
    error: dict | None = None


class Exited(NamedTuple):
    """A child process of the sender ended (`text`: the signal or exit code, in words)."""
    pid: int
    text: str
    code: int


class Log(NamedTuple):
    """A line for the server's log."""
    text: str


# Comm messages from a front end (the Jupyter kernel's comm_open, comm_msg, comm_close)
# reach the state's process as a cell of this one call: handled there, they make a new
# state as any cell does (kernel/worker/capture/comms.py `deliver`).
COMM_MESSAGES = ("comm_open", "comm_msg", "comm_close")


def comm_cell(msg_type, content, metadata=None, buffers=()):
    """The code of the cell that hands one front-end comm message to the state's
    process (`buffers`: base64 strings)."""
    if msg_type not in COMM_MESSAGES:
        raise ValueError(f"not a comm message: {msg_type!r}")
    message = json.dumps({"content": content, "metadata": metadata or {},
                          "buffers": list(buffers)})
    return (f"__import__('snapkernel.kernel.worker.capture.comms', fromlist=['deliver'])"
            f".deliver({msg_type!r}, {message!r})\n")


def error(ename, evalue, traceback=None):
    """An nbformat error dict {ename, evalue, traceback}."""
    return {"ename": ename, "evalue": evalue,
            "traceback": [f"{ename}: {evalue}"] if traceback is None else traceback}
