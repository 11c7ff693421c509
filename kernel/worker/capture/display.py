"""display() and the formatting of objects into MIME bundles (ipykernel: displayhook.py).

Both go through the private IPython shell, so `_repr_*_` methods,
`_repr_mimebundle_`, `_ipython_display_`, `IPython.display` objects and
display ids behave exactly as in Jupyter.
"""

from snapkernel.kernel.worker.capture import shell

# Exact types whose Jupyter display is just their repr.
_PLAIN_TYPES = frozenset({int, float, bool, complex, str, bytes, type(None)})


def format_object(obj, include=None, exclude=None):
    """Return the (data, metadata) MIME bundle Jupyter would show for `obj`.

    An object with `_ipython_display_` displays itself and gives ({}, {}).
    """
    if type(obj) in _PLAIN_TYPES and not include and not exclude:
        # IPython shows these as their repr; skipping its formatter machinery saves ~0.5 ms
        # (and a cold worker need not make the shell for them).
        return {"text/plain": repr(obj)}, {}
    return shell.get_shell().display_formatter.format(obj, include=include, exclude=exclude)


def display(*objs, **kwargs):
    """Show objects as display_data outputs: IPython's display(), in builtins during a cell.

    The shell is made first (in a cold worker), so IPython's display()
    publishes into the cell instead of printing.
    """
    shell.get_shell()
    from IPython.core.display_functions import display as ipython_display
    return ipython_display(*objs, **kwargs)
