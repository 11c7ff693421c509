"""What a state holds besides its namespace: the process context its cells set up.

A restored state must answer as the live one did, and a live kernel is more
than its variables: the random generators, library settings, the
environment, the working directory, `sys.path`, warnings and loggers, the
modules imported from the notebook's own files, IPython's settings. Each of
these is one `Provider` below: a name, `get()` (the value to keep, or None
when there is nothing to keep, e.g. a library not imported), `set(value)`,
and `same(a, b)`. Supporting another library is one more entry of
PROVIDERS, which lists them in the order a restore applies them (the
folder and `sys.path` before the modules imported from files, the
warnings filters after what they could make fail, the generators last, as
importing may touch them).

After each cell, `capture` asks every provider and compares with the values
the state had (cheap comparisons of live structures: a cell that changed
nothing costs tens of microseconds). A changed value is pickled into a blob
of its own, content-addressed like the namespace's, and the manifest's
`context` maps each provider to its blob; an unchanged one keeps its key.
A restore (`restore`) reads the blobs and applies them, provider by
provider; what cannot be applied (a module file that changed or is gone, a
folder that no longer exists) becomes a warning, shown in the first answer
of the restored state and in GET /states/NAME, never a failed restore.

Values are relative to what the server gives every worker: the
environment and `sys.path` as a difference from the zygote's own, pandas
options and matplotlib's rcParams as a difference from their defaults (and
from the display limits the server sets), so a state made before a change
of the server's configuration does not bring the old configuration back.
"""

import contextlib
import dis
import hashlib
import importlib
import logging
import os
import pickle
import random
import sys
import types
import warnings

from snapkernel.kernel.files import sha256_file
from snapkernel.kernel.worker import widgets
from snapkernel.kernel.worker.capture import figures, libraries, shell, streams
from snapkernel.storage import serializer
from snapkernel.storage.store import StoreError

# What the zygote had before any cell: the environment and sys.path every worker
# starts from (set by `remember_base` in the zygote, inherited by every fork).
_BASE = {"environ": dict(os.environ), "path": list(sys.path), "data": dict(os.environ._data)}

# Marks the place of the zygote's own sys.path entries in a kept sys.path.
_BASE_PATH = "<base>"


def remember_base():
    """Note the environment, sys.path and random generator every worker starts from
    (in the zygote, before any cell)."""
    _BASE["environ"] = dict(os.environ)
    _BASE["path"] = list(sys.path)
    _BASE["random"] = random.getstate()
    # The modules imported so far are looked at once, here: every worker forked from
    # this process inherits the look, and a first cell saves without it (80 ms).
    _local_get()


def remember_generator(module):
    """Note the global generator of `module` ("numpy", "torch") as it was imported:
    a state keeps a generator only once a cell drew from it or seeded it (an
    untouched one, seeded by the OS, is every process's own, as live)."""
    getter = {"numpy": _numpy_get, "torch": _torch_get}[module]
    with contextlib.suppress(Exception):
        _BASE[module] = getter()
    # os.environ's own bytes mapping: comparing it costs a few microseconds, iterating
    # os.environ (which decodes every entry) some 60.
    _BASE["data"] = dict(os.environ._data)


class Provider:
    """One item of the process context: how to read it, apply it, compare it.

    `module`: the provider keeps something only while that module is
    imported (`get` is not asked otherwise), and `set` imports it.
    `prepare`: the server's own set-up of the item (pandas' display limits,
    matplotlib's figure dpi and inline backend), which every cell applies
    once per process (kernel/worker/capture): a restore does it before
    `set`, so that it is done when the first cell comes and does not
    overwrite the state's values then.
    """

    def __init__(self, name, get, set, module=None, same=None, prepare=None):
        """Describe one item."""
        self.name, self.get, self.set, self.module = name, get, set, module
        self.same = same or (lambda a, b: a == b)
        self.prepare = prepare


# The working directory, sys.path, the environment ---------------------------------------

def _path_get():
    """sys.path, the zygote's entries standing as one marker; and those it lost."""
    base = _BASE["path"]
    kept, seen_base = [], False
    for entry in sys.path:
        if entry in base:
            if not seen_base:
                kept.append(_BASE_PATH)
                seen_base = True
        else:
            kept.append(entry)
    removed = [entry for entry in base if entry not in sys.path]
    if kept == [_BASE_PATH] and not removed:
        return None
    return {"path": kept, "removed": removed}


def _path_set(value):
    """Rebuild sys.path from this process's own entries and the kept ones."""
    base = [entry for entry in _BASE["path"] if entry not in value["removed"]]
    path = []
    for entry in value["path"]:
        path.extend(base if entry == _BASE_PATH else [entry])
    if _BASE_PATH not in value["path"]:
        path.extend(base)
    sys.path[:] = path
    importlib.invalidate_caches()


def _environ_get():
    """The variables set, changed or removed since the zygote started."""
    if os.environ._data == _BASE["data"]:
        return None
    base, current = _BASE["environ"], os.environ
    changed = {k: v for k, v in current.items() if base.get(k) != v}
    removed = sorted(k for k in base if k not in current)
    return {"set": changed, "removed": removed}


def _environ_set(value):
    """Apply the kept changes to this process's environment."""
    for name in value["removed"]:
        os.environ.pop(name, None)
    os.environ.update(value["set"])


def _cwd_set(folder):
    """Work in `folder` (a warning if it is gone)."""
    try:
        os.chdir(folder)
    except OSError as exc:
        raise ContextWarning(f"the working directory {folder} cannot be entered "
                             f"({exc.strerror}); the cell runs in {os.getcwd()}") from None


# Modules imported from the notebook's own files -------------------------------------------

def _installed_roots():
    """Folders whose modules come with the interpreter or an installed distribution
    (or with this server): not the notebook's own files."""
    import sysconfig
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        roots.add(sysconfig.get_path(key))
    import site
    roots.update(site.getsitepackages())
    roots.add(site.getusersitepackages())
    roots.add(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


_ROOTS = []
_modules_seen = set()  # names of the modules in sys.modules already looked at
_local = {}  # module name -> [path, sha256] of those that come from the user's files


def _local_get():
    """{module name: [path, sha256]} of the imported modules that come from files of
    the user's (not the interpreter's, an installed distribution's or ours)."""
    if not _ROOTS:
        _ROOTS.append(_installed_roots())
    if len(sys.modules) != len(_modules_seen):
        for name in sys.modules.keys() - _modules_seen:
            module = sys.modules.get(name)
            path = getattr(module, "__file__", None)
            if isinstance(path, str) and path.endswith(".py") and not name.startswith("__"):
                real = os.path.realpath(path)
                if not real.startswith(_ROOTS[0]) and os.path.isfile(real):
                    try:
                        _local[name] = [real, sha256_file(real)]
                    except OSError:
                        pass
        _modules_seen.intersection_update(sys.modules)
        _modules_seen.update(sys.modules)
        for name in [n for n in _local if n not in sys.modules]:
            del _local[name]
    return dict(_local) or None


def forget_changed_modules():
    """Take out of sys.modules the modules of the user's files whose file changed since
    they were imported (and their submodules): the next `import` reads the file."""
    _local_get()
    for name, (path, sha) in list(_local.items()):
        try:
            same = sha256_file(path) == sha
        except OSError:
            same = False
        if not same:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            del _local[name]
            _modules_seen.discard(name)


def _local_set(modules):
    """Import the kept modules again (sys.path and the folder are restored by now);
    a warning names each whose file changed since or is gone."""
    problems = []
    for name, (path, sha) in sorted(modules.items()):
        try:
            now = sha256_file(path)
        except OSError:
            problems.append(f"module {name!r}: its file {path} is gone")
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:
            problems.append(f"module {name!r} ({path}) could not be imported again: "
                            f"{type(exc).__name__}: {exc}")
            continue
        if now != sha:
            problems.append(f"module {name!r}: {path} changed since the state was made; "
                            f"the state now uses the file as it is")
    if problems:
        raise ContextWarning("; ".join(problems))


# Attributes cells set on imported modules ---------------------------------------------

_watched = set()  # (module name, dotted path) of the attributes cells assign
_STORE_ATTR = dis.opmap["STORE_ATTR"]
_unkept = set()  # "module.path" of those whose value could not be stored

# Attributes a library's own code sets when a cell asks it to, kept as if the cell had
# assigned them: sympy's `init_printing()` chooses how its objects show in Jupyter by
# setting these methods of its base class.
LIBRARY_ATTRIBUTES = {
    "sympy": [("sympy.core._print_helpers", "Printable." + name)
              for name in ("_repr_png_", "_repr_svg_", "_repr_latex_")],
}
for _library, _attributes in LIBRARY_ATTRIBUTES.items():
    libraries.on_import(_library, lambda attributes=_attributes: _watched.update(attributes))


def watch_attribute_writes(codes, namespace):
    """Note the attributes the cell's code assigns on imported modules and on their
    classes (`mod.CONST = 3`, `pd.DataFrame.f = f`, also inside functions), from
    its bytecode: after this cell and every later one their values are kept."""
    todo = list(codes)
    while todo:
        code = todo.pop()
        todo.extend(c for c in code.co_consts if isinstance(c, type(code)))
        if _STORE_ATTR not in code.co_code[::2]:
            # Opcodes sit at even offsets: no attribute assigned here, and this test
            # costs a microsecond where disassembling costs 0.2 ms a cell.
            continue
        ops = list(dis.get_instructions(code))
        for i, op in enumerate(ops):
            if op.opname != "STORE_ATTR":
                continue
            path, j = [op.argval], i - 1
            while j >= 0 and ops[j].opname == "LOAD_ATTR":
                path.insert(0, ops[j].argval)
                j -= 1
            if j < 0 or ops[j].opname not in ("LOAD_NAME", "LOAD_GLOBAL"):
                continue
            root = namespace.get(ops[j].argval)
            if isinstance(root, types.ModuleType) and root.__name__ != "__main__":
                _watched.add((root.__name__, ".".join(path)))
            elif isinstance(root, type) and root.__module__ not in ("__main__", "builtins"):
                _watched.add((root.__module__, ".".join([root.__qualname__, *path])))


def _resolve(module, path):
    """(object holding the attribute, attribute name) of `module`'s `path`."""
    target = sys.modules[module]
    *parents, name = path.split(".")
    for part in parents:
        target = getattr(target, part)
    return target, name


def _attributes_get():
    """{(module, path): (pickled value, pickler)} of the watched attributes, pickled as
    the namespace's values are (a cell's function by value, bound on restore to
    the namespace); "unkept": those that cannot be stored."""
    if not _watched:
        return None
    namespace = sys.modules["__main__"].__dict__
    kept = {}
    for module, path in sorted(_watched):
        try:
            target, name = _resolve(module, path)
            value = getattr(target, name)
        except (KeyError, AttributeError):
            continue
        try:
            pickled = serializer.dumps([value], namespace, "", 2 ** 62)
        except serializer.Unpicklable:
            _unkept.add(f"{module}.{path}")
            continue
        _unkept.discard(f"{module}.{path}")
        kept[(module, path)] = (pickled.payload, pickled.pickler)
    return {"attributes": kept, "unkept": sorted(_unkept)}


def _attributes_set(value):
    """Set the kept attributes again, their modules imported."""
    namespace = sys.modules["__main__"].__dict__
    problems = []
    for (module, path), (payload, pickler) in value["attributes"].items():
        try:
            importlib.import_module(module)
            with serializer.loading_into(namespace):
                restored = serializer.loads(payload, [], pickler)[0]
            target, name = _resolve(module, path)
            setattr(target, name, restored)
            _watched.add((module, path))
        except Exception as exc:
            problems.append(f"{module}.{path}: {type(exc).__name__}: {exc}")
    _unkept.update(value["unkept"])
    if problems:
        raise ContextWarning("attributes set on modules not restored: " + "; ".join(problems))


# Warnings and logging ------------------------------------------------------------------

def _warnings_get():
    """The warnings filters, each category named by (module, qualname) rather than
    pickled: a restore then imports no library for its categories."""
    return [(action, message, (cat.__module__, cat.__qualname__), module, lineno)
            for action, message, cat, module, lineno in warnings.filters]


def _warnings_set(filters):
    """Replace the warnings filters. A filter whose category belongs to a library not
    imported yet joins the filters when the library is imported (importing it
    now would make every restore pay for the libraries that filter warnings)."""
    ready, later = [], {}
    for action, message, (module, qualname), where, lineno in filters:
        if module in sys.modules:
            try:
                category = _resolve_class(module, qualname)
            except AttributeError:
                continue  # the library no longer has that category
            ready.append((action, message, category, where, lineno))
        else:
            later.setdefault(module.split(".")[0], []).append(
                (action, message, module, qualname, where, lineno))
    warnings.filters[:] = ready
    warnings._filters_mutated()
    for package, waiting in later.items():
        libraries.on_import(package, lambda waiting=waiting: _add_filters(waiting))


def _add_filters(waiting):
    """Put filters whose categories could not be found before in front of the others."""
    for action, message, module, qualname, where, lineno in reversed(waiting):
        try:
            category = _resolve_class(module, qualname)
        except (KeyError, AttributeError):
            continue
        warnings.filters.insert(0, (action, message, category, where, lineno))
    warnings._filters_mutated()


def _resolve_class(module, qualname):
    """The class `qualname` of the imported module `module`."""
    found = sys.modules[module]
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _stream_name(stream):
    """"stdout" or "stderr" for the streams a handler can be rebuilt on, else None."""
    if stream in (sys.stdout, sys.__stdout__, streams.STDOUT):
        return "stdout"
    if stream in (sys.stderr, sys.__stderr__, streams.STDERR):
        return "stderr"
    return None


def _handler_get(handler):
    """A handler as it can be rebuilt: (kind, target, level, format, date format), or
    None for one that cannot."""
    fmt = handler.formatter
    shape = (handler.level, fmt._fmt if fmt else None, fmt.datefmt if fmt else None)
    if type(handler) is logging.FileHandler:
        return ("file", handler.baseFilename, handler.mode) + shape
    if type(handler) is logging.StreamHandler:
        name = _stream_name(handler.stream)
        return None if name is None else ("stream", name, None) + shape
    return None


def _logging_get():
    """{logger name: [level, handlers]} of the loggers a cell configured (the root
    logger by ""), where their handlers can be rebuilt."""
    loggers = [("", logging.root)] + [
        (n, lg) for n, lg in list(logging.Logger.manager.loggerDict.items())
        if isinstance(lg, logging.Logger)]
    found = {}
    for name, logger in loggers:
        if logger.level == (logging.WARNING if name == "" else logging.NOTSET) \
                and not logger.handlers:
            continue
        handlers = [_handler_get(h) for h in logger.handlers]
        found[name] = [logger.level, [h for h in handlers if h is not None]]
    return found or None


def _logging_set(value):
    """Set the kept levels and rebuild the kept handlers."""
    for name, (level, handlers) in value.items():
        logger = logging.getLogger(name or None)
        logger.setLevel(level)
        for kind, target, mode, hlevel, fmt, datefmt in handlers:
            if kind == "file":
                # Opened at its first record, appending: a restore opens no file.
                handler = logging.FileHandler(target, mode=mode if mode != "w" else "a",
                                              delay=True)
            else:
                handler = logging.StreamHandler(streams.STDOUT if target == "stdout"
                                                else streams.STDERR)
            handler.setLevel(hlevel)
            if fmt is not None or datefmt is not None:
                handler.setFormatter(logging.Formatter(fmt, datefmt))
            logger.addHandler(handler)


# Libraries' settings --------------------------------------------------------------------

_SERVER_PANDAS = ("display.max_rows", "display.max_columns", "display.max_colwidth")
_pandas_last = [None, None]  # the options dict as last seen, and what it gave


def _pandas_get():
    """{option: value} of pandas options that differ from their defaults (and from the
    display limits the server sets, which a restore sets first)."""
    import pandas as pd
    from pandas._config import config as cfg
    if _pandas_last[0] is not None and cfg._global_config == _pandas_last[0]:
        return _pandas_last[1]
    settings = _SETTINGS.get("settings") or {}
    changed = {}
    for key, option in cfg._registered_options.items():
        try:
            value = pd.get_option(key)
        except Exception:
            continue
        default = settings.get(key, option.defval) if key in _SERVER_PANDAS \
            else option.defval
        if not _equal(value, default):
            changed[key] = value
    _pandas_last[:] = [_copy_nested(cfg._global_config), changed or None]
    return changed or None


def _pandas_prepare():
    """The server's display limits (Provider.prepare)."""
    import pandas  # noqa: F401
    libraries.configure_pandas(_SETTINGS.get("settings"))


def _pandas_set(options):
    """Set the kept pandas options, over the server's display limits."""
    import pandas as pd
    for key, value in options.items():
        pd.set_option(key, value)


def _copy_nested(tree):
    """A copy of nested dicts (the leaves are shared)."""
    return {k: _copy_nested(v) if isinstance(v, dict) else v for k, v in tree.items()}


def _equal(a, b):
    """a == b, False where comparing fails or is ambiguous."""
    try:
        return bool(a == b)
    except Exception:
        return False


_mpl_last = [None, None]


# rcParams the server sets in every worker: the inline backend, interactive mode.
_SERVER_RC = ("backend", "interactive")
# The backends that mean "inline" here (kernel/worker/capture/figures.py), kept as the
# server's; any other a notebook chose is kept with its state.
_INLINE_BACKENDS = (figures.MPL_BACKEND, "agg", figures.IPYKERNEL_BACKEND)


def _rc_get():
    """{key: value} of matplotlib's rcParams that differ from matplotlib's defaults
    (and from the figure dpi the server sets)."""
    import matplotlib
    rc = matplotlib.rcParams
    if _mpl_last[0] is not None and dict.__eq__(rc, _mpl_last[0]):
        return _mpl_last[1]
    defaults = dict(matplotlib.rcParamsDefault)
    settings = _SETTINGS.get("settings")
    if settings:
        defaults["figure.dpi"] = settings["display.figure_dpi"]
    changed = {k: v for k, v in dict.items(rc)
               if k not in _SERVER_RC and not _equal(v, defaults.get(k))}
    backend = dict.get(rc, "backend")
    if isinstance(backend, str) and backend.lower() not in _INLINE_BACKENDS:
        changed["backend"] = backend  # the notebook's own choice (`matplotlib.use('svg')`)
    _mpl_last[:] = [dict.copy(rc), changed or None]
    return changed or None


def _rc_prepare():
    """The server's figure dpi and inline backend (Provider.prepare)."""
    import matplotlib  # noqa: F401
    figures.prepare_matplotlib(_SETTINGS.get("settings"))


def _rc_set(changed):
    """Apply the kept rcParams."""
    import matplotlib
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated keys a style may hold
        matplotlib.rcParams.update(changed)


# Random generators -----------------------------------------------------------------------

def _numpy_get():
    """numpy's legacy global generator (np.random.seed, np.random.rand) as bytes."""
    import numpy as np
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return (name, key.tobytes(), pos, has_gauss, gauss)


def _numpy_set(value):
    """Put numpy's legacy global generator back."""
    import numpy as np
    name, key, pos, has_gauss, gauss = value
    np.random.set_state((name, np.frombuffer(key, dtype=np.uint32), pos, has_gauss, gauss))


def _torch_get():
    """torch's global CPU generator, as bytes."""
    import torch
    return bytes(torch.get_rng_state().numpy())


def _torch_set(value):
    """Put torch's global CPU generator back."""
    import torch
    torch.set_rng_state(torch.frombuffer(bytearray(value), dtype=torch.uint8))


# IPython's settings ----------------------------------------------------------------------

# The line magics whose effect is IPython's state; kept as the cells said them and said
# again on restore, in order (the last of each kind of setting wins, as live).
IPYTHON_MAGICS = ("load_ext", "unload_ext", "reload_ext", "autoreload", "aimport",
                  "precision", "xmode", "config", "alias", "unalias", "colors")
_ipython_said = []  # [(magic, argument)] said by the cells of this process's state


def note_magic(name, argument):
    """A cell ran the line magic `name` `argument` (kernel/worker/capture/shell.py).

    A later magic of the same setting replaces an earlier one (the last
    `%precision`, the last `%config X.y`, the last of `%load_ext` /
    `%unload_ext` of one extension), so the list stays as short as the
    settings are few.
    """
    if name not in IPYTHON_MAGICS:
        return
    setting = _setting(name, argument)
    _ipython_said[:] = [s for s in _ipython_said if _setting(*s) != setting]
    _ipython_said.append((name, argument))


def _setting(name, argument):
    """What a magic sets: (kind, which), so that a later one of the same replaces it."""
    words = argument.split()
    if name in ("load_ext", "unload_ext", "reload_ext"):
        return ("extension", argument.strip())
    if name == "config":
        return ("config", argument.split("=", 1)[0].strip())
    if name in ("alias", "unalias"):
        return ("alias", words[0] if words else "")
    if name == "aimport":
        return ("aimport", argument.strip())
    return (name, "")


shell.magic_listeners.append(note_magic)


def _ipython_get():
    """The magics said so far that set IPython's state, oldest first."""
    return list(_ipython_said) or None


def _ipython_set(said):
    """Say the kept magics again, in the shell the cells use."""
    ip = shell.get_shell()
    problems = []
    for name, argument in said:
        try:
            ip.run_line_magic(name, argument)
        except Exception as exc:
            problems.append(f"%{name} {argument}: {type(exc).__name__}: {exc}")
    _ipython_said[:] = said
    if problems:
        raise ContextWarning("IPython settings not restored: " + "; ".join(problems))


# IPython's display formatters ------------------------------------------------------------

# What the shell's formatters printed with as the shell was made: {(mime, module, type
# name): printer}; a state keeps what its cells registered beyond it (sympy's
# `init_printing`, a notebook's `formatters['text/html'].for_type(...)`).
_printers_base = None
_printers_last = [None, None]  # [the registrations last read, the value made of them]


def _registrations(ip):
    """{(mime, module, type name): printer} of the shell's formatters, whether a printer
    was registered for a type or by its name (IPython moves one to the other on use)."""
    found = {}
    for mime, formatter in ip.display_formatter.formatters.items():
        for (module, name), printer in formatter.deferred_printers.items():
            found[(mime, module, name)] = printer
        for cls, printer in formatter.type_printers.items():
            found[(mime, cls.__module__, cls.__name__)] = printer
    return found


def remember_printers(ip):
    """Note the printers of a shell just made (kernel/worker/capture/shell.py)."""
    global _printers_base
    _printers_base = _registrations(ip)


shell.shell_listeners.append(remember_printers)


def _printers_get():
    """{"printers": {(mime, module, type name): (pickled printer, pickler)}, "unkept":
    [...]} of the printers the cells registered, pickled as the namespace's values
    are (sympy's are closures); None when there are none."""
    ip = shell.existing_shell()
    if ip is None or _printers_base is None:
        return _printers_last[1]  # a restored process without a shell yet: as restored
    now = _registrations(ip)
    if now == _printers_last[0]:
        return _printers_last[1]
    namespace = sys.modules["__main__"].__dict__
    kept, unkept = {}, []
    for key, printer in now.items():
        if _printers_base.get(key) is printer:
            continue
        try:
            pickled = serializer.dumps([printer], namespace, "", 2 ** 62)
        except serializer.Unpicklable:
            unkept.append(_printer_name(key))
            continue
        kept[key] = (pickled.payload, pickled.pickler)
    value = {"printers": kept, "unkept": unkept} if kept or unkept else None
    _printers_last[:] = [now, value]
    return value


def _printer_name(key):
    """How a message names a printer."""
    mime, module, name = key
    return f"{mime} of {module}.{name}"


def _printers_set(value):
    """Register the kept printers again on the shell's formatters."""
    ip = shell.get_shell()
    formatters = ip.display_formatter.formatters
    namespace = sys.modules["__main__"].__dict__
    problems = [f"{name}: its printer could not be stored" for name in value["unkept"]]
    for (mime, module, name), (payload, pickler) in value["printers"].items():
        try:
            with serializer.loading_into(namespace):
                printer = serializer.loads(payload, [], pickler)[0]
            cls = getattr(sys.modules.get(module), name, None)
            if isinstance(cls, type):
                # Over a printer IPython has for the type (builtins' list and dict),
                # which a registration by name would not replace.
                formatters[mime].for_type(cls, printer)
            else:
                formatters[mime].for_type_by_name(module, name, printer)
        except Exception as exc:
            problems.append(f"{_printer_name((mime, module, name))}: "
                            f"{type(exc).__name__}: {exc}")
    _printers_last[:] = [_registrations(ip), value]
    if problems:
        raise ContextWarning("display printers not restored: " + "; ".join(problems))


# bokeh ---------------------------------------------------------------------------------
# bokeh keeps three things in its modules that a notebook's outputs show: the counter that
# numbers its models (p1001, p1002, ... in every figure's HTML), whether `output_notebook()`
# was called (else `show` writes a file and shows nothing), and the current document, to
# which `show` adds each figure (a model belongs to one document: showing a restored
# figure again needs the document it was loaded with). The document is kept by the name
# of a variable whose model belongs to it, so it is that variable's once loaded.
_bokeh_pending = {}  # a restored value not yet applied in full (see after_load)


def _bokeh_get():
    """{next_id, notebook (its type, or None), document (a variable in it, or None)}; what
    a restore has not applied yet (bokeh's state not made, the document's variable not
    loaded) is still the state's."""
    state = getattr(sys.modules.get("bokeh.io.state"), "_STATE", None)
    notebook, document = _bokeh_pending.get("notebook"), _bokeh_pending.get("document")
    if state is not None:
        notebook = state.notebook_type if state.notebook else None
        if state.document.roots or not document:
            document = _bokeh_document_holder(state.document)
    return {"next_id": sys.modules["bokeh.util.serialization"]._simple_id,
            "notebook": notebook, "document": document}


def _bokeh_document_holder(document):
    """The first variable (by name) holding a model of `document`, or None."""
    if not document.roots:
        return None
    model = sys.modules["bokeh.model"].Model
    namespace = sys.modules["__main__"].__dict__
    for name in sorted(namespace):
        value = namespace[name]
        if not name.startswith("_") and isinstance(value, model) and value.document is document:
            return name
    return None


def _bokeh_set(value):
    """Set the counter now (bokeh.models has just been imported); the notebook mode once
    bokeh's state module is imported, the document once its variable is loaded."""
    sys.modules["bokeh.util.serialization"]._simple_id = value["next_id"]
    _bokeh_pending.clear()
    _bokeh_pending.update(value)
    if "bokeh.io.state" in sys.modules:
        _bokeh_notebook()
    else:
        libraries.on_import("bokeh.io.state", _bokeh_notebook)


def _bokeh_notebook():
    """`output_notebook()` as the state had it, without showing its banner again."""
    if _bokeh_pending.get("notebook"):
        # The live session made bokeh's state, and numbered its document's models, long ago.
        with serializer.counters_kept():
            state = sys.modules["bokeh.io.state"].curstate()
        state.output_notebook(_bokeh_pending["notebook"])


def variables_referred(kept):
    """The variables that the context `kept` ({provider: (key, value)}) refers to: they
    are loaded before a restored state's first cell (bokeh's current document is one
    of theirs)."""
    bokeh = kept.get("bokeh")
    return {bokeh[1]["document"]} if bokeh and bokeh[1]["document"] else set()


def after_load(namespace):
    """After values are loaded into a restored process, before its first cell: loading
    bokeh's models advanced its counter (set it back); the state's current document is
    that of its variable, once loaded."""
    if not _bokeh_pending:
        return
    if "next_id" in _bokeh_pending:  # no cell has run here since the restore
        sys.modules["bokeh.util.serialization"]._simple_id = _bokeh_pending["next_id"]
    name = _bokeh_pending.get("document")
    document = getattr(namespace.get(name), "document", None) if name else None
    if document is not None:
        from bokeh.io.state import curstate
        with serializer.counters_kept():
            state = curstate()
        state._document = document
        _bokeh_pending["document"] = None


def _touched(name, state):
    """A generator's state, or None while it is as it was when the process started
    (or the library was imported): nobody seeded it or drew from it."""
    return None if _BASE.get(name) == state else state


def fresh_generators(kept):
    """Before a cell, seed from the OS the global generators the state `kept` ({provider:
    (key, value)}) has not touched, as a new kernel's are: every worker inherits the
    zygote's, so an unseeded draw in a first cell would be the same on every run
    (`rerun` of it too). The new state is this process's base: untouched still."""
    if "random" not in kept:
        random.seed()
        _BASE["random"] = random.getstate()
    if "numpy.random" not in kept and "numpy" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["numpy"].random.seed()
            _BASE["numpy"] = _numpy_get()


# A generator as imported (seeded by the OS) is not kept.
libraries.on_import("numpy", lambda: remember_generator("numpy"))
libraries.on_import("torch", lambda: remember_generator("torch"))


class ContextWarning(Exception):
    """Part of a state's context could not be applied as it was; the message says
    what, for the user."""


# The registry: what a state holds besides its namespace, in the order a restore applies it.
PROVIDERS = [
    Provider("cwd", os.getcwd, _cwd_set),
    Provider("sys.path", _path_get, _path_set),
    Provider("environ", _environ_get, _environ_set),
    Provider("local_modules", _local_get, _local_set),
    Provider("module_attributes", _attributes_get, _attributes_set),
    Provider("logging", _logging_get, _logging_set),
    Provider("pandas.options", _pandas_get, _pandas_set, module="pandas",
             prepare=_pandas_prepare),
    Provider("matplotlib.rcParams", _rc_get, _rc_set, module="matplotlib",
             prepare=_rc_prepare),
    Provider("ipython", _ipython_get, _ipython_set),
    Provider("ipython.printers", _printers_get, _printers_set),
    # Before the variables that hold them are loaded (as ipywidgets is imported).
    Provider("ipywidgets", widgets.states, widgets.rebuild, module="ipywidgets"),
    # Once bokeh.models is imported, whose import numbers models of its own (formatters).
    Provider("bokeh", _bokeh_get, _bokeh_set, module="bokeh.models"),
    # After the magics said again: a cell's "error" filter could fail them.
    Provider("warnings", _warnings_get, _warnings_set),
    Provider("random", lambda: _touched("random", random.getstate()), random.setstate),
    Provider("numpy.random", lambda: _touched("numpy", _numpy_get()), _numpy_set,
             module="numpy"),
    Provider("torch.random", lambda: _touched("torch", _torch_get()), _torch_set,
             module="torch"),
]
_SETTINGS = {}  # the worker's settings, for a restore that runs outside a cell


def capture(previous, settings):
    """The context now, against `previous` ({provider: (blob key, value)} of the state
    the cell ran from): (context, payloads), where payloads are the blobs of the
    values that changed ({key: pickled value}). `settings`: the worker's."""
    _SETTINGS["settings"] = settings
    # A cell has run: bokeh's counter is the live one now (later loads leave it alone).
    _bokeh_pending.pop("next_id", None)
    context, payloads = {}, {}
    for provider in PROVIDERS:
        old = previous.get(provider.name)
        if provider.module is not None and provider.module not in sys.modules:
            # A restored process applies the kept value when the library is imported
            # (`restore`): until then it is still the state's.
            if old is not None:
                context[provider.name] = old
            continue
        try:
            value = provider.get()
        except Exception:
            value = None  # a library half imported, or changed beyond our reading
        if value is None:
            continue
        if old is not None and provider.same(old[1], value):
            context[provider.name] = old
            continue
        data = pickle.dumps(value, protocol=5)
        key = hashlib.sha256(data).hexdigest()
        payloads[key] = data
        context[provider.name] = (key, value)
    return context, payloads


def keys(context):
    """The manifest's form of a context: {provider: blob key}."""
    return {name: key for name, (key, _) in context.items()}


def restore(manifest, store, settings):
    """Apply the context of `manifest` to this process, provider by provider; returns
    (context, warnings): {provider: (key, value)} and what could not be applied.
    StoreError when a blob of it cannot be read (StoreCorrupt: damaged)."""
    _SETTINGS["settings"] = settings
    kept = manifest.get("context") or {}
    context, problems = {}, []
    for provider in PROVIDERS:
        key = kept.get(provider.name)
        if key is None:
            continue
        try:
            value = serializer.loads_plain(store.blob(key))
        except StoreError:
            # Damaged bytes, an unreachable remote, a newer server's record: the state
            # cannot be what it was, and a warning would hide that.
            raise
        except Exception as exc:  # a library of another version cannot read it back
            problems.append(f"{provider.name} could not be read back: "
                            f"{type(exc).__name__}: {exc}")
            continue
        context[provider.name] = (key, value)
        if provider.module is not None and provider.module not in sys.modules:
            # A library not imported yet gets its settings as it is imported: a cell that
            # does not use it does not wait for its import (matplotlib's: 0.4 s cold).
            libraries.on_import(provider.module, _later(provider, value))
            continue
        _apply(provider, value, problems)
    return context, problems


def _apply(provider, value, problems):
    """provider.set(value) after provider.prepare(), what it could not do added to
    `problems`."""
    try:
        if provider.prepare is not None:
            provider.prepare()
        provider.set(value)
    except ContextWarning as exc:
        problems.append(str(exc))
    except Exception as exc:
        problems.append(f"{provider.name} could not be restored: "
                        f"{type(exc).__name__}: {exc}")


def _later(provider, value):
    """Apply `value` when the provider's library is imported; a problem then is said
    on stderr (the first answer after the restore has been given)."""
    def apply():
        problems = []
        _apply(provider, value, problems)
        for problem in problems:
            print(f"Warning: the restored state differs from the one saved: {problem}",
                  file=sys.stderr)
    return apply
