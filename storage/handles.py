"""Pickling values that stand for something outside the process, so that loading them
never acts on it.

Files, sockets, processes, database connections and memory maps are handles
on the world: unpickled the usual way (dill reopens a file in its own mode)
they would act on it, and a closed `'w'` file object would truncate the file
its cell had just written. Each kind here is reduced to what a restore can
give back without acting:

- a file object, closed or open for writing, appending or updating: a closed
  file object of the same class with its name and mode (built over
  `_Detached`, which has no file); one open only for reading: reopened for
  reading at its offset if the file is unchanged since (device, inode, size
  and mtime), else closed;
- the objects over files (gzip, bz2, lzma, zipfile, tarfile, a csv writer, a
  `tempfile` wrapper): their file as above, closed when the file is, and a
  temporary file never deleted by its restored copy;
- a `logging.FileHandler`: reattached with no file open; its next record
  opens the file appending (a `'w'` handler too: it never truncates again);
- a socket, `subprocess.Popen`, sqlite3 connection or cursor, memory map,
  multiprocessing pipe end, h5py file, group or dataset, netCDF4 dataset:
  closed (a Popen detached from its process, which it can then neither wait
  for nor signal).

What was open and comes back closed is said in `notes` when the value is
pickled (the state lists it: `inert_symbols`); a read-only file that changed
since is said when it loads (`take_restore_notes`).
"""

import copyreg
import csv
import gc
import io
import itertools
import os
import socket
import stat
import sys
import threading

# (module, qualified name) of a class -> its reducer: (obj, notes) -> reduction or None.
_REDUCERS = {}
_kinds = {}  # class -> reducer found in its MRO, or None
_restore_notes = []  # what loads could not give back as it was, since the last take


def reduce(obj, notes):
    """A reduction of `obj` that loads without acting, or None for a value that is no
    handle; appends to `notes` what a restore will not give back as it is."""
    cls = type(obj)
    reducer = _kinds.get(cls, False)
    if reducer is False:
        reducer = _kinds[cls] = next(
            (_REDUCERS[key] for base in cls.__mro__
             if (key := (base.__module__, base.__qualname__)) in _REDUCERS), None)
    return None if reducer is None else reducer(obj, notes)


def take_restore_notes():
    """The notes made by the loads since the last call."""
    taken = _restore_notes[:]
    del _restore_notes[:]
    return taken


def _handles(*classes):
    """Register the decorated reducer for `classes`, given as "module.QualName"."""
    def register(reducer):
        for name in classes:
            module, _, qualname = name.rpartition(".")
            _REDUCERS[(module, qualname)] = reducer
        return reducer
    return register


# Files --------------------------------------------------------------------------------

_STANDARD = ("stdin", "stdout", "stderr", "__stdin__", "__stdout__", "__stderr__")
_FILE_CLASSES = (io.TextIOWrapper, io.BufferedRandom, io.BufferedWriter, io.BufferedReader,
                 io.FileIO)


class _Detached(io.RawIOBase):
    """The bottom of a restored closed file object: the file's name and mode, no file."""

    def __init__(self, name, mode):
        """A raw stream called `name`, in `mode`, to be closed at once."""
        super().__init__()
        self.name = name
        self.mode = mode

    # What the buffered and text classes ask of their raw stream when made over it.
    def readable(self):
        return True

    def writable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=0):
        return 0


@_handles(*(f"_io.{c.__name__}" for c in _FILE_CLASSES))
def _file(obj, notes):
    """A file object as its shape (its class, and its buffer's class for a text file),
    name, modes (its own, its raw stream's), text settings, and how to reopen it
    (None: it comes back closed)."""
    name = getattr(obj, "name", None)
    if name is None:
        return None  # over an in-memory buffer: no file
    for attribute in _STANDARD:
        if getattr(sys, attribute) is obj:
            return (getattr, (sys, attribute))
    top = next(c for c in _FILE_CLASSES if isinstance(obj, c))
    text = top is io.TextIOWrapper
    below = next((c.__name__ for c in _FILE_CLASSES[1:4] if isinstance(obj.buffer, c)),
                 None) if text else None
    raw = _raw(obj)
    modes = (getattr(obj, "mode", None), getattr(raw, "mode", None))
    settings = (obj.encoding, obj.errors, obj.line_buffering, obj.write_through) if text \
        else None
    reopen = None
    if not obj.closed:
        reopen = _reading(obj, raw)
        if reopen is None:
            mode = modes[0] or modes[1]
            notes.append(f"file {name!r} open{f' in mode {mode!r}' * isinstance(mode, str)}"
                         f": restored closed, never reopened")
    return (_file_object, ((top.__name__, below), name, modes, settings, reopen))


def _raw(f):
    """The raw stream at the bottom of a file object."""
    buffer = getattr(f, "buffer", f)
    return getattr(buffer, "raw", buffer)


def _reading(obj, raw):
    """(path, identity, offset) of a regular file open only for reading, or None."""
    if not isinstance(raw, io.FileIO) or raw.closed or raw.mode != "rb":
        return None
    fd = raw.fileno()
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode):
        return None  # a pipe or a device: what it held is gone
    try:
        offset = obj.tell()
    except OSError:
        return None  # a text file read with next(): Python cannot tell where it is
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")  # where it is now, whatever the cwd
    except OSError:
        path = os.path.abspath(raw.name) if isinstance(raw.name, str) else None
    return None if path is None else (path, _identity(found), offset)


def _identity(found):
    """What says a file is still the one that was open: device, inode, size, mtime."""
    return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)


def _file_object(shape, name, modes, settings, reopen):
    """The file object `_file` reduced: reopened for reading if `reopen` and the file
    is unchanged, else closed."""
    top, below = shape
    if reopen is not None:
        path, identity, offset = reopen
        try:
            same = _identity(os.stat(path)) == identity
        except OSError:
            same = False
        if same:
            if top == "FileIO":
                f = io.FileIO(path, "r")
            else:
                encoding, errors = (settings or (None, None))[:2]
                f = open(path, modes[0] or "r", encoding=encoding, errors=errors)
            f.seek(offset)
            _raw(f).name = name  # as it was opened (a path relative to the cwd then)
            return f
        _restore_notes.append(f"file {name!r} ({path}) open for reading changed since the "
                              f"state was saved, or is gone: restored closed")
    f = _Detached(name, modes[1])
    if top == "TextIOWrapper":
        encoding, errors, line_buffering, write_through = settings
        f = io.TextIOWrapper(getattr(io, below or "BufferedRandom")(f), encoding, errors,
                             None, line_buffering, write_through)
        if modes[0] is not None:
            f.mode = modes[0]  # as open() sets it
    elif top != "FileIO":
        f = getattr(io, top)(f)
    f.close()
    return f


# Objects over files --------------------------------------------------------------------

def _instance(obj, state):
    """Reduce `obj` to an instance of its class made without its __init__, with `state`
    as its attributes."""
    return (copyreg.__newobj__, (type(obj),), state)


@_handles("gzip.GzipFile")
def _gzip(obj, notes):
    """Closed, with its name and mode (its compressor and buffers are not kept)."""
    if obj.fileobj is not None:
        notes.append(f"gzip file {obj.name!r} open: restored closed")
    return _instance(obj, {"name": obj.name, "mode": obj.mode, "fileobj": None,
                           "myfileobj": None})


@_handles("bz2.BZ2File", "lzma.LZMAFile")
def _compressed(obj, notes):
    """Closed (the closed state of _compression's streams)."""
    if not obj.closed:
        notes.append(f"{type(obj).__name__} open: restored closed")
    return _instance(obj, {"_mode": 0, "_fp": None, "_closefp": False, "_buffer": None})


@_handles("zipfile.ZipFile")
def _zip(obj, notes):
    """Closed, with its members listed; its lock is used only once it has a file."""
    if obj.fp is not None:
        notes.append(f"zip file {obj.filename!r} open in mode {obj.mode!r}: restored closed")
    return _instance(obj, dict(obj.__dict__, fp=None, _lock=None))


@_handles("tarfile.TarFile")
def _tar(obj, notes):
    """Closed, with its members listed (its file notes whether it was open)."""
    return _instance(obj, dict(obj.__dict__, closed=True))


@_handles("tempfile._TemporaryFileCloser")
def _temporary_closer(obj, notes):
    """A temporary file's closer that has run: its restored copy never deletes the file
    (the live one does, when it closes)."""
    return _instance(obj, dict(obj.__dict__, close_called=True, cleanup_called=True))


_DIALECT = ("delimiter", "doublequote", "escapechar", "lineterminator", "quotechar",
            "quoting", "skipinitialspace", "strict")


@_handles("_csv.writer")
def _csv_writer(obj, notes):
    """A csv writer over the same file (whose own reduction says how it comes back),
    with the same dialect. Python does not show a writer's file: its `write` method is
    among the objects the writer refers to."""
    target = next((getattr(r, "__self__", None) for r in gc.get_referents(obj)
                   if getattr(r, "__name__", None) == "write"), None)
    if target is None:
        return None
    return (_make_csv_writer, (target, {k: getattr(obj.dialect, k) for k in _DIALECT}))


def _make_csv_writer(target, dialect):
    """csv.writer(target) with the `dialect` settings."""
    return csv.writer(target, **dialect)


@_handles("logging.FileHandler")
def _file_handler(obj, notes):
    """Without its stream: the next record opens the file again, appending (mode 'w'
    would truncate it). A closed 'w' handler stays closed, as live."""
    state = dict(obj.__dict__, stream=None)
    state.pop("lock", None)
    if obj.stream is not None and state["mode"] == "w":
        state["mode"] = "a"
    return (copyreg.__newobj__, (type(obj),), state, None, None, _set_handler)


def _set_handler(handler, state):
    """Give a loaded handler its state and a new lock."""
    handler.__dict__.update(state)
    handler.createLock()
    return handler


# Processes, sockets, connections, memory maps -----------------------------------------

@_handles("subprocess.Popen")
def _popen(obj, notes):
    """Detached from its process: `_child_created` False makes it neither wait for nor
    signal a pid that is no child of the loading process (its pipes: files)."""
    if obj.returncode is None:
        notes.append(f"process {obj.pid} ({str(obj.args)[:100]}) was running: the restored "
                     f"Popen is not attached to it")
    state = dict(obj.__dict__, _child_created=False)
    state.pop("_waitpid_lock", None)
    return (copyreg.__newobj__, (type(obj),), state, None, None, _set_popen)


def _set_popen(popen, state):
    """Give a loaded Popen its state and a new lock."""
    popen.__dict__.update(state)
    popen._waitpid_lock = threading.Lock()
    return popen


@_handles("socket.socket")
def _socket(obj, notes):
    """Closed, of the same family and type: never reconnected."""
    if obj.fileno() != -1:
        try:
            peer = f" connected to {obj.getpeername()!r}"
        except OSError:
            peer = ""
        notes.append(f"socket{peer}: restored closed, never reconnected")
    return (_closed_socket, (int(obj.family), int(obj.type), obj.proto))


def _closed_socket(family, kind, proto):
    """A closed socket (made and closed at once: that connects nothing)."""
    try:
        made = socket.socket(family, kind, proto)
    except OSError:  # a family this process may not open (AF_PACKET needs privileges)
        made = socket.socket()
    made.close()
    return made


@_handles("sqlite3.Connection")
def _sqlite(obj, notes):
    """Closed (a connection on no database)."""
    try:
        obj.total_changes
        notes.append("sqlite3 connection: restored closed, never reconnected")
    except Exception:  # sqlite3.ProgrammingError: closed already
        pass
    return (_closed_sqlite, ())


def _closed_sqlite():
    """A closed sqlite3 connection."""
    import sqlite3
    connection = sqlite3.connect(":memory:")
    connection.close()
    return connection


@_handles("sqlite3.Cursor")
def _sqlite_cursor(obj, notes):
    """A cursor of its (closed) connection."""
    return (_cursor_of, (obj.connection,))


def _cursor_of(connection):
    """A cursor of `connection` (made even when it is closed)."""
    import sqlite3
    return sqlite3.Cursor(connection)


@_handles("mmap.mmap")
def _mmap(obj, notes):
    """Closed (its file is not mapped again)."""
    if not obj.closed:
        notes.append(f"memory map of {len(obj)} bytes: restored closed")
    return (_closed_mmap, ())


def _closed_mmap():
    """A closed memory map (an anonymous page, unmapped at once)."""
    import mmap
    made = mmap.mmap(-1, 1)
    made.close()
    return made


@_handles("multiprocessing.connection._ConnectionBase")
def _pipe_end(obj, notes):
    """Closed: its descriptor number means another file in the loading process."""
    if not obj.closed:
        notes.append(f"{type(obj).__name__} (pipe end): restored closed")
    return _instance(obj, {"_handle": None, "_readable": obj.readable,
                           "_writable": obj.writable})


# HDF5 and netCDF, whose C libraries open files unseen by Python's audit hooks ---------

_inert_files = itertools.count()  # names of the in-memory files closed handles are made in


@_handles("h5py._hl.files.File", "h5py._hl.group.Group", "h5py._hl.dataset.Dataset")
def _hdf5(obj, notes):
    """Closed, of the same kind (made in an in-memory file, closed at once)."""
    kind = next(k for k in ("File", "Dataset", "Group")
                if isinstance(obj, getattr(sys.modules["h5py"], k)))
    if obj.id.valid:
        inside = "" if kind == "File" else f" {obj.name!r} of"
        notes.append(f"HDF5 {kind.lower()}{inside} {obj.file.filename!r} open in mode "
                     f"{obj.file.mode!r}: restored closed, never reopened")
    return (_closed_hdf5, (kind,))


def _closed_hdf5(kind):
    """A closed h5py File, Group or Dataset."""
    import h5py
    memory = h5py.File(f"inert-{next(_inert_files)}.h5", "w", driver="core",
                       backing_store=False)
    made = {"File": memory, "Group": memory.require_group("g"),
            "Dataset": memory.require_dataset("d", (0,), "f8")}[kind]
    memory.close()  # closes what is open in it too
    return made


@_handles("netCDF4._netCDF4.Dataset")
def _netcdf(obj, notes):
    """Closed (a netCDF4 Dataset made in memory, closed at once)."""
    if obj.isopen():
        notes.append(f"netCDF dataset {obj.filepath()!r}: restored closed, never reopened")
    return (_closed_netcdf, ())


def _closed_netcdf():
    """A closed netCDF4 Dataset."""
    import netCDF4
    made = netCDF4.Dataset(f"inert-{next(_inert_files)}.nc", "w", diskless=True,
                           persist=False)
    made.close()
    return made
