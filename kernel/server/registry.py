"""The registry of states: names, manifests, executions in flight.

Names are labels on immutable states: executing or rebuilding into an
existing name rebinds it (the state it named is retired). The registry
answers metadata questions from manifests alone, sends cells to children
of the live holders, and watches them: interrupt, timeout, memory limit,
death.
"""

import logging
import os
import signal
import threading
import time
import uuid

from kernel.worker import limits
from kernel.server.pool import Pool, WorkerError
from storage import snapshot
from storage.store import Store

log = logging.getLogger("snapshot_kernel")
INITIAL = "initial"


class KernelError(Exception):
    """A request the kernel refuses: HTTP status, error type, message."""

    def __init__(self, status, etype, message):
        """Keep what the HTTP layer needs."""
        super().__init__(message)
        self.status = status
        self.etype = etype


def _error(ename, evalue):
    """An nbformat-style error with an empty traceback."""
    return {"ename": ename, "evalue": evalue, "traceback": [f"{ename}: {evalue}"]}


class Run:
    """One execution in flight: its child and what the watchers did to it."""

    def __init__(self, child):
        """Track `child` (a WorkerConn)."""
        self.child = child
        self.phase = "running"
        self.stopped = None
        self.started = time.monotonic()


class Kernel:
    """Named states on a store, executed through forked workers."""

    def __init__(self, settings):
        """Open the store, load the manifests, start the worker pool."""
        self.settings = settings
        self.store = Store.for_process(settings["server.data_dir"],
                                       max_store_gb=settings["store.max_store_gb"],
                                       durability=settings["store.durability"],
                                       zstd_level=settings["store.zstd_level"])
        self.lock = threading.RLock()
        self.names = self.store.manifests()
        self._ensure_initial()
        self.running = {}
        self.generation = 0
        self.pool = Pool(settings)
        self.pool.start()

    def _ensure_initial(self):
        """Create the empty `initial` state if the store lacks it."""
        if INITIAL not in self.names:
            manifest = snapshot.new_manifest(INITIAL)
            self.store.put_state(INITIAL, manifest, {})
            self.names[INITIAL] = manifest

    def close(self):
        """Stop every worker process."""
        self.pool.close()

    # Metadata ----------------------------------------------------------------

    def manifest(self, name):
        """The manifest of `name`, or a 404 KernelError."""
        with self.lock:
            manifest = self.names.get(name)
        if manifest is None:
            raise KernelError(404, "StateNotFound", f"no state named {name!r}")
        return manifest

    def list_states(self):
        """Every state name, oldest first."""
        with self.lock:
            items = list(self.names.items())
        return [n for n, _ in sorted(items, key=lambda kv: kv[1]["created"])]

    def describe(self, name):
        """What GET /states/NAME shows."""
        m = self.manifest(name)
        live = m["id"] in self.pool.live_ids()
        return {"name": name, "timestamp": m["timestamp"], "variables": m["variables"],
                "modules": m["modules"], "parent": m["parent"],
                "execution_count": m["execution_count"],
                "volatile_symbols": sorted(m["volatile"]), "live": live,
                "python": m["python"]}

    def symbol_hashes(self, name, symbols_, hash_algo=None):
        """Stored hashes of `symbols_` in state `name` (None where absent)."""
        if hash_algo not in (None, "full"):
            raise KernelError(400, "BadRequest", f"unsupported hash_algo {hash_algo!r}; "
                                                 f"only 'full' is supported")
        m = self.manifest(name)
        return {s: snapshot.symbol_hash(m, s) for s in symbols_}

    def alias_groups(self, name):
        """Every variable's alias group and each group's fingerprint."""
        return _groups_of(self.manifest(name))

    def delete(self, name):
        """Remove a named state (its blobs go at the next garbage collection)."""
        if name == INITIAL:
            raise KernelError(409, "Conflict", "the initial state cannot be deleted")
        manifest = self.manifest(name)
        with self.lock:
            if self.names.get(name) is manifest:
                del self.names[name]
        self.store.delete_states([name])
        self.pool.retire(manifest["id"])

    def reset(self):
        """Drop every state and blob; only an empty `initial` remains."""
        with self.lock:
            self.generation += 1
            self.pool.reset()
            self.store.clear()
            self.names = {}
            self._ensure_initial()

    # Executions --------------------------------------------------------------

    def execute(self, code, exec_id, state_name, new_name=None):
        """Run `code` from `state_name`; on success name the new state `new_name`."""
        auto = new_name is None
        new_name = new_name or uuid.uuid4().hex
        with self.lock:
            manifest = self.names.get(state_name)
        if manifest is None:
            return _empty_answer(_error("StateNotFound", state_name))
        request = {"op": "execute", "code": code, "new_name": new_name, "auto_named": auto}
        answer, child = self._run(manifest, request, exec_id)
        if answer.get("store_full"):
            raise KernelError(507, "StoreFull", answer["error"]["evalue"])
        result = {k: answer.get(k) for k in (
            "output", "state_name", "error", "accessed_symbols", "modified_symbols",
            "deleted_symbols", "execution_count", "volatile_symbols")}
        if answer.get("manifest") is not None:
            self._bind(answer["manifest"], child, answer["generation"])
        return result

    def multistate_execute(self, code, exec_id, mapping, default_state=None):
        """Run `code` with states under aliases and `default_state`'s names; store nothing."""
        with self.lock:
            base = self.names.get(default_state if default_state is not None else INITIAL)
            aliases = {a: self.names.get(s) for a, s in mapping.items()}
        missing = [s for s, m in [(default_state, base)] + [
            (mapping[a], m) for a, m in aliases.items()] if m is None]
        if missing:
            return _empty_answer(_error("StateNotFound", missing[0]))
        request = {"op": "multistate", "code": code, "aliases": aliases}
        answer, _ = self._run(base, request, exec_id)
        result = {k: answer.get(k) for k in (
            "output", "error", "accessed_symbols", "modified_symbols", "deleted_symbols")}
        result["state_name"] = None
        return result

    def rebuild(self, input_state, source_state, source_vars, input_vars, new_name=None):
        """Make a state of `source_vars` from one state and `input_vars` from another."""
        auto = new_name is None
        new_name = new_name or uuid.uuid4().hex
        base = self.manifest(input_state)
        source = self.manifest(source_state)
        request = {"op": "rebuild", "source_manifest": source, "source_vars": source_vars,
                   "input_vars": input_vars, "new_name": new_name, "auto_named": auto}
        answer, child = self._run(base, request, None)
        if answer.get("error"):
            err = answer["error"]
            raise KernelError(500 if err["ename"] != "StoreFull" else 507,
                              err["ename"], err["evalue"])
        manifest = answer["manifest"]
        self._bind(manifest, child, answer["generation"])
        return dict(state_name=new_name, **_groups_of(manifest))

    def _bind(self, manifest, child, generation):
        """Point the manifest's name at it and keep its child as the live holder."""
        with self.lock:
            if generation != self.generation:
                child.kill()
                self.store.delete_states([manifest["name"]])
                self.pool.retire(manifest["id"])
                return
            old = self.names.get(manifest["name"])
            self.names[manifest["name"]] = manifest
        self.pool.adopt(manifest["id"], child, made=True)
        if old is not None and old["id"] != manifest["id"]:
            self.pool.retire(old["id"])

    def _run(self, manifest, request, exec_id):
        """Send `request` to a child of the state's holder and wait for its answer."""
        key = None if exec_id is None else str(exec_id)
        with self.lock:
            if key is not None and key in self.running:
                raise KernelError(409, "Conflict", f"exec_id {exec_id!r} is already running")
            run = Run(None)
            if key is not None:
                self.running[key] = run
            generation = self.generation
        try:
            try:
                run.child = self._take_child(manifest)
            except WorkerError as exc:
                return _empty_answer(_error(exc.ename, str(exc))), None
            if run.stopped:
                run.child.kill()
                return _empty_answer(_error("KeyboardInterrupt", "interrupted")), None
            run.child.send(request)
            run.started = time.monotonic()  # cell_timeout_s counts the cell, not a restore
            answer = self._wait(run)
            answer["generation"] = generation
            return answer, run.child
        finally:
            with self.lock:
                if key is not None:
                    self.running.pop(key, None)
            if run.child is not None:
                self.pool.cell_done()

    def _take_child(self, manifest):
        """A child of the state's live holder, restoring the state once more if that
        holder was evicted or replaced between being found and being asked."""
        holder = self.pool.holder(manifest)
        try:
            return self.pool.take_child(holder)
        except WorkerError:
            if holder.alive():
                raise
            return self.pool.take_child(self.pool.holder(manifest))

    def _wait(self, run):
        """The child's answer, or an error saying how it was stopped or died."""
        timeout = self.settings["limits.cell_timeout_s"]
        max_mem = self.settings["limits.max_cell_memory_mb"] * 2 ** 20
        while True:
            try:
                msg = run.child.messages.get(timeout=0.25)
            except Exception:
                msg = False
            if msg is None:
                status = self.pool.exit_status(run.child.pid)
                run.child.kill()
                if run.stopped:
                    return _empty_answer(_error(*run.stopped))
                return _empty_answer(_error("WorkerDied", f"the cell's process {status}"))
            if msg is False:
                self._watch(run, timeout, max_mem)
                continue
            if msg["op"] == "phase":
                run.phase = msg["phase"]
                continue
            if msg["op"] == "result":
                if msg.get("manifest") is None:
                    run.child.kill()
                if run.stopped and run.stopped[0] != "KeyboardInterrupt" and msg.get("error"):
                    # The SIGINT of a timeout surfaces as KeyboardInterrupt: say why.
                    msg["error"] = _error(*run.stopped)
                return msg

    def _watch(self, run, timeout, max_mem):
        """Enforce cell_timeout_s, max_cell_memory_mb and max_cell_processes on a cell."""
        max_procs = self.settings["limits.max_cell_processes"]
        if run.phase != "running" or run.stopped:
            return
        if timeout and time.monotonic() - run.started > timeout:
            run.stopped = ("Timeout", f"the cell ran longer than cell_timeout_s = {timeout} s")
            self._signal(run, signal.SIGINT)
            threading.Timer(self.settings["workers.interrupt_grace_s"], self._kill_if_running,
                            args=(run,)).start()
        elif max_mem and limits.private_bytes(run.child.pid) > max_mem:
            # Private pages only: the state shared with the holder is not the cell's.
            run.stopped = ("MemoryLimit", "the cell used more than max_cell_memory_mb = "
                           f"{max_mem // 2 ** 20} MiB")
            run.child.kill()
        elif max_procs and limits.group_processes(run.child.pid) > max_procs + 1:
            run.stopped = ("ProcessLimit", "the cell had more than max_cell_processes = "
                           f"{max_procs} processes alive")
            run.child.kill()

    def _signal(self, run, sig):
        """Send `sig` to a running child."""
        try:
            os.kill(run.child.pid, sig)
        except ProcessLookupError:
            pass

    def _kill_if_running(self, run):
        """SIGKILL a child still running its cell after the grace period."""
        if run.phase == "running" and run.child.alive:
            run.child.kill()

    def interrupt(self, exec_id):
        """SIGINT the child running `exec_id`, then SIGKILL after the grace period."""
        with self.lock:
            run = self.running.get(str(exec_id))
        if run is None:
            return False
        if run.child is None:
            run.stopped = ("KeyboardInterrupt", "interrupted before the cell started")
            return True
        if run.phase != "running":
            return False
        if run.stopped is None:
            run.stopped = ("KeyboardInterrupt", "the cell did not stop on SIGINT and was "
                           "killed after interrupt_grace_s")
        self._signal(run, signal.SIGINT)
        threading.Timer(self.settings["workers.interrupt_grace_s"], self._kill_if_running,
                        args=(run,)).start()
        return True


def _empty_answer(error):
    """An execute answer carrying only an error."""
    return {"output": [], "state_name": None, "error": error, "accessed_symbols": [],
            "modified_symbols": [], "deleted_symbols": []}


def _groups_of(manifest):
    """{groups, fingerprints} of a manifest: every variable in exactly one group."""
    groups = [(g["members"], g["fingerprint"]) for g in manifest["groups"]]
    for name in manifest["modules"]:
        groups.append(([name], snapshot.symbol_hash(manifest, name)))
    for name in manifest["volatile"]:
        groups.append(([name], None))
    groups.sort(key=lambda g: g[0][0])
    return {"groups": [g for g, _ in groups], "fingerprints": [f for _, f in groups]}
