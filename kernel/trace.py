"""Phase stamps of every request in every process, for `bench.py --profile`.

With `server.trace_file` set, each process (server, zygote, holders, cell
children) appends one JSON line per stamp to that file:
`{"t": <CLOCK_MONOTONIC seconds>, "pid": ..., "role": ..., "phase": ...,
"exec": <exec_id or null>}`. CLOCK_MONOTONIC is one clock for the whole
machine, so stamps of different processes compare directly. Lines are
written with one `write` on a file opened in append mode, which the kernel
keeps whole between processes. Off (the default), a stamp costs one test.
"""

import json
import os
import time

_file = None  # the open trace file of this process, or None when tracing is off
_pid = None
_role = "server"


def configure(settings, role):
    """Start tracing in this process if `server.trace_file` is set; `role` names it."""
    global _file, _pid, _role
    path = settings["server.trace_file"]
    _role = role
    if not path:
        _file = None
        return
    if _file is not None and _pid == os.getpid() and _file.name == path:
        return
    _file = open(path, "a", buffering=1, encoding="utf-8")
    _pid = os.getpid()


def after_fork(role):
    """In a forked process: keep tracing under its own pid and `role`."""
    global _pid, _role
    _pid = os.getpid()
    _role = role


def stamp(phase, exec_id=None):
    """Record that this process reached `phase` now (for request `exec_id`)."""
    if _file is None:
        return
    line = json.dumps({"t": time.monotonic(), "pid": _pid, "role": _role, "phase": phase,
                       "exec": exec_id})
    try:
        _file.write(line + "\n")
    except OSError:
        pass  # a trace must never fail a request


def read(path):
    """Every stamp of a trace file, in file order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
