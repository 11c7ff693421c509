"""Output capture for one cell: streams, displays and figures as nbformat v4 outputs.

The front door of the package; one module per concern, as in ipykernel:

- collector.py  the ordered outputs of a cell: stream merging, clear_output,
                display updates, size limits, streaming to a sink;
- streams.py    sys.stdout / sys.stderr proxies and fd-level capture; no stdin;
- bundles.py    MIME bundles made nbformat-valid, and cut to size;
- display.py    display() and formatting objects into MIME bundles;
- shell.py      the private IPython shell: magics, `!cmd`, cell events;
- figures.py    matplotlib figures as outputs (mpl_backend.py is the backend);
- libraries.py  pandas, matplotlib and IPython set up as soon as imported.

`capture(settings)` is the context manager the cell runner uses; everything
it changes (fds 1 and 2, `sys.stdout`, `sys.stderr`, builtins, getpass,
pandas options, the matplotlib backend) is put back when it exits.
"""

import builtins
import contextlib
import getpass
import sys

from snapkernel.kernel.worker.capture import collector, display, figures, libraries, shell, streams
from snapkernel.kernel.worker.capture.display import format_object
from snapkernel.kernel.worker.capture.libraries import watch_imports
from snapkernel.kernel.worker.capture.shell import post_run_events, pre_run_events

__all__ = ["capture", "finish_cell", "warm", "watch_imports", "format_object",
           "pre_run_events", "post_run_events"]


@contextlib.contextmanager
def capture(settings, execution_count=None, namespace=None, sink=None):
    """Capture everything a cell shows; yield the OutputCollector.

    `settings` is the worker's settings dict (kernel/config.py load()).
    Sets up fd and sys-level capture, `display` / `input` / `get_ipython`
    in builtins, pandas options and the inline matplotlib backend, and
    undoes all of it on exit (the worker may fork again right after).
    `sink`, if given, receives each output item as it is produced (see
    OutputCollector).
    """
    cell = collector.OutputCollector(settings, execution_count, sink)
    cell.namespace = namespace
    libraries.configure_pandas(settings)
    figures.prepare_matplotlib(settings)
    saved_sys = (sys.stdout, sys.stderr)
    saved_builtins = {k: builtins.__dict__[k] for k in ("display", "input", "get_ipython")
                      if k in builtins.__dict__}
    fds = None
    saved_getpass = None
    try:
        fds = streams.FdCapture(cell)
        cell.drain = fds.drain
        streams.STDOUT.fallback, streams.STDERR.fallback = saved_sys
        sys.stdout, sys.stderr = streams.STDOUT, streams.STDERR
        builtins.display = display.display
        builtins.input = streams.no_input
        saved_getpass = getpass.getpass
        getpass.getpass = streams.no_getpass
        collector.set_running(cell)
        existing = shell.existing_shell()
        if existing is not None:
            shell.lend_namespace(existing)
            builtins.get_ipython = existing.get_ipython
        else:
            builtins.get_ipython = shell.get_ipython
        yield cell
    finally:
        collector.set_running(None)
        if fds is not None:
            # Output written at the fd level after the last Python write still belongs here.
            collector.set_running(cell)
            fds.restore()
            collector.set_running(None)
        cell.flush()
        sys.stdout, sys.stderr = saved_sys
        if saved_getpass is not None:
            getpass.getpass = saved_getpass
        streams.STDOUT.fallback = streams.STDERR.fallback = None
        for name in ("display", "input", "get_ipython"):
            if name in saved_builtins:
                builtins.__dict__[name] = saved_builtins[name]
            else:
                builtins.__dict__.pop(name, None)
        shell.return_namespace()


def finish_cell(cell):
    """End of a cell, inside the capture: every open figure shown (then closed), helper
    threads stopped."""
    libraries.configure_pandas(cell.settings)
    try:
        figures.show_figures(close=True)
    finally:
        shell.stop_script_loop()


def warm():
    """Import and build what cells will need, once per process (call in the zygote)."""
    shell.get_shell()
    with contextlib.suppress(Exception):
        import matplotlib  # noqa: F401
        figures.prepare_matplotlib(None)
        # matplotlib's backend entry points (60 ms), read once here rather than in the
        # first cell that draws (prepare_matplotlib).
        from matplotlib.backends.registry import backend_registry
        backend_registry.list_all()
