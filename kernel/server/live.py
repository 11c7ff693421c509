"""One live state's processes: its holder, its spare children, and what the server
asks of them (kernel/server/pool.py keeps the live states and their lifecycle)."""

import os
import queue
import time

from snapkernel.kernel import protocol

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


class WorkerError(Exception):
    """A worker could not be started or reached; `ename` says which kind."""

    def __init__(self, ename, message):
        """Keep the error name for the client."""
        super().__init__(message)
        self.ename = ename


class LiveState:
    """The holder process of one live state, and its spare children.

    A state made by a cell gets its holder a moment later: the child that
    made it stays as its first spare and forks the holder, which connects
    on its own (`conn` is None until then). A state made without a holder
    (`holderless`: protocol.Execute.keep_live) is live only through that
    child, until a request takes it.
    """

    def __init__(self, state_id, conn, cold=False, connect_within=None, holderless=False):
        """Track the holder of `state_id` on `conn`; `cold`: forked by the cold zygote.

        conn None: the holder is expected to connect within `connect_within`
        seconds, unless the state is `holderless`.
        """
        self.state_id = state_id
        self.conn = conn
        self.cold = cold
        self.holderless = holderless
        self.spares = queue.Queue()
        self.forks_owed = 0  # spares asked for before the holder connected
        self.child_that_made_it = None  # while it is still an unused spare
        self.first_spare_coming = False  # restored: its holder is forking its first spare
        self.deadline = None if conn else time.monotonic() + connect_within
        self.statm = None  # the holder's /proc/PID/statm, open once its memory is asked
        self.stopped = False

    def alive(self):
        """False once the holder process is gone or stopped, or did not connect in time."""
        if self.stopped:
            return False
        if self.holderless:
            return True
        if self.conn is None:
            return time.monotonic() < self.deadline
        return self.conn.alive

    def ask_fork(self, now=True):
        """Ask the holder for one more spare (or once it connects); False if it is gone.
        `now` False: a replacement, which a holder still loading forks once loaded.

        Called with the pool's lock held (see Pool._attach).
        """
        if self.holderless:
            return False
        if self.conn is None:
            self.forks_owed += 1
            return True
        return self.conn.send(protocol.Fork(now))

    def rss(self):
        """Resident memory of the holder in bytes (0 if it is gone or not connected; that
        of the only child of a holderless state).

        Read again through a file kept open: every cell that makes a state sums
        the live holders' memory (Pool._evict), and opening 16 files costs that
        cell about 0.3 ms, reading them again 0.05 ms.
        """
        process = self.child_that_made_it if self.holderless else self.conn
        if process is None:
            return 0
        try:
            if self.statm is None:
                self.statm = open(f"/proc/{process.pid}/statm", "rb", buffering=0)
            return int(os.pread(self.statm.fileno(), 128, 0).split()[1]) * PAGE_BYTES
        except (OSError, IndexError, ValueError):
            return 0

    def stop(self):
        """Kill the holder and its idle spares, and wake the requests waiting for a spare
        (None in `spares`: no spare will come)."""
        self.stopped = True
        if self.statm is not None:
            self.statm.close()
        if self.conn is not None:
            self.conn.kill()
        while True:
            try:
                spare = self.spares.get_nowait()
            except queue.Empty:
                break
            if spare is not None:
                spare.kill()
        self.spares.put(None)
