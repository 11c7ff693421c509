"""Serialize alias groups of notebook variables to bytes and back.

The C pickler (protocol 5, through cloudpickle's `reducer_override`) comes
first; dill is the fallback for a group it cannot handle. Functions whose
globals are the notebook namespace are stored by value *without* their
globals and are rebound on load to the namespace they are loaded into, so a
restored `f` reads the restored globals. Large contiguous buffers travel out
of band, so each becomes a blob of its own and an unchanged column is never
stored twice. A numpy view is stored as a view of its base, so `b = a[:2]`
still writes through to `a` after a restore. Files, sockets, processes and
other handles on the world load inert (storage/handles.py), and no pickling
or loading here may act on the world (storage/guard.py).
"""

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import io
import pickle
import sys
import types

import cloudpickle
from cloudpickle import cloudpickle as _cp

from snapkernel.storage import canonical, guard, handles

PROTOCOL = 5
# Bytes an Arrow-backed array's buffers may hold beyond what it uses (see _arrow_reduce).
_ARROW_SLACK = 2 ** 16

# The namespace loaded functions are bound to; set by `loading_into`.
_target_globals = {"__builtins__": __builtins__}


class Unpicklable(Exception):
    """Neither pickler can serialize a value (it becomes volatile)."""


def _make_function(code, name, ncells):
    """Create a cell-defined function bound to the namespace being loaded.

    Closure cells start empty and are filled by `_set_function_state`, so a
    function that refers to itself through its closure can be rebuilt.
    """
    closure = tuple(types.CellType() for _ in range(ncells)) or None
    return types.FunctionType(code, _target_globals, name, None, closure)


def _set_function_state(func, state):
    """Fill a function made by `_make_function` (the pickle state setter)."""
    cells, defaults, kwdefaults, qualname, module, doc, annotations, attrs = state
    for cell, value in zip(func.__closure__ or (), cells):
        if value is not _EMPTY:
            cell.cell_contents = value
    func.__defaults__ = defaults
    func.__kwdefaults__ = kwdefaults
    func.__qualname__ = qualname
    func.__module__ = module
    func.__doc__ = doc
    func.__annotations__ = annotations
    func.__dict__.update(attrs)
    return func


class _Empty:
    """Marker of an empty closure cell."""

    def __reduce__(self):
        """Pickle as the module-level singleton."""
        return "_EMPTY"


_EMPTY = _Empty()


def _arrow_backed(cls, state):
    """Rebuild a pandas Arrow-backed array (a "str" column) from its attributes, with
    pandas' own __setstate__ (which keeps the chunks it is given)."""
    array = cls.__new__(cls)
    array.__setstate__(state)
    return array


def _arrow_reduce(array):
    """Reduce a pandas Arrow-backed array without a copy of its buffers, or None.

    pandas pickles one by combining its chunks into a new array first, a
    copy of every buffer at every save (260 MB for the string column of a
    1 GB frame), at a new address each time, so an unchanged column is
    hashed again. Its chunks pickle their buffers out of band themselves.
    An array that is a slice of much larger buffers is left to pandas, whose
    copy holds only the slice (buffers may hold a little more than their
    array uses: Arrow pads and over-allocates them).
    """
    chunks = array._pa_array
    if chunks.get_total_buffer_size() > chunks.nbytes * 9 // 8 + _ARROW_SLACK:
        return None
    return (_arrow_backed, (type(array), dict(array.__dict__, _cache={})))


def _arrow_buffer_reduce(buffer, min_buffer):
    """Reduce a pyarrow Buffer to the same pickle whether it is mutable or not.

    pyarrow pickles a buffer as itself, so a mutable one (what pyarrow
    allocates) and an immutable one (what read_csv makes, what a small
    buffer is after a restore) pickle to different bytes: a frame would get
    a new hash after a restart although no value changed. A small buffer
    goes in band as bytes, a large one out of band read-only.
    """
    import pyarrow
    if buffer.size < min_buffer:
        return (pyarrow.py_buffer, (buffer.to_pybytes(),))
    return (pyarrow.py_buffer, (pickle.PickleBuffer(memoryview(buffer).toreadonly()),))


def _make_view(base, offset, shape, strides, dtype):
    """Rebuild a numpy view of `base` (which is shared through the pickle memo)."""
    import numpy
    return numpy.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides)


class _GroupPickler(cloudpickle.Pickler):
    """cloudpickle's C pickler, binding cell functions to the loading namespace."""

    def __init__(self, file, namespace, class_tag, buffer_callback, min_buffer, references):
        """Pickle into `file`; `namespace` is the dict cell functions use as globals;
        buffers of `min_buffer` bytes and more go to `buffer_callback`; `references`:
        {id(object): (module, attribute)} of objects pickled as that attribute."""
        super().__init__(file, protocol=PROTOCOL, buffer_callback=buffer_callback)
        self._namespace = namespace
        self._class_tag = class_tag
        self._min_buffer = min_buffer
        self._ndarray = getattr(sys.modules.get("numpy"), "ndarray", None)
        self._dtype = getattr(sys.modules.get("numpy"), "dtype", None)
        arrays = sys.modules.get("pandas.arrays")
        self._arrow_array = getattr(arrays, "ArrowExtensionArray", None)
        self._arrow_buffer = getattr(sys.modules.get("pyarrow"), "Buffer", None)
        wrappers = sys.modules.get("bokeh.core.property.wrappers")
        self._bokeh_containers = tuple(
            getattr(wrappers, name) for name in ("PropertyValueDict", "PropertyValueList")
            if hasattr(wrappers, name))
        self._bokeh_document = getattr(sys.modules.get("bokeh.document.document"),
                                       "Document", None)
        self._references = _library_singletons()
        self._references.update(references or {})
        self.inert = []  # what a restore gives back inert (storage/handles.py)

    def reducer_override(self, obj):
        """Reduce cell functions, notebook classes, numpy views and Arrow-backed pandas
        arrays our way."""
        if isinstance(obj, types.FunctionType) and obj.__globals__ is self._namespace:
            cells = tuple(_cell_value(c) for c in obj.__closure__ or ())
            state = (cells, obj.__defaults__, obj.__kwdefaults__, obj.__qualname__,
                     obj.__module__, obj.__doc__, obj.__annotations__, dict(obj.__dict__))
            return (_make_function, (obj.__code__, obj.__name__, len(cells)),
                    state, None, None, _set_function_state)
        if isinstance(obj, type) and obj.__module__ == "__main__":
            _track_class(obj, self._class_tag)
        elif (where := self._references.get(id(obj))) is not None:
            return (_module_attribute, where)
        elif isinstance(obj, (type, types.FunctionType)) and (
                where := _held_by_its_module(obj)) is not None:
            return (_module_attribute, where)
        elif (reduced := canonical.reduce(obj)) is not None:
            return reduced
        elif rebuildable_widget(obj):
            # Its model is the state's (kernel/worker/widgets.py): by reference here.
            return (_widget, (obj._model_id,))
        elif self._dtype is not None and isinstance(obj, self._dtype) and obj.isbuiltin == 1:
            # A builtin dtype by its name: loaded, it is numpy's own object again (numpy
            # pickles a copy), so arrays restored from one state share it as the live
            # ones did, and pickle to the same bytes (the same symbol hashes).
            return (self._dtype, (obj.str,))
        elif self._ndarray is not None and type(obj) is self._ndarray:
            reduced = _view_reduce(obj, self._ndarray) or _datetime_reduce(obj)
            if reduced is not None:
                return reduced
        elif self._arrow_array is not None and isinstance(obj, self._arrow_array):
            arrow = _arrow_reduce(obj)
            if arrow is not None:
                return arrow
        elif self._arrow_buffer is not None and isinstance(obj, self._arrow_buffer):
            return _arrow_buffer_reduce(obj, self._min_buffer)
        elif self._bokeh_containers and isinstance(obj, self._bokeh_containers):
            items = dict(obj) if isinstance(obj, dict) else list(obj)
            return (_container, (type(obj), items), dict(obj.__dict__))
        elif self._bokeh_document is not None and type(obj) is self._bokeh_document:
            return _document_reduce(obj)
        elif (reduced := handles.reduce(obj, self.inert)) is not None:
            return reduced
        elif _loads_badly(type(obj)):
            return _plain_reduce(obj)
        return super().reducer_override(obj)


# Objects a library keeps once per process, which a cell can hold in a variable
# (`from pylab import *` brings `rcParams`): pickled as the library's attribute, so a
# restored variable is the process's object again, not a copy that no longer drives
# the library (and whose backend sentinel would not load as itself).
SINGLETONS = {"matplotlib": ("rcParams", "rcParamsDefault", "rcParamsOrig")}


def library_attribute(name, value):
    """(package, name) when `value` is the object the top-level package of its class
    holds as `name` (a library's own object, as `from sympy import *` brings `RR`),
    so it is pickled as that attribute; else None. Functions, classes and modules
    are pickled by reference already (see _held_by_its_module); the package's dict
    is read, not getattr, which could import a lazy submodule."""
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType,
                          types.ModuleType)):
        return None
    module = getattr(type(value), "__module__", None)
    if not isinstance(module, str) or module in ("builtins", "__main__"):
        return None
    package = module.partition(".")[0]
    held = getattr(sys.modules.get(package), "__dict__", {}).get(name)
    return (package, name) if held is value else None


def _held_by_its_module(obj):
    """(module, attribute) of a library function or class that pickle cannot find by
    its qualified name (sympy's `cacheit`, made by a decorator factory: cloudpickle
    would copy it by value, and failing that dill would spend seconds and fail too),
    when its module holds it under some name; else None. Dicts are read, not getattr,
    which could import a lazy submodule."""
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str) or module in ("builtins", "__main__"):
        return None
    attributes = getattr(sys.modules.get(module), "__dict__", {})
    first, *inner = str(getattr(obj, "__qualname__", "")).split(".")
    found = attributes.get(first)
    for part in inner:
        found = getattr(found, "__dict__", {}).get(part)
    if found is obj:
        return None  # pickle saves it by reference itself
    return next(((module, k) for k, v in list(attributes.items()) if v is obj), None)


def _library_singletons():
    """{id(object): (module, attribute)} of the SINGLETONS of the libraries imported."""
    found = {}
    for module, names in SINGLETONS.items():
        loaded = sys.modules.get(module)
        for name in names:
            if (value := getattr(loaded, name, None)) is not None:
                found[id(value)] = (module, name)
    return found


def _module_attribute(module, name):
    """`module.name`, importing the module."""
    return getattr(importlib.import_module(module), name)


def rebuildable_widget(obj):
    """True when `obj` is a live ipywidgets widget of an importable class: a state keeps
    its model and makes it again after a restore (kernel/worker/widgets.py)."""
    widget = sys.modules.get("ipywidgets.widgets.widget")
    # `_model_id`, not `model_id`: a closed widget has no comm to ask.
    return (widget is not None and isinstance(obj, widget.Widget)
            and type(obj).__module__ != "__main__"
            and widget._instances.get(getattr(obj, "_model_id", None)) is obj)


def _widget(model_id):
    """The widget of `model_id`, made again by the state's context as ipywidgets is
    imported (this import)."""
    from ipywidgets.widgets.widget import _instances
    try:
        return _instances[model_id]
    except KeyError:
        raise LookupError(f"widget {model_id} was not made again from the state's kept "
                          f"widget models (see the restore's warnings)") from None


def _container(cls, items):
    """A dict or list subclass holding `items`, made without its own __init__,
    __setitem__ or extend: bokeh's property containers need their state (restored
    after) for those, and unpickled as usual they failed."""
    new = cls.__new__(cls)
    (dict.update if issubclass(cls, dict) else list.extend)(new, items)
    return new


def _document_reduce(doc):
    """bokeh's Document (the one a notebook's figures are shown in): its managers hold
    weak references to it and are made anew; its index of models is built again once
    its roots are loaded (_LOADED_LATER)."""
    document = sys.modules["bokeh.document.document"]
    state = {"roots": list(doc._roots), "config": doc._config, "title": doc._title,
             "template_variables": doc._template_variables,
             # The library's own objects (not picklable as values) stand as None.
             "theme": None if doc._theme is document.default_theme else doc._theme,
             "template": None if doc._template is document.FILE else doc._template}
    return (_document, (type(doc),), state, None, None, _set_document)


def _document(cls):
    """An empty Document, made without its __init__ (which would number a model)."""
    return cls.__new__(cls)


def _set_document(doc, state):
    """Give a loaded Document its managers and fields; index its models after the load."""
    document = sys.modules["bokeh.document.document"]
    doc.callbacks = document.DocumentCallbackManager(doc)
    doc.models = document.DocumentModelManager(doc)
    doc.modules = document.DocumentModuleManager(doc)
    doc._config = state["config"]
    doc._roots = state["roots"]
    doc._template = state["template"] or document.FILE
    doc._template_variables = state["template_variables"]
    doc._theme = state["theme"] or document.default_theme
    doc._title = state["title"]
    doc._session_context = None
    _LOADED_LATER.append(doc.models.recompute)


# What a load finishes once every object of the group is whole (a Document's index of
# models walks its models' properties, which are set after the Document's own state).
_LOADED_LATER = []


# type -> whether its instances are reduced by _plain_reduce (see _loads_badly).
_plain_types = {}
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement


def _loads_badly(cls):
    """Whether instances of `cls` pickle the default way but would not load so.

    Loading one the default way calls `cls.__new__(cls)` and then looks up
    `__setstate__` on the half-made object. A __new__ that requires arguments
    fails there (mpmath's mpq, in sympy's values); a __getattr__ that reads the
    object's own attributes recurses until RecursionError (altair.datasets'
    `data`). Only classes written in Python all the way down (object's memory
    layout: object.__new__ makes them) with no pickling methods of their own."""
    known = _plain_types.get(cls)
    if known is None:
        known = _plain_types[cls] = (
            cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
            and not any(getattr(cls, name, None) is not None for name in (
                "__setstate__", "__getnewargs__", "__getnewargs_ex__"))
            and all(base is object or base.__flags__ & _HEAPTYPE for base in cls.__mro__)
            and (getattr(cls, "__getattr__", None) is not None or _new_needs_arguments(cls)))
    return known


def _new_needs_arguments(cls):
    """Whether `cls.__new__` has a parameter without a default besides the class."""
    if cls.__new__ is object.__new__:
        return False
    try:
        params = list(inspect.signature(cls.__new__).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in params)


def _plain_reduce(obj):
    """Reduce `obj` to its class and its default state, loaded by object.__new__ and a
    state setter that sets its attributes directly (_loads_badly)."""
    reduced = obj.__reduce_ex__(PROTOCOL)
    state = reduced[2] if isinstance(reduced, tuple) and len(reduced) > 2 else None
    return (object.__new__, (type(obj),), state, None, None, _set_attributes)


def _set_attributes(obj, state):
    """Set a loaded instance's pickled state: its __dict__, and its slots."""
    attributes, slots = state if isinstance(state, tuple) else (state, None)
    if attributes:
        obj.__dict__.update(attributes)
    for name, value in (slots or {}).items():
        object.__setattr__(obj, name, value)
    return obj


def _cell_value(cell):
    """The contents of a closure cell, or the empty marker."""
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _track_class(cls, tag):
    """Give a notebook class a tracker id that is the same run after run.

    cloudpickle keys the identity of a class pickled by value on this id, so
    every group holding instances of `cls` restores to one class object. A
    random id (cloudpickle's default) would change the fingerprints of equal
    values each time a notebook is re-run.
    """
    with _cp._DYNAMIC_CLASS_TRACKER_LOCK:
        if cls in _cp._DYNAMIC_CLASS_TRACKER_BY_CLASS:
            return
        digest = hashlib.sha256(f"{cls.__qualname__}\0{tag}".encode()).hexdigest()[:32]
        _cp._DYNAMIC_CLASS_TRACKER_BY_CLASS[cls] = digest
        _cp._DYNAMIC_CLASS_TRACKER_BY_ID.setdefault(digest, cls)


def _view_reduce(arr, ndarray):
    """Reduce a numpy view to (base, offset, shape, strides, dtype), or None."""
    base = arr.base
    if not isinstance(base, ndarray):
        return None
    while isinstance(base.base, ndarray):
        base = base.base
    if not base.flags.c_contiguous or arr.dtype.hasobject or base.dtype.hasobject:
        return None
    offset = arr.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    if offset < 0 or offset > base.nbytes:
        return None
    return (_make_view, (base, offset, arr.shape, arr.strides, arr.dtype))


def _datetime_reduce(arr):
    """Reduce a contiguous datetime64 or timedelta64 array with its bytes out of band,
    or None.

    numpy pickles these in band (their dtype cannot be exported through the
    buffer protocol): a frame's date column would be copied into the pickle
    and hashed again at every save of its group, even when the cell only read
    it. Its bytes, seen as uint8, travel out of band like any other column's.
    """
    if arr.dtype.kind not in "mM" or not arr.flags.c_contiguous:
        return None
    raw = pickle.PickleBuffer(arr.reshape(-1).view("u1"))
    return (_frombuffer, (raw, arr.dtype, arr.shape, "C"))


class Pickled:
    """One serialized group: pickle bytes, out-of-band buffers, which pickler, and what
    a restore gives back inert (storage/handles.py)."""

    __slots__ = ("payload", "buffers", "pickler", "inert")

    def __init__(self, payload, buffers, pickler, inert):
        """Hold the pieces; `buffers` are contiguous memoryviews."""
        self.payload = payload
        self.buffers = buffers
        self.pickler = pickler
        self.inert = inert


@functools.cache
def _dill_pickler():
    """dill's pickler with the handles of storage/handles.py reduced as the C path does
    them (dill would reopen a file in its own mode when loaded)."""
    import dill

    class DillPickler(dill.Pickler):
        """dill, with handles made inert."""

        def __init__(self, *args, **kwargs):
            """As dill's; `inert` as _GroupPickler's."""
            super().__init__(*args, **kwargs)
            self.inert = []

        def reducer_override(self, obj):
            """The reduction of a handle, else dill's own."""
            reduced = handles.reduce(obj, self.inert)
            return NotImplemented if reduced is None else reduced

    return DillPickler


def dumps(values, namespace, class_tag, min_buffer, references=None):
    """Serialize a list of values under one memo (sharing inside survives);
    `references` as _GroupPickler's.

    Raises Unpicklable when neither the C pickler nor dill can do it.
    """
    buffers = []

    def keep(pb):
        """Send big contiguous buffers out of band; keep small ones in band."""
        try:
            raw = pb.raw()
        except BufferError:
            return True
        if raw.nbytes < min_buffer:
            return True
        buffers.append(raw)
        return False

    out = io.BytesIO()
    with guard.sealed():
        try:
            pickler = _GroupPickler(out, namespace, class_tag, keep, min_buffer, references)
            pickler.dump(values)
            return Pickled(out.getvalue(), buffers, "c", pickler.inert)
        except Exception as first:
            try:
                import dill
                out = io.BytesIO()
                pickler = _dill_pickler()(out, protocol=PROTOCOL, recurse=True)
                pickler.dump(values)
                data = out.getvalue()
                # What only dill pickles is loaded back once: some of it pickles but does
                # not load (or would act when loaded: refused), and is volatile then.
                with loading_into(namespace), counters_kept():
                    dill.loads(data)
                return Pickled(data, [], "dill", pickler.inert)
            except Exception:
                raise Unpicklable(f"{type(first).__name__}: {first}") from None


# Module-level counters that a load advances (bokeh numbers every model it makes: p1001,
# p1002, ...). A load (and pickle's trial load of the dill path) makes objects that a live
# session made long ago, so it puts them back: the ids of the next models are those of a
# live session. (A counter's module first imported by the load: kernel/worker/context.py.)
_TRIAL_COUNTERS = [("bokeh.util.serialization", "_simple_id")]


@contextlib.contextmanager
def counters_kept():
    """Run the block, then set back the _TRIAL_COUNTERS it advanced."""
    saved = [(module, name, getattr(module, name))
             for module, name in ((sys.modules.get(m), n) for m, n in _TRIAL_COUNTERS)
             if hasattr(module, name)]
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


class loading_into:
    """Context in which loaded cell functions get `namespace` as their globals."""

    def __init__(self, namespace):
        """Remember the target namespace."""
        self.namespace = namespace

    def __enter__(self):
        """Point the function factory at the target namespace."""
        global _target_globals
        self.saved, _target_globals = _target_globals, self.namespace
        return self

    def __exit__(self, *exc):
        """Restore the previous target."""
        global _target_globals
        _target_globals = self.saved


def _frombuffer(buffer, dtype, shape, order):
    """numpy's array-from-pickled-buffer, with the buffer itself as the array's base.

    numpy's own version reshapes a flat array, so a restored array looks like
    a view of a hidden base; pickled again, it would not give the bytes it
    was stored as, and its hash would change across a restore.
    """
    import numpy
    return numpy.ndarray(shape, dtype=dtype, buffer=buffer, order="F" if order == "F" else "C")


# Our top-level packages before they moved into `snapkernel` (0.3.0): a store made then
# holds pickles that name our helpers by those names (`storage.serializer._make_function`).
_FORMER_TOPS = ("kernel.", "storage.", "api.")


def _renamed(module):
    """The module a pickle's `module` names now: one of ours by its former name becomes
    `snapkernel.` + that name (only submodules we have: a notebook's own `storage.py`
    has no `storage.serializer`); any other module is itself."""
    if module.startswith(_FORMER_TOPS) and importlib.util.find_spec(
            "snapkernel." + module.partition(".")[0]) is not None:
        try:
            if importlib.util.find_spec("snapkernel." + module) is not None:
                return "snapkernel." + module
        except ImportError:
            pass
    return module


class _Unpickler(pickle.Unpickler):
    """The C unpickler, rebuilding numpy arrays with `_frombuffer`."""

    def find_class(self, module, name):
        """Swap numpy's buffer reconstructor for ours; find our helpers by former names."""
        if name == "_frombuffer" and module in ("numpy._core.numeric", "numpy.core.numeric"):
            return _frombuffer
        return super().find_class(_renamed(module), name)


def loads_plain(data):
    """Unpickle bytes that hold no out-of-band buffers (a state's context)."""
    with guard.sealed():
        return _Unpickler(io.BytesIO(data)).load()


def _dill_loads(payload):
    """dill.loads, finding our helpers by their former names too."""
    import dill

    class Unpickler(dill.Unpickler):
        def find_class(self, module, name):
            return super().find_class(_renamed(module), name)

    return Unpickler(io.BytesIO(payload)).load()


def loads(payload, buffers, pickler, notes=None):
    """Deserialize a list of values (call inside `loading_into`). Loading leaves the
    _TRIAL_COUNTERS as they were: the next model a cell makes is numbered as live.
    `notes`, if given, gets what could not be given back as it was saved (a file open
    for reading changed since: storage/handles.py)."""
    try:
        with counters_kept(), guard.sealed():
            if pickler == "dill":
                return _dill_loads(payload)
            try:
                values = _Unpickler(io.BytesIO(payload), buffers=buffers).load()
            except BaseException:
                _LOADED_LATER.clear()
                raise
            while _LOADED_LATER:
                _LOADED_LATER.pop(0)()
            return values
    finally:
        taken = handles.take_restore_notes()
        if notes is not None:
            notes += taken
