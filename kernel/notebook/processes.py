"""The processes of a fresh run: found in the process table, measured, killed.

A fresh run's processes all descend from its zygote, which is a child
subreaper (kernel/worker/zygote.py): a process a cell double-forks away
(`sleep 1000 &`, a daemon) is reparented to the zygote, not to init, so it
stays among the zygote's descendants. `Tracker` looks at that tree every
poll and remembers every process it saw (psutil tells one from a later
process that got its pid, by start time).
"""

import os
import signal
import time

import psutil

from snapkernel.kernel.worker.process import reap_children

# Seconds between two passes of `Tracker.kill_all` while processes remain.
_KILL_PASS_S = 0.01


def memory_bytes(process):
    """Proportional resident memory (Pss) of a psutil.Process in bytes; its RSS where
    Pss cannot be read; 0 once it is gone.

    Pss shares each page among the processes that map it, so summing it over
    a holder and the cell child forked from it counts their common pages once.
    """
    try:
        try:
            return process.memory_full_info().pss
        except psutil.AccessDenied:
            return process.memory_info().rss
    except psutil.Error:
        return 0


def _living(processes):
    """The processes of `processes` that are neither gone nor zombies (a zombie only
    waits to be reaped)."""
    found = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            pass
    return found


class Tracker:
    """Every process seen below a root process (the run's zygote), and its memory."""

    def __init__(self, root):
        """Watch the tree below process `root` (and `root` itself)."""
        self.root = root
        # pid -> psutil.Process of every process observed in the tree; psutil tells a
        # process from a later one that got its pid by its start time.
        self.seen = {}
        self.peak_bytes = 0

    def _below(self):
        """The processes below the root now."""
        try:
            return psutil.Process(self.root).children(recursive=True)
        except psutil.Error:
            return []

    def sample(self):
        """Look at the tree now: remember its processes; returns their summed memory."""
        try:
            tree = [psutil.Process(self.root)] + self._below()
        except psutil.Error:
            tree = self._below()
        total = 0
        for process in _living(tree):
            self.seen.setdefault(process.pid, process)
            total += memory_bytes(process)
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def alive(self):
        """The observed processes still running, besides everything below the root now
        ({pid: psutil.Process})."""
        found = {p.pid: p for p in self._below()}
        for pid, process in self.seen.items():
            if pid not in found and process.is_running():  # the same process, not a reuse
                found[pid] = process
        found.pop(self.root, None)
        return {p.pid: p for p in _living(found.values())}

    def kill_all(self, deadline):
        """SIGKILL every process of the tree but the root, and every observed one, until
        none is left (or until `deadline`, a time.monotonic()); returns the pids left.
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
                reap_children()
            left = self.alive()
            for pid, process in left.items():
                self.seen.setdefault(pid, process)
            if not left and not self._below() or time.monotonic() > deadline:
                return set(left)
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for process in left.values():
                    try:
                        process.send_signal(sig)
                    except psutil.Error:
                        pass
            time.sleep(_KILL_PASS_S)
