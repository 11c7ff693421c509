"""Every message between the server and its worker processes, and the execute answer.

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
    the store when run from again.
    """
    code: str
    new_name: str
    auto_named: bool
    exec_id: str | None = None
    stream: bool = False
    keep_live: bool = True

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
    ours (`execution_count`, `volatile_symbols`).
    """
    output: list = field(default_factory=list)
    state_name: str | None = None
    error: dict | None = None
    accessed_symbols: list = field(default_factory=list)
    modified_symbols: list = field(default_factory=list)
    deleted_symbols: list = field(default_factory=list)
    execution_count: int | None = None
    volatile_symbols: list = field(default_factory=list)

    @classmethod
    def failed(cls, error, execution_count=None):
        """An answer carrying only an error."""
        return cls(error=error, execution_count=execution_count)

    def to_json(self):
        """The answer as the HTTP layer sends it."""
        return dataclasses.asdict(self)


class CellResult(NamedTuple):
    """The end of an Execute or Multistate request; `manifest` when a state was stored."""
    answer: ExecuteAnswer
    manifest: dict | None = None


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


def error(ename, evalue, traceback=None):
    """An nbformat error dict {ename, evalue, traceback}."""
    return {"ename": ename, "evalue": evalue,
            "traceback": [f"{ename}: {evalue}"] if traceback is None else traceback}
