"""The processes of a fresh run: found in the process table, measured, killed.

A fresh run's processes all descend from its zygote, which is a child
subreaper (kernel/worker/zygote.py): a process a cell double-forks away
(`sleep 1000 &`, a daemon) is reparented to the zygote, not to init, so it
stays among the zygote's descendants. `Tracker` looks at that tree every
poll and remembers every process it saw, by pid and start time (a pid
alone may be reused by an unrelated process after ours ended). Linux only:
everything is read from /proc.
"""

import os
import signal
import time

from kernel.proctable import descendants, table

# Seconds between two passes of `Tracker.kill_all` while processes remain.
_KILL_PASS_S = 0.01


def memory_bytes(pid):
    """Proportional resident memory (Pss) of a process in bytes; its RSS where Pss
    cannot be read; 0 once it is gone.

    Pss shares each page among the processes that map it, so summing it over
    a holder and the cell child forked from it counts their common pages once.
    """
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Tracker:
    """Every process seen below a root process (the run's zygote), and its memory."""

    def __init__(self, root):
        """Watch the tree below process `root` (and `root` itself)."""
        self.root = root
        self.seen = {}  # pid -> start time, of every process observed in the tree
        self.peak_bytes = 0

    def sample(self):
        """Look at the tree now: remember its processes; returns their summed memory."""
        procs = table()
        tree = [self.root] + descendants(self.root, procs)
        total = 0
        for pid in tree:
            info = procs.get(pid)
            if info is None or info.state == "Z":
                continue
            self.seen.setdefault(pid, info.start)
            total += memory_bytes(pid)
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def alive(self, procs=None):
        """Pids of observed processes still running (zombies are dead: they only wait to
        be reaped), besides everything below the root now."""
        procs = table() if procs is None else procs
        pids = set(descendants(self.root, procs))
        pids |= {pid for pid, start in self.seen.items()
                 if pid in procs and procs[pid].start == start}
        pids.discard(self.root)
        return {pid for pid in pids if pid in procs and procs[pid].state != "Z"}

    def kill_all(self, deadline):
        """SIGKILL every process of the tree but the root, and every observed one, until
        none is left (or until `deadline`, a time.monotonic()); returns those left.
        The root may be this very process (a subreaper): it then reaps them itself.

        Each pass stops them all first (SIGSTOP), so none can fork a replacement
        while its siblings are being killed; a process forked before its parent
        stopped is found by the next pass. The root stays alive meanwhile: as
        the subreaper it reaps what is killed (the loop waits for that too, so
        no zombie is left to a parent that may not reap), and orphans reach it,
        not init.
        """
        while True:
            if self.root == os.getpid():
                _reap_children()
            procs = table()
            pids = self.alive(procs)
            for pid in pids:
                self.seen.setdefault(pid, procs[pid].start)
            if not descendants(self.root, procs) and not pids or \
                    time.monotonic() > deadline:
                return pids
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            time.sleep(_KILL_PASS_S)


def _reap_children():
    """Reap every child of this process that has ended."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
