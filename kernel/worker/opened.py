"""Which files a cell opened while it ran, for the keys of notebook runs.

One audit hook (`sys.addaudithook`), installed once in the zygote and so
inherited by every holder and child, sees every `open` event: builtins
`open`, `io.open_code`, `os.open`, and so pandas' `read_csv`, numpy's
`loadtxt`, `json.load(open(...))` and `pathlib`, which all open through
them. While no cell is being recorded it returns after one global check,
and while one is, it only appends the event: paths are resolved, sorted
into reads and writes and filtered when the cell has run (`stop`). It
cannot see what a C library opens by itself (HDF5, netCDF, pyarrow's own
readers, SQLite), nor what a subprocess or a shell escape reads.

A path counts as written when any open of it could change it (write,
create, truncate, `r+`); a path the cell both read and wrote counts as
written only. A file a cell only appends to (mode `'a'`: a log, a
`logging.FileHandler`) is neither: a log is not an output to make again,
and a cell that reads it is not keyed by what later runs add to it. Left out: the interpreter's own files (the
standard library, installed packages, archives on `sys.path`), our
package, compiled `__pycache__` files, `/proc`, `/dev`, `/sys`, `/etc`, the
time zone database, the store, the caches and settings of libraries in the
home folder (`~/.cache`, `~/.ipython`, matplotlib's), folders, and a
written path that no longer exists when the cell ends (a temporary file).
"""

import os
import site
import sys
import sysconfig

_WRITING = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The events of the cell being recorded ([(event, args)]), None when none is.
_events = None
_start_cwd = None  # the working directory the cell started in
_installed = False
_left_out = ()  # folders (with a trailing separator)


def _hook(event, args):
    """The audit hook: one global check when no cell is being recorded."""
    if _events is not None and (event == "open" or event == "os.chdir"):
        _events.append((event, args))


def install(store_path=None):
    """Install the hook in this process (once; forks inherit it); `store_path`: the
    store's folder, whose files are never a cell's input."""
    global _installed, _left_out
    if _installed:
        return
    home = os.path.expanduser("~")
    folders = {*site.getsitepackages(), site.getusersitepackages(),
               *(sysconfig.get_path(p) for p in ("stdlib", "platstdlib", "purelib", "platlib")),
               *(os.path.join(_PACKAGE, sub) for sub in ("kernel", "storage", "api")),
               "/proc", "/dev", "/sys", os.path.join(home, ".cache"),
               os.path.join(home, ".ipython"), os.path.join(home, ".matplotlib"),
               os.path.join(home, ".config", "matplotlib"), os.environ.get("MPLCONFIGDIR"),
               "/etc", "/usr/share/zoneinfo", store_path,
               # the standard library's zip, and any other archive on the path
               *(p for p in sys.path if p and not os.path.isdir(p))}
    # A virtual environment's prefix is a folder of its own; the base interpreter's
    # (/usr, /usr/local) holds much more than Python, and is left to the paths above.
    if sys.prefix != sys.base_prefix:
        folders.add(sys.prefix)
    # As given and with links resolved: a path a cell opens is not resolved (a
    # realpath per open would cost more than the open).
    _left_out = tuple(sorted({g.rstrip(os.sep) + os.sep for f in folders if f
                              for g in (os.path.abspath(f), os.path.realpath(f))}))
    sys.addaudithook(_hook)
    _installed = True


def start():
    """Record the opens of the cell about to run (relative paths are resolved in the
    working directory it starts in, and in those it moves to)."""
    global _events, _start_cwd
    if not _installed:
        return
    try:
        _start_cwd = os.getcwd()
    except OSError:  # the folder was removed: nothing can be resolved
        return
    _events = []


def stop():
    """Stop recording; ([absolute paths read], [absolute paths written]) of the cell,
    sorted, without the paths left out (see the module's docstring)."""
    global _events
    events, _events = _events, None
    if not events:
        return [], []
    cwd = _start_cwd
    read, written, appended = set(), set(), set()
    for event, args in events:
        try:
            path = os.path.normpath(os.path.join(cwd, os.fsdecode(os.fspath(args[0]))))
        except TypeError:  # a file descriptor
            continue
        if event == "os.chdir":
            cwd = path
            continue
        flags = args[2] if isinstance(args[2], int) else 0
        mode = args[1] if isinstance(args[1], str) else ""
        if flags & os.O_APPEND and not flags & (os.O_TRUNC | os.O_RDWR):
            appended.add(path)
        elif flags & _WRITING or any(c in mode for c in "wx+"):
            written.add(path)
        else:
            read.add(path)
    appended -= written
    read -= written | appended
    return (sorted(p for p in read if _kept(p)),
            # a folder is "written" to make an unnamed temporary file in it (O_TMPFILE)
            sorted(p for p in written if _kept(p) and os.path.lexists(p)
                   and not os.path.isdir(p)))


def _kept(path):
    """Whether a path may be an input or output of the cell (not one left out)."""
    if "__pycache__" in path or path.endswith(".pyc"):
        return False
    return not (path + os.sep).startswith(_left_out) and os.path.dirname(path) != _PACKAGE
