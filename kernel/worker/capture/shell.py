"""The private IPython shell of a worker (ipykernel: zmqshell.py).

A quiet `InteractiveShell` gives cells Jupyter's magics, `!cmd`,
`get_ipython()`, the display formatter and IPython's cell events; its
display publisher feeds the running cell's collector. It is made once per
process, on first use: the zygote makes it while it warms up, a cold worker
when a cell first needs it. While a cell runs, the shell works on that
cell's namespace (lent by `lend_namespace`, given back by `return_namespace`).
"""

import builtins
import contextlib
import os
import sys
import threading

from snapkernel.kernel.worker.capture import collector, figures

# Called with (magic name, line) after each line magic a cell runs (kernel/worker/
# context.py keeps the ones that set IPython's state).
magic_listeners = []
# Called with the shell once it is made (kernel/worker/context.py notes its printers).
shell_listeners = []

_shell = None  # created on first use
_lent = None  # the shell's own (user_ns, user_module) while a cell's namespace is lent to it


def get_shell():
    """The private IPython shell, made on first use; inside a cell it works on the
    cell's namespace."""
    global _shell
    if _shell is None:
        import IPython  # noqa: F401  (the first import makes the shell itself: libraries.py)
        if _shell is None:
            _shell = _make_shell()
    lend_namespace(_shell)
    return _shell


def existing_shell():
    """The shell if this process made it already, else None."""
    return _shell


def lend_namespace(shell):
    """Point the shell at the running cell's namespace (given back when the capture ends)."""
    global _lent
    running = collector.running()
    if _lent is not None or running is None or running.namespace is None:
        return
    _lent = (shell.user_ns, shell.user_module)
    shell.user_ns = running.namespace
    main = sys.modules.get("__main__")
    if getattr(main, "__dict__", None) is running.namespace:
        shell.user_module = main


def return_namespace():
    """Give the shell its own namespace back at the end of a cell."""
    global _lent
    if _lent is not None:
        _shell.user_ns, _shell.user_module = _lent
        _lent = None


def get_ipython():
    """get_ipython() in a cell of a process that has no shell yet: make it now."""
    return get_shell()


def _make_shell():
    """Create a quiet InteractiveShell that publishes displays into our collector."""
    import atexit
    import subprocess
    from traitlets.config import Config
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    class CellDisplayPublisher(DisplayPublisher):
        """Publishes IPython displays into the running cell's outputs."""

        def publish(self, data, metadata=None, source=None, *, transient=None,
                    update=False, **kwargs):
            """Add one display (or update one by display id)."""
            collector.publish(data, metadata, transient=transient, update=update)

        def clear_output(self, wait=False):
            """IPython.display.clear_output()."""
            collector.clear_output(wait)

    class Shell(InteractiveShell):
        """IPython's shell, used only for magics, `!cmd` and display formatting."""

        def enable_matplotlib(self, gui=None):
            """%matplotlib: figures are always shown inline here."""
            figures.use_inline_backend()
            return "inline", figures.MPL_BACKEND

        def enable_pylab(self, gui=None, import_all=True, welcome_message=False):
            """%pylab: inline figures, numpy and pyplot names."""
            figures.use_inline_backend()
            exec("import numpy; import matplotlib; from matplotlib import pylab, mlab, pyplot\n"
                 "np = numpy\nplt = pyplot\n", self.user_ns)
            if import_all:
                exec("from pylab import *\nfrom numpy import *\n", self.user_ns)
            return "inline", figures.MPL_BACKEND, False

        def system(self, cmd):
            """!cmd: run in a shell; its output is captured at the fd level, stderr merged as in Jupyter."""
            cmd = self.var_expand(cmd, depth=1)
            sys.stdout.flush()
            subprocess.call(cmd, shell=True, executable=os.environ.get("SHELL") or "/bin/sh",
                            stderr=subprocess.STDOUT)

        system_piped = system

        def reset(self, new_session=True, aggressive=False):
            """%reset: forget the user's names; the namespace gets none of IPython's."""
            for name in list(self.user_ns):
                if not (name.startswith("__") and name.endswith("__")):
                    del self.user_ns[name]

        def showtraceback(self, *args, **kwargs):
            """A failing formatter (a broken __repr__) is the cell's error here, not a printout."""
            exc = sys.exc_info()[1]
            if exc is not None:
                raise exc

        def run_line_magic(self, magic_name, line, _stack_depth=1):
            """Run a line magic with IPython's directory history in place (for %cd)."""
            if magic_name == "config":
                _configure_inline_backend(self)
            with _hidden_names(self):
                result = super().run_line_magic(magic_name, line, _stack_depth + 1)
            for listener in magic_listeners:
                listener(magic_name, line)
            return result

        def run_cell_magic(self, magic_name, line, cell):
            """Run a cell magic with IPython's directory history in place."""
            with _hidden_names(self):
                return super().run_cell_magic(magic_name, line, cell)

    cfg = Config()
    cfg.HistoryManager.enabled = False
    main = sys.modules.get("__main__")
    saved_builtins = {k: builtins.__dict__[k] for k in ("display",) if k in builtins.__dict__}
    try:
        shell = Shell.instance(config=cfg, user_ns={}, display_pub_class=CellDisplayPublisher)
    finally:
        # The shell installs its own __main__ module; the worker's stays.
        if main is not None:
            sys.modules["__main__"] = main
        builtins.__dict__.pop("display", None)
        builtins.__dict__.update(saved_builtins)
    with contextlib.suppress(Exception):
        atexit.unregister(shell.atexit_operations)
    if not isinstance(shell.display_pub, CellDisplayPublisher):
        shell.display_pub = CellDisplayPublisher(shell=shell, parent=shell)
    shell._dir_history = [os.getcwd()]
    fmt = shell.display_formatter.formatters
    fmt["image/png"].for_type_by_name("matplotlib.figure", "Figure", figures.figure_mime("image/png"))
    fmt["image/svg+xml"].for_type_by_name("matplotlib.figure", "Figure",
                                         figures.figure_mime("image/svg+xml"))
    for listener in shell_listeners:
        listener(shell)
    return shell


def _configure_inline_backend(shell):
    """Let `%config InlineBackend.figure_format = 'retina'` work as in Jupyter.

    Done at the first %config rather than with the shell: matplotlib_inline
    imports matplotlib, about half of the time a cold worker's first rich
    display waits for the shell (1.1 of 2.2 s measured).
    """
    from matplotlib_inline.config import InlineBackend
    inline = next((c for c in shell.configurables if isinstance(c, InlineBackend)), None)
    if inline is None:
        inline = InlineBackend.instance(parent=shell)
        shell.configurables.append(inline)
    # matplotlib's inline set-up may have registered it first (a cell that imported
    # pyplot before its %config): the format must reach the figures either way.
    if not getattr(inline, "_snapk_observed", False):
        inline.observe(lambda change: figures.choose_formats(change["new"]),
                       names="figure_formats")
        inline._snapk_observed = True


@contextlib.contextmanager
def _hidden_names(shell):
    """Give IPython's own bookkeeping names to a magic, then take them out of the namespace."""
    ns = shell.user_ns
    added = []
    if "_dh" not in ns:
        ns["_dh"] = shell._dir_history
        added.append("_dh")
    try:
        yield
    finally:
        for name in added:
            if ns.get(name) is shell._dir_history:
                del ns[name]


def pre_run_events(source):
    """IPython's pre_execute / pre_run_cell events (autoreload and other extensions use them).

    Returns what post_run_events needs (None while the process has no shell).
    """
    shell = _shell  # without a shell yet, no extension can have registered for events
    if shell is None:
        return None
    from IPython.core.interactiveshell import ExecutionInfo
    info = ExecutionInfo(source, False, False, True, None)
    shell.events.trigger("pre_execute")
    shell.events.trigger("pre_run_cell", info)
    return info


def post_run_events(info, source, error=None, result=None):
    """IPython's post_execute / post_run_cell events, after the cell ran.

    Also when the cell itself made the shell (`%load_ext` in a cold
    worker): an extension it loaded sees the cell end, as in Jupyter.
    """
    shell = _shell
    if shell is None:
        return
    from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult
    outcome = ExecutionResult(info or ExecutionInfo(source, False, False, True, None))
    outcome.error_in_exec = error
    outcome.result = result
    shell.events.trigger("post_execute")
    shell.events.trigger("post_run_cell", outcome)


def stop_script_loop():
    """Stop the event-loop thread that %%bash / %%script start, so the worker may fork."""
    if _shell is None:
        return
    magics = _shell.magics_manager.registry.get("ScriptMagics")
    loop = getattr(magics, "event_loop", None)
    if loop is None:
        return
    runner = [t for t in threading.enumerate()
              if getattr(t, "_target", None) == loop.run_forever]
    loop.call_soon_threadsafe(loop.stop)
    for thread in runner:
        thread.join(5)
    if not loop.is_running():
        loop.close()
    magics.event_loop = None
