"""Fresh runs: every code cell from scratch, in a new interpreter, within limits.

A fresh run starts machinery of its own: a Registry (kernel/server/) on a
temporary store, whose pool spawns a brand-new zygote interpreter in the
run's explicit environment and working directory (kernel/notebook/
environment.py). Its cells are model.NotebookCell, its options a
model.FreshOptions. No warm zygote (of third-party modules, only the kernel's
own, such as lmdb and cloudpickle, are imported before the notebook imports
anything), no spare children, one live state at a time. The code cells
run in order, each from the state the previous one made, starting from the
empty `initial`; in practice all of them in one process, the child that
ran the first cell (kernel/server/pool.py: the child that made a state
takes its next cell).

The caller's thread watches while a thread of the run's own executes the
cells: the whole-run deadline (SIGINT to the running cell, SIGKILL to
everything after interrupt_grace_s), the memory fuse (the summed Pss of the
run's processes, polled: kills at once), and the processes the run started
(kernel/notebook/processes.py), which it kills and reaps at the end,
whatever happened, within the cleanup allowance. The output retained for the
whole run is bounded by max_output_bytes: the worker cuts one cell's output
one byte past that size as it writes (display.max_output_bytes), and the run fails as
soon as a cell's outputs would take the total past it.

A run fails with exactly one category (kernel/notebook/receipt.py
CATEGORIES); receipt.build turns the run into its receipt. A run asked for
over HTTP is `run_request`; one of a file, fresh_file.run_file.
"""

import dataclasses
import hashlib
import json
import linecache
import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time

from snapkernel.kernel import protocol
from snapkernel.kernel.errors import InvalidRequest, Refused
from snapkernel.kernel.notebook import environment, ipynb, parameters as params, processes
from snapkernel.kernel.notebook import model, receipt
from snapkernel.kernel.notebook.model import SKIP_TAGS, CellStatus, NotebookRun
from snapkernel.kernel.protocol import ExecuteAnswer
from snapkernel.kernel.server.registry import Registry
from snapkernel.kernel.worker.process import worker_env
from snapkernel.storage.store import StoreError

MAX_CLEANUP_S = 30
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
# Seconds the cells' thread gets to notice its processes were killed before the run
# stops waiting for it (a thread blocked in a kernel's start is left behind).
_JOIN_AFTER_KILL_S = 1.0

# Error names of a cell's answer that have a category of their own (others: CELL_ERROR).
_CATEGORY_OF_ENAME = {"Timeout": "CELL_TIMEOUT", "WorkerDied": "WORKER_DIED",
                      "WorkerStartFailed": "WORKER_DIED", "MemoryLimit": "MEMORY_FUSE"}


@dataclasses.dataclass
class Limits:
    """The limits of one run (config.toml [fresh], overridden per run)."""
    timeout_s: float
    cell_timeout_s: float
    max_output_bytes: int
    max_code_cells: int
    memory_fuse_mb: int
    cleanup_s: float

    @classmethod
    def of(cls, settings, timeout_s=None, cell_timeout_s=None):
        """The limits in `settings`, with the per-run deadline and cell timeout if given;
        Refused(BAD_INPUT) naming a value out of range."""
        limits = cls(
            timeout_s=settings["fresh.timeout_s"] if timeout_s is None else timeout_s,
            cell_timeout_s=(settings["fresh.cell_timeout_s"] if cell_timeout_s is None
                            else cell_timeout_s),
            max_output_bytes=settings["fresh.max_output_bytes"],
            max_code_cells=settings["fresh.max_code_cells"],
            memory_fuse_mb=settings["fresh.memory_fuse_mb"],
            cleanup_s=settings["fresh.cleanup_s"])
        if not all(math.isfinite(v) for v in (limits.timeout_s, limits.cell_timeout_s)):
            raise Refused("BAD_INPUT", "the timeouts must be finite numbers of seconds")
        if not limits.timeout_s > 0:
            raise Refused("BAD_INPUT", f"the run's timeout must be more than 0 s, "
                                       f"not {limits.timeout_s}")
        if not limits.cell_timeout_s >= 0:
            raise Refused("BAD_INPUT", f"the cell timeout must be 0 (none) or more, "
                                       f"not {limits.cell_timeout_s}")
        if not 0 < limits.cleanup_s <= MAX_CLEANUP_S:
            raise Refused("BAD_INPUT", f"fresh.cleanup_s must be more than 0 and at most "
                                       f"{MAX_CLEANUP_S} s, not {limits.cleanup_s}")
        for name in ("max_output_bytes", "max_code_cells", "memory_fuse_mb"):
            if getattr(limits, name) <= 0:
                raise Refused("BAD_INPUT", f"fresh.{name} must be more than 0")
        return limits


def is_empty(cell):
    """True when the cell holds nothing but blank lines and comments: running it would
    prove nothing, so it neither runs nor counts."""
    return all(not line.strip() or line.lstrip().startswith("#")
               for line in cell.source.splitlines())


def output_size(output):
    """The bytes an output counts for: its JSON, compact, UTF-8."""
    return len(json.dumps(output, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass"))


class FreshRun:
    """One fresh run of `cells` (model.NotebookCell, each NOT_RUN until taken).

    `settings` is the configuration (kernel.config.load); `options` a
    model.FreshOptions: `env` the names to pass from the caller's
    environment besides the configured ones (each must be set), `cwd` the
    working directory, `expected_environment` the environment SHA-256 the
    interpreter must have, `keep_states` a folder that keeps the run's store
    (None: a temporary one); `limits` a Limits (default: from `settings` and
    the options' timeouts); `adopt_orphans`: make this process a child
    subreaper, and at the end kill and reap every process below it (only for
    a process whose only children are the run's: the command line);
    `on_cell(cell)` is called as each cell ends; `cancel` (a threading.Event),
    once set, interrupts the running cell and ends the run.

    `run()` never raises for what the notebook does; afterwards `category`
    (None on success), `message`, `cells`, `interpreter`, `output_bytes` and
    `cleanup` describe the run.
    """

    def __init__(self, cells, settings, options, limits=None, adopt_orphans=False,
                 on_cell=None, cancel=None):
        """Prepare the run; nothing starts before `run()`."""
        self.cancel = cancel or threading.Event()
        self.cells = cells
        self.settings = settings
        self.limits = limits
        self.variables = list(options.env)
        self.cwd = options.cwd
        self.expected_environment = options.expected_environment
        self.keep_states = options.keep_states
        self.adopt_orphans = adopt_orphans
        self.on_cell = on_cell
        self.category = None
        self.message = ""
        self.interpreter = None  # what environment.interpreter_identity measured
        self.env_names = []
        self.output_bytes = 0
        self.peak_bytes = 0
        self.cleanup = {"status": "ok", "seconds": 0.0, "processes_observed": 0,
                        "processes_left": 0, "files_removed": True}
        self.started_at = model.now()
        self.ended_at = None
        self.seconds = 0.0
        self.lock = threading.Lock()
        self.stop = None  # (category, message) once the run must end early
        self.abandoned = False  # the cells' thread is no longer waited for
        self.registry = None
        self.tracker = None
        self.running_exec = None

    @property
    def success(self):
        """True when the run ended without a failure category."""
        return self.ended_at is not None and self.category is None

    def refuse(self, category, message):
        """Fail the run before it starts (the first refusal wins)."""
        if self.category is None:
            self.category, self.message = category, message

    def run(self):
        """Run the notebook, then clean up; returns self."""
        start = time.monotonic()
        for cell in self.cells:
            cell.status, cell.took_s = CellStatus.NOT_RUN, 0.0
        if self.category is None:
            try:
                self._check_input()
            except Refused as exc:
                self.refuse(exc.category, str(exc))
        if self.category is None:
            workdir = tempfile.mkdtemp(prefix="snapk-fresh-")
            try:
                self._run(workdir, start + self.limits.timeout_s)
            except Refused as exc:
                self.refuse(exc.category, str(exc))
            finally:
                self._clean_up(workdir)
        self.ended_at = model.now()
        self.seconds = round(time.monotonic() - start, 3)
        return self

    # Before anything starts ------------------------------------------------------

    def _check_input(self):
        """Refused(BAD_INPUT) for a problem of the request itself."""
        if self.limits is None:
            self.limits = Limits.of(self.settings)
        if not self.settings["fresh.poll_s"] > 0:
            raise Refused("BAD_INPUT", "fresh.poll_s must be more than 0")
        if self.cwd is not None and not os.path.isdir(self.cwd):
            raise Refused("BAD_INPUT", f"the working directory {self.cwd} is not a folder")
        expected = self.expected_environment
        if expected is not None and not _SHA256.match(expected):
            self.expected_environment = None  # the receipt's field holds a hash or null
            raise Refused("BAD_INPUT", "the expected environment must be a SHA-256 in hex "
                                       "(64 characters 0-9a-f)")
        if self.keep_states is not None and os.path.exists(self.keep_states) and \
                (not os.path.isdir(self.keep_states) or os.listdir(self.keep_states)):
            raise Refused("BAD_INPUT", f"{self.keep_states} must be a new or empty folder "
                                       f"to keep the run's states in")

    def _check_cells(self):
        """Refused for a notebook that cannot succeed, before any cell runs."""
        if len(self.cells) > self.limits.max_code_cells:
            raise Refused("TOO_MANY_CELLS", f"the notebook has {len(self.cells)} code cells, "
                                            f"more than max_code_cells = "
                                            f"{self.limits.max_code_cells}")
        for cell in self.cells:
            if cell.skip:
                cell.status = CellStatus.SKIPPED
            elif is_empty(cell):
                cell.status = CellStatus.EMPTY
        statuses = {c.status for c in self.cells}
        if statuses <= {CellStatus.EMPTY}:
            raise Refused("NO_CODE", "the notebook has no code to run (its code cells, if "
                                     "any, are empty or only comments)")
        if CellStatus.NOT_RUN not in statuses:
            raise Refused("ALL_SKIPPED", "every code cell with code is tagged "
                                         f"{' or '.join(SKIP_TAGS)}: nothing would run")
        # Syntax is checked for every cell before any runs: a run that cannot succeed
        # has no side effects.
        from snapkernel.kernel.worker.execution import compile_cell
        for cell in self.cells:
            if cell.status != CellStatus.NOT_RUN:
                continue
            compiled = compile_cell(cell.source, 0)
            linecache.cache.pop(compiled.filename, None)
            if compiled.error is not None:
                cell.status, cell.category = CellStatus.FAILED, "SYNTAX_ERROR"
                cell.error = compiled.error
                raise Refused("SYNTAX_ERROR", f"{_name(cell)} does not compile: "
                                              f"{compiled.error['ename']}: "
                                              f"{compiled.error['evalue']}")

    # The run -----------------------------------------------------------------

    def _run(self, workdir, deadline):
        """Check, start the kernel, run the cells while watching them."""
        try:
            env = environment.explicit(os.path.join(workdir, "home"),
                                       os.path.join(workdir, "tmp"),
                                       self.settings["fresh.env"], self.variables)
        except environment.EnvironmentRefused as exc:
            raise Refused("BAD_INPUT", str(exc)) from None
        self.env_names = sorted(env)
        cwd = self.cwd or os.path.join(workdir, "home")
        try:
            self.interpreter = environment.interpreter_identity(worker_env(env), cwd,
                                                      deadline - time.monotonic())
        except subprocess.TimeoutExpired:
            raise Refused("RUN_TIMEOUT", "the deadline passed while the kernel's environment "
                                         "was measured") from None
        except environment.ProbeFailed as exc:
            raise Refused("WORKER_DIED", str(exc)) from None
        expected = self.expected_environment
        if expected is not None and expected != self.interpreter["environment_sha256"]:
            raise Refused("ENVIRONMENT_MISMATCH",
                          f"the kernel's environment is {self.interpreter['environment_sha256']}, "
                          f"not the expected {expected}: run it in the expected "
                          f"environment, or expect this one if the change is meant")
        self._check_cells()
        if self.adopt_orphans:
            from snapkernel.kernel.worker.process import PR_SET_CHILD_SUBREAPER, prctl
            prctl(PR_SET_CHILD_SUBREAPER, 1)
        data_dir = self.keep_states or os.path.join(workdir, "store")
        overrides = {
            "server.data_dir": os.path.abspath(data_dir),
            "store.durability": "async",  # a temporary store: no flush per cell
            "workers.warm_zygote": False,
            "workers.spare_children": 0,
            "workers.max_live_states": 1,
            "limits.cell_timeout_s": float(self.limits.cell_timeout_s),
            # One byte past the run's limit: a cell's output cut there is more than
            # the run may keep, so it fails the run (a cut at display.max_output_bytes,
            # below the limit, would have let a cell that printed 20 MB pass).
            "display.max_output_bytes": self.limits.max_output_bytes + 1,
        }
        try:
            self.registry = Registry(dict(self.settings, **overrides), env=env, cwd=cwd)
        except (StoreError, OSError) as exc:
            raise Refused("WORKER_DIED", f"the run's kernel could not start: {exc}") from None
        self.tracker = processes.Tracker(self.registry.worker_root())
        worker = threading.Thread(target=self._execute_all, name="fresh-cells", daemon=True)
        worker.start()
        self._watch(worker, deadline)

    def _execute_all(self):
        """The cells' thread: each cell from the state the previous one made."""
        state = "initial"
        for cell in self.cells:
            with self.lock:
                if self.stop or self.abandoned or cell.status != CellStatus.NOT_RUN:
                    if cell.status != CellStatus.NOT_RUN and self.on_cell:
                        self.on_cell(cell)
                    continue
                cell.status = CellStatus.RUNNING
                self.running_exec = f"fresh-{cell.index}"
            started = time.monotonic()
            busy = model.timing_stamp()
            try:
                answer = self.registry.execute(cell.source, self.running_exec, state, cell.id)
            except Exception as exc:  # the machinery failed (the store, a worker's start)
                answer = ExecuteAnswer.failed(protocol.error(
                    "WorkerDied", f"{type(exc).__name__}: {exc}"))
            with self.lock:
                if self.abandoned:
                    return
                cell.took_s = round(time.monotonic() - started, 3)
                cell.execution = model.timings(busy, model.timing_stamp())
                self._record(cell, answer)
                self.running_exec = None
            if self.on_cell:
                self.on_cell(cell)
            if cell.status == CellStatus.FAILED:
                with self.lock:
                    self._halt(cell.category, f"{_name(cell)} failed: {cell.error['ename']}")
                continue
            state = answer.state_name

    def _record(self, cell, answer):
        """Keep a cell's answer: its outputs within the run's budget, its status."""
        cell.execution_count = answer.execution_count
        for output in answer.output:
            size = output_size(output)
            if self.output_bytes + size > self.limits.max_output_bytes:
                self._halt("OUTPUT_LIMIT", f"the outputs went past max_output_bytes = "
                                           f"{self.limits.max_output_bytes}")
                break
            cell.outputs.append(output)
            self.output_bytes += size
        error = answer.error
        if error is None and self.stop and self.stop[0] == "OUTPUT_LIMIT":
            error = protocol.error("OutputLimit", self.stop[1])
        if error is None:
            cell.status = CellStatus.RAN
            return
        cell.status, cell.error = CellStatus.FAILED, error
        cell.category = self.stop[0] if self.stop else _CATEGORY_OF_ENAME.get(
            error["ename"], "CELL_ERROR")

    def _halt(self, category, message):
        """End the run early with `category` (the first reason wins; lock held)."""
        if self.stop is None:
            self.stop = (category, message)

    def _watch(self, worker, deadline):
        """Wait for the cells' thread, enforcing the deadline and the memory fuse."""
        grace = self.settings["workers.interrupt_grace_s"]
        fuse = self.limits.memory_fuse_mb * 2 ** 20
        kill_at = None
        while True:
            worker.join(self.settings["fresh.poll_s"])
            if not worker.is_alive():
                break
            memory = self.tracker.sample()
            now = time.monotonic()
            with self.lock:
                if memory > fuse:
                    self._halt("MEMORY_FUSE", f"the run's processes used more than "
                                              f"memory_fuse_mb = {self.limits.memory_fuse_mb} "
                                              f"MiB")
                    kill_at = now
                elif kill_at is None and (now > deadline or self.cancel.is_set()):
                    if now > deadline:
                        self._halt("RUN_TIMEOUT", f"the run took longer than its deadline "
                                                  f"of {self.limits.timeout_s} s")
                    else:
                        self._halt("CELL_ERROR", "the run was interrupted")
                    exec_id = self.running_exec
                    # An interrupted cell is killed after the grace period by the
                    # registry; anything else (a kernel still starting) at once.
                    interrupted = exec_id is not None and self.registry.interrupt(exec_id)
                    kill_at = now + grace + 1 if interrupted else now
            if kill_at is not None and now >= kill_at:
                self.tracker.kill_all(now + self.limits.cleanup_s)
                worker.join(_JOIN_AFTER_KILL_S)
                break
        self.tracker.sample()  # a run shorter than a poll is observed at least once
        self.peak_bytes = self.tracker.peak_bytes
        with self.lock:
            self.abandoned = True
            for cell in self.cells:
                if cell.status == CellStatus.RUNNING:
                    cell.status = CellStatus.FAILED
                    cell.category = self.stop[0] if self.stop else "WORKER_DIED"
                    cell.error = protocol.error(cell.category, self.stop[1] if self.stop
                                                else "the cell did not finish")
            if self.stop:
                self.category, self.message = self.stop

    # Cleanup -------------------------------------------------------------------

    def _clean_up(self, workdir):
        """Kill and reap every process the run started, remove its files; within the
        cleanup allowance. A failure here is CLEANUP_FAILED if nothing failed before."""
        start = time.monotonic()
        deadline = start + self.limits.cleanup_s
        left = set()
        if self.registry is not None:
            self.tracker.kill_all(deadline)
            self.registry.close()  # kills the zygote (the subreaper), releases the store
            if self.adopt_orphans:
                # Anything that escaped the zygote reached this process, a subreaper.
                processes.Tracker(os.getpid()).kill_all(deadline)
            while True:
                left = self.tracker.alive()
                if not left or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        shutil.rmtree(workdir, ignore_errors=True)
        removed = not os.path.exists(workdir)
        self.cleanup = {
            "status": "ok" if removed and not left else "failed",
            "seconds": round(time.monotonic() - start, 3),
            "processes_observed": len(self.tracker.seen) if self.tracker else 0,
            "processes_left": len(left),
            "files_removed": removed}
        if self.cleanup["status"] == "failed":
            what = f"{len(left)} process(es) still alive" if left else \
                f"the run's temporary folder {workdir} could not be removed"
            self.refuse("CLEANUP_FAILED", f"cleanup failed: {what}")


def _name(cell):
    """How messages name a cell."""
    return f"cell {cell.index} (id {cell.id})"


def source_digest(cells):
    """SHA-256 of a notebook given as cells (the API): over their ids, sources and tags."""
    canonical = json.dumps([{"id": c.id, "source": c.source, "skip": c.skip} for c in cells],
                           sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def run_request(request, settings, on_cell=None):
    """A fresh run asked for over HTTP (POST /notebooks/run with "fresh": true): the
    run's NotebookRun, with its receipt; InvalidRequest for bad input.

    The notebook comes as its code cells; its source SHA-256 in the receipt
    is over their ids, sources and skip flags (the injected parameters' cell
    among them). `on_cell(cell)` is called as
    each cell ends. Fresh runs keep no state, so
    every `state_name` and `key` is null.
    """
    options = request.fresh
    request.check()
    request = dataclasses.replace(request, cells=params.inject(request.cells,
                                                               request.parameters))
    if options.cwd is not None and not os.path.isabs(options.cwd):
        raise InvalidRequest("cwd must be an absolute path on the server")
    try:
        limits = Limits.of(settings, options.timeout, options.cell_timeout)
    except Refused as exc:
        raise InvalidRequest(str(exc)) from None
    run = FreshRun(request.cells, settings, options, limits, on_cell=on_cell).run()
    if run.category == "BAD_INPUT":
        raise InvalidRequest(run.message)
    return NotebookRun(
        request.notebook, run.cells, exec_id=request.exec_id, running=False,
        started=run.started_at, finished=run.ended_at,
        order=[c.id for c in run.cells if c.status in (CellStatus.RAN, CellStatus.FAILED)],
        language_info=None if run.interpreter is None else ipynb.language_info(
            run.interpreter["python_version"]),
        receipt=receipt.build(run, {"path": None, "sha256": source_digest(run.cells)},
                              cwd=options.cwd, parameters=request.parameters))
