"""Keeping a state never acts on the world: the audit hook that holds pickling to it.

While a thread saves or loads a state's values or context (`sealed()`: the
serializer's pickling, dill's trial load, unpickling), an event that would act outside
the process raises SideEffect instead: opening a file for writing (or a
descriptor), removing, renaming, truncating, making a folder, starting or
signalling a process, connecting or binding a socket, opening a database
file or mapping a file. So a value whose pickle would act does not load
(and one whose trial load would is never stored by dill) rather than act;
storage/handles.py makes the known handles (files, sockets, processes...)
load inert, so they never get here.

An import is the module's own business (a library may write its cache when
first imported, as it did in the live session): what an import does is let
through. The hook is installed once per worker process (an audit hook cannot
be removed); outside `sealed()` it costs one test of a global.
"""

import os
import sys
from threading import get_ident

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_sealed = {}  # ident of a thread saving or loading values now -> blocks it is in
_installed = False


class SideEffect(RuntimeError):
    """Saving or loading a state's values tried to act on the world."""


def _opens_for_writing(args):
    """An `open` event that may change a file: a writing mode or flag, or a descriptor
    (a number means another file in the loading process)."""
    path, mode, flags = args
    return (isinstance(path, int) or (mode is not None and any(c in mode for c in "wax+"))
            or bool(flags & _WRITE_FLAGS))


# event -> None (always refused) or a test of its arguments (refused when true)
_REFUSED = dict.fromkeys((
    "os.remove", "os.rmdir", "os.rename", "os.truncate", "os.mkdir", "os.link",
    "os.symlink", "os.chmod", "os.chown", "os.utime", "shutil.rmtree",
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
    "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill",
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"))
_REFUSED.update({
    "open": _opens_for_writing,
    "sqlite3.connect": lambda args: args[0] != ":memory:",
    "mmap.__new__": lambda args: args[0] != -1,  # -1: anonymous memory, no file
})


def _hook(event, args):
    """The audit hook: refuse a refused event in a sealed thread."""
    if not _sealed or event not in _REFUSED or get_ident() not in _sealed:
        return
    test = _REFUSED[event]
    if (test is None or test(args)) and not _importing():
        raise SideEffect(f"{event}{args!r} refused while a state's values were being saved "
                         f"or loaded: keeping a state never acts on the world")


def _importing():
    """True when the event comes from a module being imported."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def install():
    """Install the audit hook in this process (once; a fork inherits it)."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True


class _Seal:
    """The context of `sealed()`: counts, per thread, the blocks it is in."""

    __slots__ = ()

    def __enter__(self):
        ident = get_ident()
        _sealed[ident] = _sealed.get(ident, 0) + 1

    def __exit__(self, *exc):
        ident = get_ident()
        if _sealed[ident] == 1:
            del _sealed[ident]
        else:
            _sealed[ident] -= 1


_SEAL = _Seal()


def sealed():
    """Refuse, in this thread and for the block, the events that act on the world."""
    return _SEAL
