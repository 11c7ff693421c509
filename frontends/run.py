"""The `run` command: run an .ipynb file and write it back executed.

Three ways, one loop: incrementally here (a registry of our own on the
store, which must be free), incrementally through a server that holds the
store (`--server`, its POST /notebooks/run streamed), or fresh (`--fresh`:
no store, a receipt). In each, the work goes on in a thread while this one
shows each cell's progress as it comes, and a Ctrl-C here interrupts the
running cell and ends the run.
"""

import dataclasses
import os
import sys
import threading
import time

from tqdm import tqdm

from snapkernel.kernel.errors import InvalidRequest, Refused
from snapkernel.kernel.notebook.model import CellStatus, NotebookCell, NotebookRequest, NotebookRun
from snapkernel.kernel.relay import ERROR, EVENT, Relay

# Exit statuses of `main.py run`.
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _prog(args):
    """The command as invoked, for messages (`snapshot-kernel run`, `main.py run`)."""
    return f"{getattr(args, 'prog', 'main.py')} run"


def run(args, settings):
    """Run the notebook as the parsed command line `args` says; the exit status."""
    from snapkernel.kernel.notebook import ipynb  # nbformat: only for .ipynb files
    from snapkernel.kernel import files
    if args.fresh is not None:
        return _run_fresh(args, settings)
    output = args.output or args.notebook
    try:
        _, notebook = ipynb.read(args.notebook)
        # Checked before any cell runs: a run whose notebook cannot be written is not run.
        problem = files.unwritable(output, "output")
        if problem:
            raise Refused("BAD_INPUT", problem)
        if args.cwd and not args.server and not os.path.isdir(args.cwd):
            raise Refused("BAD_INPUT", f"--cwd {args.cwd} is not a folder")
        notebook = ipynb.inject(notebook, args.parameters)
        # The cells run in the notebook's folder, as in Jupyter.
        folder = os.path.abspath(args.cwd or os.path.dirname(os.path.abspath(args.notebook)))
        request = NotebookRequest(os.path.abspath(args.notebook), ipynb.code_cells(notebook),
                                  order=args.order, rerun=args.rerun,
                                  exec_id=f"run-{os.getpid()}-{os.urandom(4).hex()}",
                                  cwd=folder, allow_errors=args.allow_errors,
                                  parameters=args.parameters or None, timeout=args.timeout,
                                  cell_timeout=args.cell_timeout)
        progress = Progress(len(request.cells), request.cells)
        if args.server:
            record = _through_server(args, request, progress)
        else:
            record = _here(args, settings, request, progress)
        progress.done(record)
        ipynb.write(ipynb.executed(notebook, _by_index(record, request),
                                   record.language_info), output)
    except (Refused, ipynb.NotebookFileError) as exc:
        print(f"{_prog(args)}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:
        print(f"{_prog(args)}: error: cannot write the notebook {output}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"wrote {output}", file=sys.stderr)
    fine = {CellStatus.RAN, CellStatus.REUSED, CellStatus.FAILED_AS_EXPECTED}
    if args.allow_errors:
        fine.add(CellStatus.FAILED)
    return EXIT_OK if all(c.status in fine for c in record.cells) else EXIT_FAILED


def _by_index(record, request):
    """The record's cells with the notebook positions of the request's cells."""
    index = {c.id: c.index for c in request.cells}
    return [dataclasses.replace(c, index=index[c.id]) for c in record.cells]


def _here(args, settings, request, progress):
    """Run the notebook with a registry in this process, on the store (which must be
    free); the run's NotebookRun."""
    from snapkernel.kernel.notebook.incremental import NotebookRunner
    from snapkernel.kernel.server.registry import Registry
    from snapkernel.storage.store import StoreError, StoreHeld, claim_store
    data_dir = settings["server.data_dir"]
    try:
        lock = claim_store(data_dir, f"`{_prog(args)} {args.notebook}` (pid {os.getpid()})")
    except StoreHeld as exc:
        raise Refused("BAD_INPUT", f"{exc}. Run through it with --server URL (its token in "
                      f"--token or SNAPSHOT_KERNEL_TOKEN), or stop it first") from None
    except StoreError as exc:
        raise Refused("BAD_INPUT", str(exc)) from None
    try:
        try:
            registry = Registry(settings)
        except StoreError as exc:
            raise Refused("BAD_INPUT", str(exc)) from None
        try:
            runner = NotebookRunner(registry)
            return drive(lambda on_cell: runner.run(request, on_cell),
                         lambda: runner.interrupt(request.exec_id), progress)
        except InvalidRequest as exc:
            raise Refused("BAD_INPUT", str(exc)) from None
        finally:
            registry.close()
    finally:
        lock.close()


def _through_server(args, request, progress):
    """Run the notebook through the server at --server (POST /notebooks/run, its
    cells' progress streamed); the run's NotebookRun."""
    from snapkernel.api.client import Client, ServerError
    try:
        # The run's requests stay on one server of a fleet (docs/fleet.md).
        client = Client(args.server, args.token, timeout=60, affinity=request.notebook)
    except ValueError as exc:
        raise Refused("BAD_INPUT", f"--server: {exc}") from None

    def start(on_cell):
        """The run's request; its cells' events go to `on_cell`."""
        for event in client.run_notebook(request.to_json()):
            if event["type"] == "cell":
                on_cell(NotebookCell.from_json(event["cell"]))
            elif event["type"] == "answer":
                return NotebookRun.from_json(event["answer"])
        raise ServerError(f"the server at {args.server} ended the run's answer early",
                          "ServerUnreachable")

    try:
        return drive(start, lambda: client.interrupt(request.exec_id), progress)
    except ServerError as exc:
        if exc.status is None:  # the client's message names the server
            raise Refused("BAD_INPUT", str(exc)) from None
        raise Refused("BAD_INPUT", f"the server answered {exc.status}: {exc}") from None


def _run_fresh(args, settings):
    """`run --fresh`: the run without a server or store; the exit status."""
    from snapkernel.kernel.notebook import fresh_file
    progress = Progress(None)
    cancel = threading.Event()
    try:
        run_, receipt = drive(
            lambda on_cell: fresh_file.run_file(args.notebook, args.output, args.fresh,
                                                settings, adopt_orphans=True,
                                                on_cell=on_cell, cancel=cancel,
                                                parameters=args.parameters or None),
            cancel.set, progress)
    except Refused as exc:
        print(f"{_prog(args)}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:
        print(f"{_prog(args)}: error: cannot write the receipt {args.fresh.receipt}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    counts = receipt["counts"]
    progress.note(f"{'passed' if receipt['success'] else 'FAILED ' + receipt['category']}: "
                  f"{counts['completed']} cell(s) ran, {counts['failed']} failed, "
                  f"{counts['skipped']} skipped, in {receipt['seconds']:.2f} s. "
                  f"{receipt['message']}")
    if receipt["success"] and args.output is None:
        progress.note("no notebook written: -o names where the executed one goes")
    return fresh_exit_status(run_)


def fresh_exit_status(run):
    """The exit status of a finished fresh run (kernel.notebook.fresh.FreshRun)."""
    from snapkernel.kernel.notebook.fresh_file import REFUSALS
    if run.success:
        return EXIT_OK
    return EXIT_BAD_INPUT if run.category in REFUSALS else EXIT_FAILED


def drive(start, interrupt, progress):
    """Run `start(on_cell)` in a thread and return what it returns, showing each cell
    it reports as it comes; a Ctrl-C here calls `interrupt()` (again for each)."""
    work = Relay(start, "run")
    while True:
        try:
            kind, value = work.next()
        except KeyboardInterrupt:
            progress.note("interrupting the run (the running cell gets KeyboardInterrupt)")
            interrupt()
            continue
        if kind == EVENT:
            progress.cell(value)
        elif kind == ERROR:
            raise value
        else:
            return value


class Progress:
    """Progress on stderr: a bar on a terminal, a line per finished cell otherwise."""

    def __init__(self, total, cells=()):
        """For a notebook of `total` code cells (None: not known yet), the request's
        `cells` (model.NotebookCell) giving their positions."""
        self.total = total
        self.numbers = {c.id: c.index + 1 for c in cells}
        self.started = time.monotonic()
        self.bar = tqdm(total=total, unit="cell", file=sys.stderr, dynamic_ncols=True,
                        leave=False) if sys.stderr.isatty() else None

    def cell(self, cell):
        """A cell's status changed (a model.NotebookCell)."""
        if cell.status == CellStatus.PENDING:
            return
        if cell.status == CellStatus.RUNNING:
            if self.bar is not None:
                self.bar.set_postfix_str(f"{self.name(cell)}: running", refresh=True)
            return
        line = f"{self.name(cell)}: {cell.status}"
        if cell.status in (CellStatus.RAN, CellStatus.FAILED, CellStatus.FAILED_AS_EXPECTED):
            line += f" in {cell.took_s:.2f} s"
        if cell.status != CellStatus.RAN and cell.error:
            line += f" ({cell.error['ename']}: {cell.error['evalue'][:80]})"
        if cell.reason:  # why it ran, or what its reused result cannot know
            line += f"; {cell.reason['message']}"
        if self.bar is None:
            print(line, file=sys.stderr, flush=True)
            return
        self.bar.update(1)
        if cell.status in (CellStatus.FAILED, CellStatus.BLOCKED):
            self.bar.write(line, file=sys.stderr)
        self.bar.set_postfix_str(line[:60], refresh=True)

    def name(self, cell):
        """How a progress line names a cell: its number in the notebook (all cells
        counted, from 1, as papermill's bar counts them) and its id."""
        number = self.numbers.get(cell.id, cell.index + 1)
        return f"cell {number} ({cell.id})"

    def note(self, text):
        """A message between progress lines."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def done(self, record):
        """The summary line of an incremental run (a NotebookRun)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        counts = {}
        for cell in record.cells:
            counts[cell.status] = counts.get(cell.status, 0) + 1
        for d in record.diagnostics:
            self.note(d["message"])
        text = ", ".join(f"{n} {status}" for status, n in counts.items())
        self.note(f"{len(record.cells)} code cells: {text or 'none'} "
                  f"({time.monotonic() - self.started:.2f} s)")
