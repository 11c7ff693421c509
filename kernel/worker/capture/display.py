"""display() and the formatting of objects into MIME bundles (ipykernel: displayhook.py).

Both go through the private IPython shell, so `_repr_*_` methods,
`_repr_mimebundle_`, `_ipython_display_`, `IPython.display` objects and
display ids behave exactly as in Jupyter.
"""

from snapkernel.kernel.worker.capture import shell

# Exact types whose Jupyter display is just their repr, unless a cell changed how the
# shell prints them (`%precision`, a printer registered for the type).
_PLAIN_TYPES = frozenset({int, float, bool, complex, str, bytes, type(None)})
_plain_printers = {}  # the shell's text/plain printers of those types as it was made


def _remember_plain_printers(ip):
    """Note the shell's own printers of the plain types (shell.shell_listeners)."""
    printers = ip.display_formatter.formatters["text/plain"].type_printers
    _plain_printers.clear()
    _plain_printers.update({t: printers.get(t) for t in _PLAIN_TYPES})


shell.shell_listeners.append(_remember_plain_printers)


def _shown_as_repr(obj):
    """True when the shell would show `obj` as its repr: a plain type, printed as the
    shell was made (no shell yet: no magic or printer has changed anything)."""
    kind = type(obj)
    if kind not in _PLAIN_TYPES:
        return False
    ip = shell.existing_shell()
    if ip is None:
        return True
    plain = ip.display_formatter.formatters["text/plain"]
    if kind is float and plain.float_format != "%r":
        return False
    return plain.type_printers.get(kind) is _plain_printers.get(kind) and \
        ("builtins", kind.__name__) not in plain.deferred_printers


def format_object(obj, include=None, exclude=None):
    """Return the (data, metadata) MIME bundle Jupyter would show for `obj`.

    An object with `_ipython_display_` displays itself and gives ({}, {}).
    """
    if not include and not exclude and _shown_as_repr(obj):
        # Skipping IPython's formatter machinery saves ~0.5 ms (and a cold worker need not
        # make the shell for them).
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
