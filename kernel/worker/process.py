"""What every worker process shares: its channel to the server, the store, reaping.

Worker processes are the zygotes, the holders of live states and the
children that run cells (kernel/protocol.py names their roles). Each
opens its own channel to the server's Unix socket and its own store handle.
"""

import ctypes
import os
import random
import re
import signal
import types

from snapkernel.kernel import launch, protocol, trace
from snapkernel.kernel.channel import Channel
from snapkernel.storage import snapshot
from snapkernel.storage.cache import open_store

# The SIGCHLD pipe of this process, closed in forked children (which make their own).
_wake_fds = []
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option, value):
    """Call prctl(2); best effort (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def worker_env(base):
    """The environment a zygote is spawned with: `base`, a fixed hash seed (stable
    pickles and hashes), the Agg backend, and the folder of our packages on
    PYTHONPATH if it needs it to find them (kernel/launch.py)."""
    return launch.env(dict(base, PYTHONHASHSEED="0", MPLBACKEND="Agg"))


def core_free():
    """True if fewer processes are running right now than there are cores (this one
    included); True where /proc/loadavg cannot tell."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return True
    return running <= (os.cpu_count() or 1)


def threads_lost_on_fork(patterns):
    """Names of this process's threads that match one of `patterns` (regular
    expressions, workers.fork_unsafe_threads): thread pools that a forked copy of
    the process would lack while believing them there, so that its first task
    for them waits forever (polars' pool). Other threads are lost on fork too,
    but the libraries that start them (OpenBLAS, jemalloc) restart them in the child."""
    if not patterns:
        return []
    key = (frozenset(os.listdir("/proc/self/task")), tuple(patterns))
    if _last_threads[0] == key and _last_threads[2]:
        # The same threads as at the last two calls (one after every cell): reading
        # each one's name costs 0.15 ms a cell, the listing alone 7 us.
        return list(_last_threads[1])
    found = []
    for tid in key[0]:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if any(re.fullmatch(p, name) for p in patterns):
            found.append(name)
    # Trusted from the second reading on: a new thread names itself just after it starts.
    confirmed = _last_threads[0] == key and sorted(_last_threads[1]) == sorted(found)
    _last_threads[:] = [key, found, confirmed]
    return list(found)


_last_threads = [None, [], False]  # [(thread ids, patterns), names found, read twice]


def fresh_main():
    """Install an empty `__main__` module and return its namespace dict."""
    import builtins
    import sys
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    return main.__dict__


def user_names(namespace):
    """The notebook variable names of a namespace."""
    return {n for n in namespace if snapshot.is_user_name(n)}


# What a signal that killed a process tells its user.
_SIGNAL_HINTS = {
    signal.SIGKILL: " (out of memory, or killed)",
    **dict.fromkeys((signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                     signal.SIGABRT), " (a crash in native code: a C extension, ctypes, "
                                      "a library's bug)"),
}


def status_text(status):
    """Describe a wait status: (the signal or exit code in words, the code)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        hint = _SIGNAL_HINTS.get(sig, "")
        return f"was killed by signal {name}{hint}", -sig
    return f"exited with code {os.WEXITSTATUS(status)}", os.WEXITSTATUS(status)


def reap_children():
    """[(pid, wait status)] of every child of this process that has ended, reaped."""
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no child left
            return ended
        if pid == 0:
            return ended
        ended.append((pid, status))


def fork_worker(role):
    """os.fork() for a new worker of `role`; in the child, its set-up: a process group
    of its own, default signals, its own trace pid. Returns what os.fork() does.

    The parent sets the child's group too, at once: a loaded machine may not
    run the child for a while, and until it does, a SIGKILL of the parent's
    group (the server's, of a cell's child and what its cell left, once the
    cell made no state) would kill it too. A holder killed before it
    connected left its state waiting for it a whole worker_start_timeout_s.

    The `random` module reseeds its generator in every forked child; a worker
    is the state it was forked from, so it takes the parent's generator back
    (a cell after `random.seed(0)` must draw what it would in Jupyter).
    """
    generator = random.getstate()
    pid = os.fork()
    if pid:
        try:
            os.setpgid(pid, pid)
        except OSError:  # it is gone already, which its parent will hear of
            pass
        return pid
    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)
    for fd in _wake_fds:
        os.close(fd)
    _wake_fds.clear()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    random.setstate(generator)
    trace.after_fork(role)
    return 0


class WorkerProcess:
    """A worker's channel to the server and its handle on the store."""

    def __init__(self, sock_path, settings):
        """Remember how to reach the server and the store."""
        self.sock_path = sock_path
        self.settings = settings
        self.channel = None

    def connect(self, role, **hello):
        """Open this process's own channel to the server and introduce itself."""
        self.channel = Channel.connect(self.sock_path)
        self.channel.send(protocol.Hello(role=role, pid=os.getpid(), **hello))

    def store(self):
        """This process's handle on the store. Its commits do not flush their meta
        page: the server makes them durable (Store's meta_sync)."""
        return open_store(self.settings, meta_sync=False)

    def reaper(self):
        """Route SIGCHLD to a pipe so the select loop can reap children; returns its fd."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        _wake_fds[:] = [r, w]
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(w)
        return r

    def reap(self, wake_fd):
        """Report every exited child to the server."""
        try:
            os.read(wake_fd, 4096)
        except BlockingIOError:
            pass
        for pid, status in reap_children():
            text, code = status_text(status)
            self.channel.send(protocol.Exited(pid=pid, text=text, code=code))
