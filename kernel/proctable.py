"""The process table, read from /proc (Linux): who is whose child, in which group.

Standard library only: the scripts and the tests' harness read it too.
"""

import collections
import os

# One process as /proc/PID/stat describes it; `start` is its start time in clock
# ticks after boot, which tells a process from a later one that got its pid.
Process = collections.namedtuple("Process", "ppid state pgrp start")


def process(pid):
    """The Process `pid` is now, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields start after the last ")".
    fields = text[text.rfind(")") + 2:].split()
    try:
        return Process(int(fields[1]), fields[0], int(fields[2]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def table():
    """{pid: Process} of every process visible now."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = process(entry)
            if info is not None:
                found[int(entry)] = info
    return found


def descendants(root, procs=None):
    """Pids of the processes below `root` in `procs` (default: a fresh `table()`),
    root excluded."""
    children = {}
    for pid, info in (table() if procs is None else procs).items():
        children.setdefault(info.ppid, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def alive(pid):
    """True if `pid` exists and is not a zombie."""
    info = process(pid)
    return info is not None and info.state != "Z"
