"""The cell runs in flight: each request in a child, watched until it ends.

It takes a child of the state's live holder, sends the request, and waits
for the result while enforcing the cell limits from the outside (timeout,
private memory, process count), relaying streamed outputs, and answering
/interrupt: SIGINT first (KeyboardInterrupt in the cell, which also ends
`time.sleep`), SIGKILL after `interrupt_grace_s`. A child that dies on its
own is reported with how it ended; the state it ran from is untouched.
"""

import os
import signal
import threading
import time

import psutil

from snapkernel.kernel import protocol, trace
from snapkernel.kernel.errors import Conflict
from snapkernel.kernel.server.live import WorkerError


class CellRun:
    """One request in flight: its child and what the watchers did to it."""

    def __init__(self, exec_id, timeout=None):
        """Track request `exec_id` (None: not interruptible) with its own cell timeout in
        seconds (None: limits.cell_timeout_s); no child yet."""
        self.exec_id = exec_id
        self.timeout = timeout
        self.child = None
        self.phase = "running"
        self.stopped = None  # (ename, evalue) once a watcher or /interrupt stopped it
        self.started = time.monotonic()
        self.private_before = 0  # private memory of a child that holds its state alone


class CellRuns:
    """Runs requests in children of live states, by exec_id."""

    def __init__(self, settings, pool):
        """Watch runs under `settings`' limits, taking children from `pool`."""
        self.settings = settings
        self.pool = pool
        self.lock = threading.Lock()
        self.running = {}  # exec_id -> Run

    def run(self, manifest, request, on_output=None, cancel=None, timeout=None):
        """Send `request` to a child of `manifest`'s state; (result message, child).

        The result is what the child answered (protocol.CellResult or
        RebuildResult), or `request.failed(...)` saying how the run was
        stopped or could not start; the child is None when none ran it.
        `on_output(item)` receives streamed output items. `cancel` (an Event)
        already set when the request is registered stops it as an interrupt
        would: whoever sets it and then calls `interrupt` cannot miss it.
        `timeout`: this cell's limit in seconds, instead of limits.cell_timeout_s.
        """
        key = request.exec_id
        run = CellRun(key, timeout)
        with self.lock:
            if key is not None and key in self.running:
                raise Conflict(f"exec_id {key!r} is already running")
            if key is not None:
                self.running[key] = run
            if cancel is not None and cancel.is_set():
                run.stopped = ("KeyboardInterrupt", "interrupted before the cell started")
        try:
            try:
                run.child, alone = self._take_child(manifest,
                                                    isinstance(request, protocol.Execute))
            except WorkerError as exc:
                return request.failed(protocol.error(exc.ename, str(exc))), None
            if alone and isinstance(request, protocol.Execute):
                request = request._replace(input_holder=False)
            if alone and self.settings["limits.max_cell_memory_mb"]:
                # The state the child made is its own private memory, not the cell's.
                run.private_before = private_bytes(run.child.pid)
            if run.stopped:
                run.child.kill()
                return request.failed(protocol.error(*run.stopped)), None
            # Stamped before the send: the child may stamp "received" before this thread
            # runs again.
            trace.stamp("sent", key)
            run.child.send(request)
            run.started = time.monotonic()  # cell_timeout_s counts the cell, not a restore
            result = self._wait(run, request, on_output)
            trace.stamp("answer", key)
            return result, run.child
        finally:
            with self.lock:
                if key is not None:
                    self.running.pop(key, None)
            if run.child is not None:
                self.pool.cell_done()

    def _take_child(self, manifest, chain):
        """(a child of the state's live holder, whether it holds the state alone: see
        Pool.take_child), restoring the state anew each time that holder is
        evicted or replaced between being found and giving a child (states
        restored by concurrent requests can evict each other), for at most
        worker_start_timeout_s. `chain`: the request is an Execute."""
        deadline = time.monotonic() + self.settings["workers.worker_start_timeout_s"]
        while True:
            live = self.pool.live_state(manifest)
            try:
                return self.pool.take_child(live, chain)
            except WorkerError:
                if live.alive() or time.monotonic() > deadline:
                    raise

    def _wait(self, run, request, on_output):
        """The child's result, or a failure saying how it was stopped or died."""
        while True:
            try:
                msg = run.child.receive(timeout=0.25)
            except TimeoutError:
                self._watch(run)
                continue
            if msg is None:
                status = self.pool.exit_status(run.child.pid)
                run.child.kill()
                self.pool.child_died(run.child.pid)
                if run.stopped:
                    return request.failed(protocol.error(*run.stopped))
                return request.failed(protocol.error(
                    "WorkerDied", f"the cell's process {status}; the state it ran from is "
                                  f"unchanged: fix the cell, then run it again"))
            if isinstance(msg, protocol.Phase):
                run.phase = msg.phase
            elif isinstance(msg, protocol.Output):
                if on_output is not None:
                    on_output(msg.item)
            else:
                if msg.manifest is None:
                    run.child.kill()
                if isinstance(msg, protocol.CellResult) and msg.answer.error and \
                        run.stopped and run.stopped[0] != "KeyboardInterrupt":
                    # The SIGINT of a timeout surfaces as KeyboardInterrupt: say why.
                    msg.answer.error = protocol.error(*run.stopped)
                return msg

    def _watch(self, run):
        """Enforce cell_timeout_s, max_cell_memory_mb and max_cell_processes on a cell."""
        timeout = run.timeout if run.timeout is not None else \
            self.settings["limits.cell_timeout_s"]
        max_mem = self.settings["limits.max_cell_memory_mb"] * 2 ** 20
        max_procs = self.settings["limits.max_cell_processes"]
        if run.phase != "running" or run.stopped:
            return
        if timeout and time.monotonic() - run.started > timeout:
            self._stop(run, "Timeout", f"the cell ran longer than cell_timeout_s = {timeout} s"
                       if run.timeout is None else
                       f"the cell ran longer than its timeout of {timeout:g} s")
        elif max_mem and private_bytes(run.child.pid) - run.private_before > max_mem:
            # Private pages the cell added: the state shared with the holder is not its.
            run.stopped = ("MemoryLimit", "the cell used more than max_cell_memory_mb = "
                           f"{max_mem // 2 ** 20} MiB")
            run.child.kill()
        elif max_procs and group_processes(run.child.pid) > max_procs + 1:
            run.stopped = ("ProcessLimit", "the cell had more than max_cell_processes = "
                           f"{max_procs} processes alive")
            run.child.kill()

    def _stop(self, run, ename, evalue):
        """SIGINT the run's child now, SIGKILL it after the grace period."""
        if run.stopped is None:
            run.stopped = (ename, evalue)
        try:
            os.kill(run.child.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        threading.Timer(self.settings["workers.interrupt_grace_s"], self._kill_if_running,
                        args=(run,)).start()

    def _kill_if_running(self, run):
        """SIGKILL a child still running its cell after the grace period."""
        if run.phase == "running" and run.child.alive:
            run.child.kill()

    def interrupt(self, exec_id):
        """Stop the run `exec_id`; False if no such run is in its cell."""
        with self.lock:
            run = self.running.get(exec_id)
        if run is None:
            return False
        if run.child is None:
            run.stopped = ("KeyboardInterrupt", "interrupted before the cell started")
            return True
        if run.phase != "running":
            return False
        self._stop(run, "KeyboardInterrupt",
                   "the cell did not stop on SIGINT and was killed after interrupt_grace_s")
        return True


def private_bytes(pid):
    """Private resident memory of a process in bytes (its own pages; 0 if gone)."""
    try:
        return psutil.Process(pid).memory_full_info().uss
    except psutil.Error:
        return 0


def group_processes(pgid):
    """How many processes are in process group `pgid`."""
    count = 0
    for pid in psutil.pids():
        try:
            count += os.getpgid(pid) == pgid
        except OSError:  # gone meanwhile
            pass
    return count
