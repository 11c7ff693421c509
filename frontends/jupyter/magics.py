"""The kernel's own magics: they move a session's head and run in the kernel, not in a worker.

    %states              the session's lineage, newest first
    %undo [N]            the head goes back N cells (default 1)
    %checkout CELL|NAME  the head goes to the state of cell CELL, or to the state NAME
    %branch NAME         a new session from the head, and switch to it
    %session [NAME]      switch to session NAME (new if unknown); alone, list the sessions

A cell holds either only these magics (one per line) or none of them: its
other lines would run in a worker, after or before a head that moved.
"""

import re

from snapkernel.frontends.jupyter.sessions import INITIAL

NAMES = ("states", "undo", "checkout", "branch", "session")
_LINE = re.compile(r"%(" + "|".join(NAMES) + r")(?:\s+(.*))?$")


class UsageError(Exception):
    """A kernel magic used the wrong way (shown to the user as IPython's UsageError)."""


def parse(code):
    """[(magic, argument)] when the cell is made of kernel magics, None when it has none."""
    lines = [line.strip() for line in code.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    calls = [_LINE.match(line) for line in lines]
    if not any(calls):
        return None
    if not all(calls):
        names = ", ".join(f"%{m.group(1)}" for m in calls if m)
        raise UsageError(f"{names}: a cell of kernel magics holds nothing else (other code "
                         f"runs in a worker, the kernel's magics in the kernel); put the "
                         f"code in a cell of its own")
    return [(m.group(1), (m.group(2) or "").strip()) for m in calls]


class Magics:
    """Runs kernel magics on the sessions of a backend."""

    def __init__(self, sessions, describe):
        """`sessions`: a Sessions store; `describe(name)`: GET /states/NAME or None."""
        self.sessions = sessions
        self.describe = describe

    def run(self, current, magic, argument):
        """Run one magic in session `current`: (text to show, session name now current)."""
        return getattr(self, "_" + magic)(current, argument)

    def _states(self, current, argument):
        """The lineage, newest first: cell, time, variables, first line."""
        if argument:
            raise UsageError("%states takes no argument")
        session = self.sessions.load(current)
        rows = []
        for r in session.lineage():
            described = self.describe(r["state"])
            size = "gone" if described is None else str(len(described["variables"]))
            rows.append((str(r["n"]), r["time"], size, r["line"]))
        origin = session.lineage()[-1]["parent"] if rows else session.head
        rows.append(("", "", "", f"({_describe_origin(origin)})"))
        header = ("cell", "time", "vars", "first line")
        widths = [max(len(row[i]) for row in rows + [header]) for i in range(3)]
        lines = [f"{header[0]:>{widths[0]}}  {header[1]:<{widths[1]}}  "
                 f"{header[2]:>{widths[2]}}  {header[3]}"]
        lines += [f"{a:>{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}"
                  for a, b, c, d in rows]
        return f"session {current!r}, newest first:\n" + "\n".join(lines) + "\n", current

    def _undo(self, current, argument):
        """Move the head back N cells along the lineage."""
        try:
            steps = int(argument or "1")
        except ValueError:
            raise UsageError(f"%undo takes a number of cells, not {argument!r}") from None
        if steps < 1:
            raise UsageError(f"%undo takes a number of cells, 1 or more, not {steps}")
        with self.sessions.change(current) as session:
            lineage = session.lineage()
            if steps > len(lineage):
                raise UsageError(f"cannot undo {steps} cell(s): the head has "
                                 f"{len(lineage)} cell(s) of this session behind it "
                                 f"(%states lists them)")
            session.head = lineage[steps - 1]["parent"]
        return f"head: {self.where(current)}\n", current

    def _checkout(self, current, argument):
        """Move the head to a cell's state or to any state by name."""
        if not argument:
            raise UsageError("%checkout takes a cell number or a state name")
        session = self.sessions.load(current)
        record = session.cell(int(argument)) if argument.isdigit() else None
        target = record["state"] if record else argument
        if self.describe(target) is None:
            if argument.isdigit() and record is None:
                raise UsageError(f"cell {argument} of session {current!r} made no state, "
                                 f"and no state is named {argument!r}")
            raise UsageError(f"no state named {target!r} on the server: %states lists "
                             f"this session's cells, %checkout N goes to cell N")
        with self.sessions.change(current) as session:
            session.head = target
        return f"head: {self.where(current)}\n", current

    def _branch(self, current, argument):
        """A new session whose lineage is the current head's; it becomes current."""
        if not argument:
            raise UsageError("%branch takes the new session's name")
        if self.sessions.exists(argument):
            raise UsageError(f"session {argument!r} exists; %session {argument} switches to it")
        source = self.sessions.load(current)
        with self.sessions.change(argument) as branch:
            branch.head, branch.next = source.head, source.next
            self.sessions.copy(branch, list(reversed(source.lineage())))
        return (f"new session {argument!r} from the head of {current!r} "
                f"({self.where(argument)}); %session {current} goes back\n", argument)

    def _session(self, current, argument):
        """Switch sessions, or list them."""
        if not argument:
            others = [n for n in self.sessions.names() if n != current]
            listing = "".join(f"  {n}\n" for n in others) or "  (none)\n"
            return (f"session {current!r}, head: {self.where(current)}\n"
                    f"other sessions:\n{listing}"), current
        if self.sessions.exists(argument):
            return f"session {argument!r}, head: {self.where(argument)}\n", argument
        with self.sessions.change(argument):
            pass
        return f"new session {argument!r} (empty)\n", argument

    def where(self, name):
        """Where a session's head is, in words."""
        session = self.sessions.load(name)
        lineage = session.lineage()
        if lineage:
            return f"cell {lineage[0]['n']} ({lineage[0]['line'][:60]})"
        return _describe_origin(session.head)


def _describe_origin(state):
    """A state that no cell of the session made."""
    return "the empty state" if state == INITIAL else f"state {state!r}"
