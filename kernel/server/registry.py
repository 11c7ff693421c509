"""The registry of states: names, manifests, and the requests that make states.

Names are labels on immutable states: executing or rebuilding into an
existing name rebinds it (the state it named is retired). The registry
answers metadata questions from manifests alone; requests that run code
go through the cell runs (cell_runs.py) to children of the live holders.
"""

import hashlib
import json
import logging
import os
import threading
import uuid

from snapkernel.kernel import protocol, trace
from snapkernel.kernel.errors import Conflict, InvalidRequest, RequestFailed, ServerStopping, StateNotFound
from snapkernel.kernel.protocol import ExecuteAnswer
from snapkernel.kernel.server.pool import Pool
from snapkernel.kernel.files import sha256_file
from snapkernel.kernel.server.cell_runs import CellRuns
from snapkernel.storage import snapshot
from snapkernel.storage.cache import open_store
from snapkernel.storage.remote_names import RemoteNames
from snapkernel.storage.remote import NameConflict, RemoteUnavailable
from snapkernel.storage.store import BlobMissing, NewerFormat, Store, StoreCorrupt, StoreFull

log = logging.getLogger("snapshot_kernel")

INITIAL = "initial"
# A state's name is the LMDB key of its manifest, and LMDB keys are at most 511 bytes.
MAX_NAME_BYTES = 511


class Registry:
    """Named states on a store, executed through forked workers."""

    def __init__(self, settings, env=None, cwd=None, pool=None):
        """Open the store, load the manifests, start the worker pool (its zygote in
        environment `env` and folder `cwd`: see Pool), or take `pool`, started
        already: the server starts its zygote first, so that it starts while the
        server imports its routes and opens the store."""
        self.settings = settings
        self.store = open_store(settings)
        # With store.remote: the names other servers bind, and this one's queued uploads.
        self.shared = RemoteNames(self.store, settings) if settings["store.remote"] else None
        if self.shared:
            self.shared.start()
        self.lock = threading.RLock()
        # A damaged manifest does not stop the server: every other state is served.
        self.damaged = []  # StoreCorrupt of each state left out
        self.names = self.store.manifests(self.damaged)
        for problem in self.damaged:
            log.error("%s; that state is left out", problem)
        self._ensure_initial()
        self.generation = 0  # bumped by reset: results of runs started before it are void
        self.closed = False
        self.pool = pool or Pool(settings, env, cwd)
        self.cell_runs = CellRuns(settings, self.pool)
        if pool is None:
            self.pool.start()

    def _ensure_initial(self):
        """Create the empty `initial` state if the store lacks it."""
        if INITIAL not in self.names:
            manifest = snapshot.new_manifest(INITIAL)
            self.store.put_state(INITIAL, manifest, {})
            self.names[INITIAL] = manifest

    def close(self):
        """Stop every worker process; flush the store to disk (states written since the
        last flush: with durability = "async", or by a notebook run cut short);
        close this process's handle on it. Once: later calls do nothing."""
        if self.closed:
            return
        self.closed = True
        self.pool.close()
        self.store.sync()
        Store.release(self.settings["server.data_dir"])

    # Metadata ----------------------------------------------------------------

    def manifest(self, name):
        """The manifest of `name`; StateNotFound if there is none."""
        manifest = self._lookup(name)
        if manifest is None:
            raise StateNotFound(f"no state named {name!r} (GET /states lists them)")
        return manifest

    def _lookup(self, name):
        """The manifest of `name`, or None; with a remote, its current binding there."""
        self._refresh()
        with self.lock:
            manifest = self.names.get(name)
        if manifest is None and self.shared:
            self._refresh(name)
            with self.lock:
                manifest = self.names.get(name)
        return manifest

    def _refresh(self, name=None):
        """Take in the names other servers bound, rebound or deleted on the remote."""
        changes = self.shared.changes(name) if self.shared else {}
        retired = []
        with self.lock:
            for changed, manifest in changes.items():
                old = self.names.pop(changed, None)
                if manifest is not None:
                    self.names[changed] = manifest
                if old is not None and (manifest is None or old["id"] != manifest["id"]):
                    retired.append(old["id"])
        for state_id in retired:
            self.pool.retire(state_id)

    def list_states(self):
        """Every state name, oldest first."""
        self._refresh()
        with self.lock:
            items = list(self.names.items())
        return [n for n, _ in sorted(items, key=lambda kv: kv[1]["created"])]

    def has_state(self, name):
        """True when a state of that name exists."""
        return self._lookup(name) is not None

    def is_live(self, name):
        """True when the state `name` has a live holder (running from it needs no
        restore); False for an unknown name too."""
        manifest = self._lookup(name)
        return manifest is not None and manifest["id"] in self.pool.live_ids()

    def worker_root(self):
        """The pid of the process every worker of this registry descends from (its
        zygote, a child subreaper): the root of the registry's process tree."""
        return self.pool.zygote_proc.pid

    def describe(self, name):
        """What GET /states/NAME shows."""
        m = self.manifest(name)
        return {"name": name, "timestamp": m["timestamp"], "variables": m["variables"],
                "modules": m["modules"], "parent": m["parent"],
                "execution_count": m["execution_count"],
                "volatile_symbols": sorted(m["volatile"]),
                # Open files, sockets, processes...: what a restore gives back closed.
                "inert": snapshot.inert(m),
                "live": m["id"] in self.pool.live_ids(), "python": m["python"],
                # A state made before any cell chose a folder runs in the server's.
                "cwd": m.get("cwd") or self.pool.cwd or os.getcwd(),
                "context": sorted(m.get("context") or {}),
                # Attributes cells set on modules whose values could not be stored.
                "unkept": m.get("unkept") or [],
                "local_modules": _local_modules(m)}

    def symbol_hashes(self, name, symbols, hash_algo=None):
        """Stored hashes of `symbols` in state `name` (None where absent)."""
        if hash_algo not in (None, "full"):
            raise InvalidRequest(f"unsupported hash_algo {hash_algo!r}; only 'full' is "
                                 f"supported")
        m = self.manifest(name)
        return {s: snapshot.symbol_hash(m, s) for s in symbols}

    def alias_groups(self, name):
        """Every variable's alias group and each group's fingerprint."""
        return _groups_of(self.manifest(name))

    def delete(self, name):
        """Remove a named state (its blobs go at the next garbage collection)."""
        if name == INITIAL:
            raise Conflict("the initial state cannot be deleted")
        manifest = self.manifest(name)
        if self.shared:
            try:
                self.shared.delete(name)
            except NameConflict:
                self._refresh(name)
                raise
        # The store first: on a full disk the delete can fail (507), and the name
        # must then still be listed, as it is still stored.
        self.store.delete_states([name])
        with self.lock:
            if self.names.get(name) is manifest:
                del self.names[name]
        self.pool.retire(manifest["id"])

    def reset(self):
        """Drop every state and blob; only an empty `initial` remains."""
        if self.shared:
            raise Conflict("the store is shared with other servers (store.remote): reset "
                           "would delete their states too. Delete states by name, or use "
                           "scripts/gc_states.py --remote")
        with self.lock:
            self.generation += 1
            self.pool.reset()
            self.store.clear()
            self.names = {}
            self._ensure_initial()

    # Requests that run code --------------------------------------------------

    def execute(self, code, exec_id, state_name, new_name=None, on_output=None,
                keep_live=True, cancel=None, cwd=None, fresh_imports=False,
                keep_on_error=False, durable=True, message_id=None, timeout=None,
                execution_count=None):
        """Run `code` from `state_name`; on success name the new state `new_name`.

        Returns the ExecuteAnswer; `on_output(item)` receives the outputs as
        the cell produces them (the NDJSON lines of a streamed answer).
        `keep_live` False: the new state gets no holder (protocol.Execute).
        `cancel`: a threading.Event; set before the cell starts, the cell is
        interrupted as it starts (after, interrupt(exec_id) stops it). `cwd`:
        the notebook's folder (protocol.Execute's `home`): an absolute path to
        a folder, else InvalidRequest. `fresh_imports`, `keep_on_error`, `message_id`,
        `execution_count`: protocol.Execute's. `durable` False: the new state may be lost
        to a machine crash until something flushes the store (a notebook run's
        states, made durable together when the run stores its results). `timeout`:
        the cell's limit in seconds instead of limits.cell_timeout_s (error Timeout).
        """
        manifest = self._lookup(state_name)
        with self.lock:
            generation = self.generation
        if manifest is None:
            return ExecuteAnswer.failed(protocol.error("StateNotFound", state_name))
        _check_new_name(new_name)
        check_folder(cwd)
        # `initial` is each server's own (its id differs from server to server).
        input_id = INITIAL if state_name == INITIAL else manifest["id"]
        key = None if exec_id is None else execution_key(exec_id, code, input_id, new_name, cwd)
        # An auto-named state of an exec_id is named after its execution, so that a retry
        # on any server finds it (a remote lists names from the bucket).
        target = new_name or (key[:32] if key else uuid.uuid4().hex)
        stored = self._stored_answer(target, key, exec_id, code, state_name, cwd, on_output)
        if stored is not None:
            return stored
        request = protocol.Execute(code=code, new_name=target, execution_key=key,
                                   auto_named=new_name is None, exec_id=_key(exec_id),
                                   stream=on_output is not None, keep_live=keep_live,
                                   home=cwd, fresh_imports=fresh_imports,
                                   keep_on_error=keep_on_error, message_id=message_id,
                                   execution_count=execution_count)
        result, child = self.cell_runs.run(manifest, request, on_output, cancel, timeout)
        answer = result.answer
        if answer.error is not None and self.closed:
            raise ServerStopping()  # its process was stopped with the others
        self._raise_store_error(answer.error, request.new_name)
        kept = result.manifest is None or self._bind(result.manifest, child, generation,
                                                     keep_live and result.holder)
        trace.stamp("bound", request.exec_id)
        if kept and result.manifest is not None and durable:
            self._flush(request.exec_id)
        if not kept:
            answer.state_name = None
            answer.error = protocol.error(
                "StateDiscarded", "the store was reset while the cell ran; its new state "
                "was not kept: run the cell again from a state that exists now")
        return answer

    def _stored_answer(self, name, key, exec_id, code, state_name, cwd, on_output):
        """The answer of execution `key` when it made the state `name` points to (a
        retry of an execution whose answer was lost), its outputs sent to `on_output`;
        else None. A state made in place (new name = input name) was made from the
        state's parent, which the key of its execution then names."""
        found = self._lookup(name) if key else None
        execution = found and found.get("execution")
        if not execution:
            return None
        made_in_place = name == state_name and found["parent_id"] and execution["key"] == \
            execution_key(exec_id, code, found["parent_id"], name, cwd)
        if execution["key"] != key and not made_in_place:
            return None
        answer = ExecuteAnswer(**snapshot.stored_answer(self.store, found))
        answer.state_name = name
        answer.volatile_symbols = sorted(found["volatile"])
        for item in answer.output if on_output else ():
            on_output({"type": "output", "output": item})
        log.info("exec_id %s answered from the state it made, %r", exec_id, name)
        return answer

    def multistate_execute(self, code, exec_id, mapping, default_state=None, on_output=None):
        """Run `code` with states under aliases and `default_state`'s names; store nothing."""
        for alias in mapping:
            if not alias.isidentifier():
                raise InvalidRequest(f"alias {alias!r} is not a Python identifier")
        base = self._lookup(default_state if default_state is not None else INITIAL)
        aliases = {a: self._lookup(s) for a, s in mapping.items()}
        missing = [s for s, m in [(default_state, base)] + [
            (mapping[a], m) for a, m in aliases.items()] if m is None]
        if missing:
            return ExecuteAnswer.failed(protocol.error("StateNotFound", missing[0]))
        request = protocol.Multistate(code=code, aliases=aliases, exec_id=_key(exec_id),
                                      stream=on_output is not None)
        result, _ = self.cell_runs.run(base, request, on_output)
        self._raise_store_error(result.answer.error)
        return result.answer

    def rebuild(self, input_state, source_state, source_vars, input_vars, new_name=None,
                durable=True):
        """Make a state of `source_vars` from one state and `input_vars` from another
        (`durable`: as in execute)."""
        _check_new_name(new_name)
        with self.lock:
            generation = self.generation
        base = self.manifest(input_state)
        source = self.manifest(source_state)
        for field, names, manifest, state in (("source_vars", source_vars, source, source_state),
                                              ("input_vars", input_vars, base, input_state)):
            unknown = sorted({n for n in names if n not in manifest["variables"]})
            if unknown:
                raise InvalidRequest(f"{field}: state {state!r} has no variable "
                                     f"{', '.join(map(repr, unknown[:10]))}"
                                     f"{', ...' if len(unknown) > 10 else ''}")
        request = protocol.Rebuild(source_manifest=source, source_vars=source_vars,
                                   input_vars=input_vars,
                                   new_name=new_name or uuid.uuid4().hex,
                                   auto_named=new_name is None)
        result, child = self.cell_runs.run(base, request)
        if result.error:
            self._raise_store_error(result.error, request.new_name)
            raise RequestFailed(result.error["evalue"], etype=result.error["ename"])
        if not self._bind(result.manifest, child, generation):
            raise Conflict("the store was reset while the state was rebuilt; it was not "
                           "kept: rebuild it from states that exist now")
        if durable:
            self._flush()
        return dict(state_name=request.new_name, **_groups_of(result.manifest))

    def interrupt(self, exec_id):
        """Interrupt the run `exec_id`; False if none is running its cell."""
        return self.cell_runs.interrupt(_key(exec_id))

    def add_state(self, manifest):
        """Store and name a state whose manifest the caller composed from other states'
        groups (no process made it: the first execution from it restores it)."""
        try:
            self.store.put_state(manifest["name"], manifest, {})
        except NameConflict:
            self._refresh(manifest["name"])  # as in _raise_store_error
            raise
        with self.lock:
            old = self.names.get(manifest["name"])
            self.names[manifest["name"]] = manifest
        if self.shared:
            self.shared.bound(manifest)
        if old is not None and old["id"] != manifest["id"]:
            self.pool.retire(old["id"])

    def _flush(self, exec_id=None):
        """Make every state stored so far durable before an answer names one, with
        durability "sync". The workers' commits do not flush their meta page (see
        Store), so this flush also makes durable the unflushed states of notebook
        runs the answer's state may descend from. The child that made the state
        forks its holder meanwhile."""
        if self.settings["store.durability"] == "sync":
            self.store.sync()
            trace.stamp("synced", exec_id)

    def _raise_store_error(self, error, new_name=None):
        """Raise the store failure a worker reported (full; damaged bytes met while
        loading; a shared remote unreachable; `new_name` rebound on it meanwhile) as
        the store's own exception, which the HTTP layer maps to a status."""
        failure = _STORE_ERRORS.get(error["ename"]) if error else None
        if failure is NameConflict:
            self._refresh(new_name)  # the winner's binding, so that running again rebinds it
        if failure is not None:
            raise failure(error["evalue"])

    def _bind(self, manifest, child, generation, holder=True):
        """Point the manifest's name at it and keep its child as the first spare (and, with
        `holder` False, as its only process).

        False (and the state dropped) when a reset came after the run started.
        """
        with self.lock:
            if generation != self.generation:
                child.kill()
                self.store.delete_states([manifest["name"]])
                self.pool.retire(manifest["id"])
                return False
            old = self.names.get(manifest["name"])
            self.names[manifest["name"]] = manifest
        if self.shared:
            self.shared.bound(manifest)
        self.pool.adopt_made(manifest["id"], child, holder)
        if old is not None and old["id"] != manifest["id"]:
            self.pool.retire(old["id"])
        return True


# The store's errors a worker reports by name, raised again here (a worker reports its
# exception's own class: BlobMissing is a StoreCorrupt).
_STORE_ERRORS = {cls.__name__: cls for cls in (StoreFull, StoreCorrupt, BlobMissing,
                                               NewerFormat, RemoteUnavailable, NameConflict)}


def check_folder(cwd):
    """Refuse (InvalidRequest) a working directory that is not an absolute path to a
    folder on this machine; None passes."""
    if cwd is None:
        return
    if not os.path.isabs(cwd):
        raise InvalidRequest(f"cwd must be an absolute path on the server, not {cwd!r}")
    if not os.path.isdir(cwd):
        raise InvalidRequest(f"cwd {cwd!r} is not a folder on the server")


def _local_modules(manifest):
    """The modules a state imported from files of the user's, as GET /states/NAME shows
    them: {name: {path, sha256, changed}}, `changed` when the file is no longer the
    one imported (or is gone)."""
    found = {}
    for module, (path, sha) in sorted((manifest.get("local_modules") or {}).items()):
        try:
            changed = sha256_file(path) != sha
        except OSError:
            changed = True
        found[module] = {"path": path, "sha256": sha, "changed": changed}
    return found



def _check_new_name(name):
    """Refuse a name the store cannot hold, before anything runs."""
    size = len(name.encode()) if name is not None else 0
    if size > MAX_NAME_BYTES:
        raise InvalidRequest(f"the state name is {size} bytes long in UTF-8; at most "
                             f"{MAX_NAME_BYTES} are allowed")


def execution_key(exec_id, code, input_id, new_name, cwd):
    """What identifies one execution: the same key is the same request sent again."""
    fields = [str(exec_id), code, input_id, new_name, cwd]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


def _key(exec_id):
    """The key a run is known by (exec_ids may be strings or integers)."""
    return None if exec_id is None else str(exec_id)


def _groups_of(manifest):
    """{groups, fingerprints} of a manifest: every variable in exactly one group."""
    groups = [(g["members"], g["fingerprint"]) for g in manifest["groups"]]
    for name in manifest["modules"]:
        groups.append(([name], snapshot.symbol_hash(manifest, name)))
    for name in manifest["volatile"]:
        groups.append(([name], None))
    groups.sort(key=lambda g: g[0][0])
    return {"groups": [g for g, _ in groups], "fingerprints": [f for _, f in groups]}
