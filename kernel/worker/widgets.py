"""Widgets in a state: their models kept, and rebuilt with their last values.

A widget is a live object with a comm to the front end; what a state keeps
of it is its model: the class and the synced state (`get_state()`, what the
front end holds) of every widget alive in the process, by model id, as one
item of the state's context (kernel/worker/context.py). A variable holding a
widget is pickled as a reference to its model id (storage/serializer.py), so
a slider moved in the page changes only this item, not the variables.

After a restore, the widgets are made again as ipywidgets is imported, with
the same model ids (a page that still shows them keeps talking to them) and
their last state; then the variables that hold them are loaded. A widget
whose class a cell defined cannot be made again this way: the variable that
holds it is volatile (its cell replayed, or its name reported).
"""

import sys

from snapkernel.storage.serializer import rebuildable_widget


def _instances():
    """ipywidgets' model id -> widget of this process."""
    return sys.modules["ipywidgets.widgets.widget"]._instances


# The synced state of each widget as last read, and the widgets changed since: a cell
# reads again only those (get_state costs some 70 us a widget, and a notebook of 100
# progress bars has 1,100 widgets). Inherited by forks with the widgets themselves.
_read = {}  # model id -> (widget, state)
_changed = set()  # model ids


def _note_change(change):
    """A trait of a widget changed (in a cell, or from the page): read it again."""
    _changed.add(change["owner"]._model_id)


def states():
    """{model id: (module, class name, state)} of the widgets a restore can make again,
    or None when there are none."""
    kept = {}
    for model_id, widget in list(_instances().items()):
        if not rebuildable_widget(widget):
            continue
        read = _read.get(model_id)
        if read is None or read[0] is not widget:
            widget.observe(_note_change)
        if read is None or read[0] is not widget or model_id in _changed:
            state = {k: bytes(v) if isinstance(v, memoryview) else v
                     for k, v in widget.get_state().items()}
            read = _read[model_id] = (widget, state)
        kept[model_id] = (type(widget).__module__, type(widget).__qualname__, read[1])
    _changed.clear()
    for model_id in _read.keys() - kept.keys():
        del _read[model_id]
    return kept or None


def rebuild(kept):
    """Make the widgets of `kept` again (states()), with their model ids and states;
    those that cannot be (a class gone, a constructor that needs arguments) are named
    in the RuntimeError raised once the others are made."""
    import importlib
    instances = _instances()
    before = set(instances)
    made, failed = [], []
    for model_id, (module, qualname, state) in kept.items():
        if model_id in instances:
            continue
        try:
            cls = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            made.append((cls(model_id=model_id), state))
        except Exception as exc:
            failed.append(f"{qualname} {model_id} ({type(exc).__name__}: {exc})")
    # States refer to other widgets ("IPY_MODEL_<id>": a slider's layout): all made first.
    for widget, state in made:
        widget.set_state(state)
    # The layouts and styles the constructors made are replaced by the kept ones.
    for model_id in set(instances) - before - set(kept):
        instances[model_id].close()
    if failed:
        raise RuntimeError(f"widgets not made again: {'; '.join(failed)}")
