"""Libraries set up as in Jupyter, as soon as they are imported.

pandas gets Jupyter's display limits (display.max_rows, max_columns,
max_colwidth), matplotlib the inline backend, IPython the private shell
that `IPython.display` functions publish through. A worker does not
import them before its first cell (a cold worker should start at once):
`watch_imports` sets each up right after a cell, or a restore, first
imports it.
"""

import contextlib
import importlib.abc
import importlib.util
import os
import sys

from snapkernel.kernel.worker.capture import collector, comms, figures, shell

_pandas_done = set()


def configure_pandas(settings):
    """Apply Jupyter's pandas display limits, from the display.* settings.

    Outside a cell (`settings` None) there is nothing to apply yet: the
    next cell's capture does it.
    """
    pd = sys.modules.get("pandas")
    if settings is None or pd is None or not hasattr(pd, "set_option"):
        return
    limits = {key: settings[key] for key in
              ("display.max_rows", "display.max_columns", "display.max_colwidth")}
    done = (id(pd), *limits.values())
    if done in _pandas_done:
        return
    with contextlib.suppress(Exception):
        for key, value in limits.items():
            pd.set_option(key, value)
        _pandas_done.clear()
        _pandas_done.add(done)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the functions of _ON_IMPORT[name] right after module `name` is first
    imported (those added meanwhile too), then leaves sys.meta_path."""

    def __init__(self, name):
        """Wait for `name`."""
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        """Find `name` with the other finders and wrap its loader's exec_module."""
        if fullname != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec  # a loader shared by many modules: leave it alone
        run = loader.exec_module

        def exec_module(module):
            """Run the module, then what waits for it."""
            run(module)
            for then in list(_ON_IMPORT[self.name]):
                then()

        loader.exec_module = exec_module
        return spec


def configure_plotly():
    """Show plotly figures as ipykernel does: one display of the figure's JSON (the
    renderer plotly picks in a kernel; in our shell it would pick a second,
    HTML one too). PLOTLY_RENDERER, when set, still wins."""
    pio = sys.modules.get("plotly.io")
    if pio is not None and not os.environ.get("PLOTLY_RENDERER"):
        with contextlib.suppress(Exception):
            pio.renderers.default = "plotly_mimetype"


# What a worker needs as soon as these are imported.
_ON_IMPORT = {
    "plotly.io": [configure_plotly],
    "pandas": [lambda: configure_pandas(collector.running_settings())],
    "matplotlib": [lambda: figures.prepare_matplotlib(collector.running_settings())],
    "IPython": [lambda: shell.get_shell()],
    # Comms through the running cell (ipykernel's replace them as it is imported).
    "comm": [comms.install],
    "ipykernel.ipkernel": [comms.install],
    "tqdm.autonotebook": [comms.notebook_tqdm],
}


_watching = []  # True once watch_imports ran in this process (inherited by forks)


def on_import(name, then):
    """Run `then` right after module `name` is first imported (after the set-up
    above): before watch_imports, or later, while `name` is not imported yet."""
    if _watching and name not in _ON_IMPORT and name not in sys.modules:
        sys.meta_path.insert(0, _AfterImport(name))
    _ON_IMPORT.setdefault(name, []).append(then)


def awaited(name):
    """True when something waits for module `name`, not imported yet (a restored
    state's settings for it)."""
    return name not in sys.modules and bool(_ON_IMPORT.get(name))


def watch_imports():
    """Once per worker process, before any cell: set each library up now if imported
    already, else right after it is first imported."""
    _watching.append(True)
    for name, waiting in _ON_IMPORT.items():
        if name in sys.modules:
            for then in waiting:
                then()
        else:
            sys.meta_path.insert(0, _AfterImport(name))
