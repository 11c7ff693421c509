"""Per-cell resource limits: memory and processes.

Two layers enforce `limits.max_cell_memory_mb` and `limits.max_cell_processes`:

- Inside the process that runs the cell, while the cell runs (begin_cell /
  end_cell). Memory: RLIMIT_AS is set to the process's address-space size
  when the cell starts plus the limit, so the inherited state and the LMDB
  map (`max_store_gb` of address space) do not count, and an allocation past
  it fails at once with MemoryError, which is reported as MemoryLimit.
  Processes: when a cgroup v1 `pids` hierarchy is writable (root, as here),
  the cell's process moves into a cgroup of its own with
  pids.max = limit + 1 (its own process included; threads count as tasks
  too), so fork() past the limit fails with EAGAIN (BlockingIOError).
- In the server, every 0.25 s (kernel/server/cell_runs.py): the private
  resident memory of the cell's process (what it allocated or copied, not
  the pages it shares with its state's holder; when the process made the
  state and forked no holder, what it has beyond what it had as the cell
  started) and
  the number of processes
  in its process group. Past a limit the cell is killed (MemoryLimit,
  ProcessLimit). This is the only process bound where no cgroup is
  available (RLIMIT_NPROC does not bind root); a fast fork burst can then
  overshoot for up to one poll.

What is not covered: memory of the cell's child processes (each has its own
RLIMIT_AS, inherited), processes that leave the process group with
setsid() when no cgroup is available, and memory mapped but never touched
by a cell counts against RLIMIT_AS though not against the RSS watchdog.
"""

import os
import resource
import signal

import psutil

_CGROUP_V1_PIDS = "/sys/fs/cgroup/pids"
# The cgroup folder of this zygote's cells (set in the zygote, inherited by forks).
_base = None


def _own_pids_cgroup():
    """This process's folder in the cgroup v1 pids hierarchy, or None."""
    if not os.path.isdir(_CGROUP_V1_PIDS):
        return None
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "pids" in controllers.split(","):
                    return os.path.join(_CGROUP_V1_PIDS, path.lstrip("/"))
    except (OSError, ValueError):
        pass
    return None


def init_zygote():
    """Prepare a cgroup folder for this zygote's cells; sweep those of dead zygotes."""
    global _base
    parent = _own_pids_cgroup()
    if parent is None:
        return
    try:
        for entry in os.listdir(parent):
            if entry.startswith("snapk-") and entry[6:].isdigit() \
                    and not psutil.pid_exists(int(entry[6:])):
                _remove_tree(os.path.join(parent, entry))
        base = os.path.join(parent, f"snapk-{os.getpid()}")
        os.makedirs(base, exist_ok=True)
        _base = base
    except OSError:
        _base = None  # not writable: the server's watchdog is the only bound


def _remove_tree(folder):
    """Remove a cgroup folder and its empty sub-folders (busy ones stay)."""
    for entry in os.listdir(folder):
        path = os.path.join(folder, entry)
        if os.path.isdir(path):
            try:
                os.rmdir(path)
            except OSError:
                pass
    try:
        os.rmdir(folder)
    except OSError:
        pass


def _write(path, text):
    """Write a cgroup control file."""
    with open(path, "w") as f:
        f.write(text)


class Applied:
    """What begin_cell changed, so end_cell can undo it."""

    def __init__(self):
        """Nothing applied yet."""
        self.memory_mb = 0
        self.old_as = None
        self.cgroup = None


def begin_cell(settings):
    """Apply the cell limits to this process; returns what end_cell must undo."""
    applied = Applied()
    memory_mb = settings["limits.max_cell_memory_mb"]
    if memory_mb:
        try:
            old = resource.getrlimit(resource.RLIMIT_AS)
            soft = psutil.Process().memory_info().vms + memory_mb * 2 ** 20
            if old[1] != resource.RLIM_INFINITY:
                soft = min(soft, old[1])
            resource.setrlimit(resource.RLIMIT_AS, (soft, old[1]))
            applied.old_as, applied.memory_mb = old, memory_mb
        except (OSError, ValueError):
            pass
    processes = settings["limits.max_cell_processes"]
    if processes and _base is not None:
        folder = os.path.join(_base, f"cell-{os.getpid()}")
        try:
            _sweep()
            os.makedirs(folder, exist_ok=True)
            _write(os.path.join(folder, "pids.max"), str(processes + 1))
            _write(os.path.join(folder, "cgroup.procs"), str(os.getpid()))
            applied.cgroup = folder
        except OSError:
            pass
    return applied


def _sweep():
    """Remove the empty cgroups of finished cells (a busy one refuses rmdir)."""
    for entry in os.listdir(_base):
        if entry.startswith("cell-"):
            try:
                os.rmdir(os.path.join(_base, entry))
            except OSError:
                pass


def end_cell(applied):
    """Lift the cell's limits from this process (what the cell started stays bounded)."""
    if applied.old_as is not None:
        try:
            resource.setrlimit(resource.RLIMIT_AS, applied.old_as)
        except (OSError, ValueError):
            pass
    if applied.cgroup is not None:
        try:
            # Back to the zygote's folder: this process may become a holder that forks.
            _write(os.path.join(_base, "cgroup.procs"), str(os.getpid()))
            os.rmdir(applied.cgroup)
        except OSError:
            pass  # the cell's leftover processes stay bounded in their cgroup


def run_limited(cell, namespace, execution_count, settings, sink=None):
    """Run a compiled cell under the cell limits, SIGINT raising KeyboardInterrupt.

    Returns (outputs, error) as kernel.worker.execution.run_cell does, with a
    MemoryError under the memory limit named MemoryLimit. A process that the
    cell forked and that returns from it (os.fork() without exec) exits here,
    quietly: only the process the pool forked may answer and store.
    """
    from snapkernel.kernel.worker import execution
    owner = os.getpid()
    applied = begin_cell(settings)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        outputs, error = execution.run_cell(cell, namespace, execution_count, settings, sink)
    finally:
        if os.getpid() != owner:
            os._exit(0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        end_cell(applied)
    if applied.memory_mb and error and error.get("ename") == "MemoryError":
        error = dict(error, ename="MemoryLimit", evalue=(
            f"the cell used more than max_cell_memory_mb = {applied.memory_mb} MiB "
            f"(MemoryError: {error.get('evalue', '')})"))
    return outputs, error
