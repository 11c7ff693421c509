"""Notebook runs through the kernel: the least work that brings every cell up to date.

A run analyses the cells, builds the graph in the requested order, keys
the cells and plans (planner.py); then takes the cells in the plan's
sequence. A reused cell costs a look-up. A cell that runs is executed by
the registry (`Registry.execute`) into a state named `nb-<key>`, and its
result is stored under its key. It runs in a state composed from its
inputs' states: the names whose version the best base lacks are taken in
by a worker when that base has a live holder (`Registry.rebuild`), and
otherwise the state is put together from manifests alone, no process
needed (`Registry.add_state`). After the cells, the notebook's final state
(every name as the last cell giving it left it) is found among the cells'
states or composed the same way, and stored as a result too, under the
key of its composition.

The record of a run (per cell: key, status, outputs, execution count,
state) is kept in memory while the run goes on, for GET /notebooks/NAME,
and stored when it ends, with the results of the cells that ran, in one
transaction: a commit flushes to disk, and one per cell cost more than
the run's other bookkeeping together. A run cut short by an error still
stores its results; a crash of the server loses them (the cells' states
stay until gc_states.py), and the cells run again.
"""

import contextlib
import datetime
import threading
import time
import uuid

from kernel.errors import Conflict, InvalidRequest, KernelError, NotebookNotFound
from kernel.notebook import analysis, graph as graph_mod, keys as keys_mod, planner
from storage.notebooks import NotebookStore
from storage.store import StoreError, StoreFull

STATE_PREFIX = "nb-"


def _now():
    """The current UTC time, ISO 8601."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def _error(ename, evalue):
    """An nbformat-style error without a traceback of its own."""
    return {"ename": ename, "evalue": evalue, "traceback": [f"{ename}: {evalue}"]}


def validate(cells, order, rerun):
    """Check a run's input; returns (ids, sources) or raises InvalidRequest."""
    if order not in graph_mod.ORDERS:
        raise InvalidRequest(f"unknown order {order!r}: use "
                            f"{' or '.join(repr(o) for o in graph_mod.ORDERS)}")
    if not isinstance(cells, list):
        raise InvalidRequest("cells must be a list of {id, source} objects")
    ids, sources = [], []
    for n, cell in enumerate(cells):
        if not isinstance(cell, dict):
            raise InvalidRequest(f"cells[{n}] must be an object with id and source")
        cell_id, source = cell.get("id"), cell.get("source")
        if not isinstance(cell_id, str) or not cell_id:
            raise InvalidRequest(f"cells[{n}] needs an id (a non-empty string)")
        if not isinstance(source, str):
            raise InvalidRequest(f"cell {cell_id!r} needs a source (a string)")
        ids.append(cell_id)
        sources.append(source)
    seen = set()
    for cell_id in ids:
        if cell_id in seen:
            raise InvalidRequest(f"cell id {cell_id!r} appears more than once")
        seen.add(cell_id)
    if not isinstance(rerun, (list, tuple)) or not all(isinstance(r, str) for r in rerun):
        raise InvalidRequest("rerun must be a list of cell ids")
    unknown = [r for r in rerun if r not in seen]
    if unknown:
        raise InvalidRequest(f"rerun names cell(s) not in the notebook: "
                            f"{', '.join(repr(u) for u in unknown)}")
    return ids, sources


class _Run:
    """One notebook run in progress: its record and how to stop it."""

    def __init__(self, name, exec_id, record):
        """Track the run of `name`."""
        self.name = name
        self.exec_id = exec_id
        self.record = record
        self.stopped = False
        self.executing = False  # a cell is in Registry.execute
        self.results = {}       # cell key -> result, stored when the run ends
        self.last_final = []    # see Runner._last_final


class Runner:
    """Runs notebooks on a Registry; keeps results and records in its store."""

    def __init__(self, kernel, environment=None):
        """Use `kernel` (a kernel.server.registry.Registry) and its store."""
        self.kernel = kernel
        self.store = NotebookStore(kernel.store)
        self.environment = environment or keys_mod.Environment()
        self.lock = threading.Lock()
        self.active = {}      # notebook name -> _Run
        self.by_exec = {}     # exec id -> _Run
        self.analysed = {}    # notebook name -> {source: CellAnalysis} of its last run

    # Queries ---------------------------------------------------------------------

    def names(self):
        """Every notebook with a record or a run in progress, sorted."""
        with self.lock:
            active = set(self.active)
        return sorted(active | set(self.store.records()))

    def get(self, name):
        """The record of `name`: the run in progress, else the last one."""
        with self.lock:
            run = self.active.get(name)
            if run is not None:
                return _copy(run.record)
        record = self.store.record(name)
        if record is None:
            raise NotebookNotFound(f"no notebook named {name!r}")
        return self._expand(record)

    def delete(self, name):
        """Forget a notebook's record (results stay: other notebooks may share them)."""
        with self.lock:
            if name in self.active:
                raise Conflict(f"notebook {name!r} is running")
            self.analysed.pop(name, None)
        if self.store.record(name) is None:
            raise NotebookNotFound(f"no notebook named {name!r}")
        self.store.delete_records([name])

    def clear(self):
        """Forget every result and record (after the kernel's reset)."""
        with self.lock:
            self.analysed.clear()
        self.store.clear()

    def interrupt(self, exec_id):
        """Stop the run `exec_id` and its running cell; False if no such run."""
        with self.lock:
            run = self.by_exec.get(str(exec_id))
        if run is None:
            return False
        run.stopped = True
        # The cell may be between the runner and the kernel's registry: retry until the
        # kernel knows it, or the cell is over.
        while run.executing and not self.kernel.interrupt(run.exec_id):
            time.sleep(0.005)
        return True

    # A run -----------------------------------------------------------------------

    def run(self, name, cells, order="notebook", rerun=(), exec_id=None, progress=None):
        """Run notebook `name`'s cells [{id, source}]; returns the run's record.

        `progress(cell)` is called with a cell's entry whenever its status changes.
        """
        ids, sources = validate(cells, order, rerun)
        exec_id = str(exec_id) if exec_id is not None else f"notebook-{uuid.uuid4().hex}"
        with self.lock:
            if name in self.active:
                raise Conflict(f"notebook {name!r} is already running")
            if exec_id in self.by_exec:
                raise Conflict(f"exec_id {exec_id!r} is already running")
            known = self.analysed.get(name, {})
            record = {"notebook": name, "order_kind": order, "exec_id": exec_id,
                      "running": True, "started": _now(), "finished": None,
                      "order": [], "diagnostics": [], "state_name": None,
                      "cells": [{"id": i, "key": None, "status": "pending", "took_s": None,
                                 "outputs": [], "error": None, "execution_count": None,
                                 "state_name": None} for i in ids]}
            run = self.active[name] = self.by_exec[exec_id] = _Run(name, exec_id, record)
        try:
            analyses = [known.get(s) or analysis.analyse(s) for s in sources]
            with self.lock:
                self.analysed[name] = dict(zip(sources, analyses))
            graph = graph_mod.build(ids, analyses, order)
            keys = planner.cell_keys(graph, sources, analyses, self.environment)
            stored = self._stored(k for k in keys.values() if k)
            plan = planner.plan(graph, keys, {k: set(r["volatile"]) for k, r in stored.items()},
                                [ids.index(r) for r in rerun])
            with self.lock:
                record["order"] = [ids[i] for i in plan.sequence]
                record["diagnostics"] = graph.diagnostics
                for i, key in keys.items():
                    record["cells"][i]["key"] = key
            run.last_final = self._last_final(name)
            done = _Progress(self, run, progress)
            states = self._cells(run, graph, keys, stored, plan, sources, analyses, done)
            final = self._final(run, graph, keys, states, analyses)
            with self.lock:
                record.update(state_name=final, running=False, finished=_now())
            self.store.put_run(run.results, name, _stored_form(record))
            run.results = {}
            return _copy(record)
        finally:
            if run.results:  # a run cut short keeps what its cells made
                with contextlib.suppress(StoreError):
                    self.store.put_run(run.results)
            with self.lock:
                self.active.pop(name, None)
                self.by_exec.pop(exec_id, None)

    def _stored(self, keys):
        """{key: result} of the stored results among `keys` whose state still exists."""
        found = self.store.results(set(keys))
        return {k: r for k, r in found.items() if self._exists(r["state"])}

    def _last_final(self, name):
        """[(state, provenance)] of the state notebook `name`'s last run ended on, when it
        is live; else [].

        An edit's first cell can run there, as in Jupyter's live kernel, instead
        of in its input state restored from the store: a run leaves holders only
        on the states it ends or pauses on (see _cells).
        """
        record = self.store.record(name)
        state = (record or {}).get("state_name") or ""
        key = state[len(STATE_PREFIX):]
        if not state.startswith(STATE_PREFIX) or not self._live(state):
            return []
        result = self.store.results([key]).get(key)
        if result is None or result["state"] != state:
            return []
        return [(state, result["provenance"])]

    def _exists(self, state):
        """True when the kernel knows a state of that name."""
        try:
            self.kernel.manifest(state)
            return True
        except KernelError:  # StateNotFound: deleted since
            return False

    def _cells(self, run, graph, keys, stored, plan, sources, analyses, done):
        """Take every cell of the plan; returns {position: (state, provenance, volatile)}."""
        states = {}
        # A cell run again for its volatile values is meanwhile as good as its stored
        # result for its other names.
        for p in plan.for_volatile:
            result = stored[keys[p]]
            states[p] = (result["state"], result["provenance"], set(result["volatile"]))
        failed = set()
        previous = None  # the cell taken last: its state is the preferred base for the next
        # A cell whose next one runs too leaves that one its process and no holder: a
        # holder would cost a fork of everything the notebook holds (10 to 30 ms) on
        # the way to the next cell, and its copy-on-write faults in that cell.
        following = dict(zip(plan.sequence, plan.sequence[1:]))
        for i in plan.sequence:
            if i in graph.blocked:
                done(i, status="blocked", error=graph.blocked[i])
                continue
            # Notebook order stops at the first failing cell, as Jupyter does.
            if run.stopped or (failed and graph.kind == "notebook"):
                done(i, status="not_run")
                continue
            stuck = sorted(graph.inputs[i] & failed)
            if stuck:
                failed.add(i)
                done(i, status="blocked", error=_error(
                    "Blocked", f"needs cell {graph.ids[stuck[0]]!r}, which did not run"))
                continue
            if i not in plan.run:
                result = stored[keys[i]]
                states[i] = (result["state"], result["provenance"], set(result["volatile"]))
                previous = i
                done(i, status="reused", took_s=0.0, outputs=result["outputs"],
                     execution_count=result["execution_count"], state_name=result["state"])
                continue
            done(i, status="running")
            started = time.monotonic()
            after = following.get(i)
            answer, error = self._execute(run, i, graph, keys, sources, analyses, states,
                                          previous, keep_live=after not in plan.run or
                                          after in graph.blocked)
            took = round(time.monotonic() - started, 6)
            if error is not None:
                failed.add(i)
                done(i, status="failed", took_s=took, outputs=answer.get("output") or [],
                     error=error, execution_count=answer.get("execution_count"))
                continue
            state = answer["state_name"]
            states[i] = (state, answer["provenance"], set(answer["volatile_symbols"] or ()))
            previous = i
            run.results[keys[i]] = {
                "key": keys[i], "kind": "cell", "state": state, "outputs": answer["output"],
                "execution_count": answer["execution_count"],
                "volatile": answer["volatile_symbols"] or [],
                "provenance": answer["provenance"], "took_s": took, "created": _now()}
            done(i, status="ran", took_s=took, outputs=answer["output"],
                 execution_count=answer["execution_count"], state_name=state)
        return states

    def _execute(self, run, i, graph, keys, sources, analyses, states, previous,
                 keep_live=True):
        """Run cell i in a state composed for it; returns (answer, error or None).
        `keep_live` False: its state gets no holder (protocol.Execute)."""
        required, sourced = planner.required_versions(graph.needs[i], states)
        volatile = {n for n, p in graph.needs[i].items()
                    if p is not None and n in states[p][2]}
        temps = []
        try:
            try:
                base, provenance = self._compose(required, sourced, states, previous,
                                                 volatile, temps, also=run.last_final)
            except _ComposeFailed as exc:
                return {}, exc.error
            try:
                run.executing = True
                if run.stopped:
                    return {}, _error("KeyboardInterrupt", "the run was interrupted")
                answer = self.kernel.execute(sources[i], run.exec_id, base,
                                             f"{STATE_PREFIX}{keys[i]}",
                                             keep_live=keep_live).to_json()
            finally:
                run.executing = False
            if answer["error"] is not None:
                return answer, answer["error"]
            answer["provenance"] = self._provenance(
                answer, base, provenance, keys[i], analyses[i], graph.changes[i])
            return answer, None
        finally:
            for temp in temps:
                self._forget(temp)

    def _provenance(self, answer, base, provenance, key, a, changes):
        """The provenance of the state a cell made from `base`.

        A name the cell may have changed becomes the cell's own version,
        unless its stored hash shows the same value as in the base (a cell
        that only read it): then the base's version stands, and later cells
        can run from either state.
        """
        state = answer["state_name"]
        names = self.kernel.manifest(state)["variables"]
        changed = set(changes) | set(answer["modified_symbols"]) | set(answer["deleted_symbols"])
        maybe = [n for n in names if a.dynamic or a.unknown_writes or n in changed]
        after = self.kernel.symbol_hashes(state, maybe)
        before = self.kernel.symbol_hashes(base, [n for n in maybe if n in provenance])
        made = {}
        for n in names:
            same = after.get(n) is not None and after.get(n) == before.get(n)
            if n in after and not same:
                made[n] = key
            else:
                made[n] = provenance.get(n, planner.UNKNOWN)
        return made

    def _compose(self, required, sourced, states, previous, volatile, temps, exact=False,
                 name=None, also=()):
        """A state holding the required versions: (state name, its provenance).

        Candidates are the cells' states, the previous cell's first (so that
        execution counts follow the run), the latest next, then `also`
        [(state, provenance)], `initial` last. States made on the way are
        added to `temps`, but for the last one when it is given a `name`.
        """
        candidates, seen = [], set()
        order = ([previous] if previous is not None else []) + sorted(states, reverse=True)
        for state, prov, _ in [states[p] for p in order] + [(s, p, ()) for s, p in also] + [
                ("initial", {}, ())]:
            if state not in seen:
                seen.add(state)
                candidates.append((state, prov))
        provenance_of = dict(candidates)
        live = {state for state, _ in candidates if self._live(state)}
        base, takes, drops = planner.compose(
            required, sourced, candidates, volatile, exact, live,
            preferred=states[previous][0] if previous is not None else None)
        provenance = dict(provenance_of[base])
        for n in drops:
            provenance.pop(n, None)
        for source, names in takes:
            provenance.update({k: provenance_of[source].get(k, planner.UNKNOWN) for k in names})
        if not takes and not drops:
            return base, provenance
        # A base with a live holder has its values loaded: a worker takes the rest into it
        # for the cell to run there. Otherwise, and for the final state (which nothing
        # runs from yet), the state is put together from manifests alone.
        if name is not None or base not in live:
            made = planner.merged_manifest(
                name or uuid.uuid4().hex, self.kernel.manifest(base),
                [(self.kernel.manifest(source), names) for source, names in takes], drops,
                auto_named=name is None)
            if made is not None:
                try:
                    self.kernel.add_state(made)
                except StoreFull as exc:
                    raise _ComposeFailed(_error("StoreFull",
                                                f"composing the input state failed: {exc}"))
                if name is None:
                    temps.append(made["name"])
                return made["name"], provenance
        steps = takes or [(base, [])]
        for n, (source, names) in enumerate(steps):
            keep = set(self.kernel.manifest(base)["variables"]) - set(names) - set(drops)
            last = n == len(steps) - 1
            try:
                made = self.kernel.rebuild(base, source, names, sorted(keep),
                                           name if last else None)
            except (KernelError, StoreFull) as exc:  # a source cannot be loaded, store full
                raise _ComposeFailed(_error(getattr(exc, "etype", "StoreFull"),
                                            f"composing the input state failed: "
                                            f"{exc}")) from None
            base = made["state_name"]
            if not (last and name):
                temps.append(base)
            drops = []
        return base, provenance

    def _live(self, state):
        """True when the state has a live holder (no restore needed to run from it)."""
        try:
            return self.kernel.describe(state)["live"]
        except KernelError:  # StateNotFound: deleted since
            return False

    def _forget(self, state):
        """Delete a state made only to run a cell from."""
        try:
            self.kernel.delete(state)
        except KernelError:  # deleted meanwhile (a reset): nothing to forget
            pass

    def _final(self, run, graph, keys, states, analyses):
        """The name of a state with every name as the run left it (composed if needed)."""
        source_of = {}
        for i in graph.order:
            if i not in states:
                continue
            if analyses[i].unknown_writes:
                source_of.update(dict.fromkeys(states[i][1], i))
            source_of.update(dict.fromkeys(graph.provides[i], i))
        if not source_of:
            return "initial"
        required, sourced = planner.required_versions(source_of, states)
        required = {n: v for n, v in required.items() if v is not None}
        key = keys_mod.composition_key({n: keys[p] for n, p in source_of.items()
                                        if n in required})
        found = self._stored([key])
        if key in found:
            return found[key]["state"]
        temps = []
        try:
            state, provenance = self._compose(required, sourced, states, None, (), temps,
                                              exact=True, name=f"{STATE_PREFIX}{key}",
                                              also=run.last_final)
        except _ComposeFailed:
            return None
        finally:
            for temp in temps:
                self._forget(temp)
        if state != f"{STATE_PREFIX}{key}":
            return state  # a cell's state holds the notebook's final names as they are
        run.results[key] = {"key": key, "kind": "composition", "state": state,
                            "outputs": [], "execution_count": None, "volatile": [],
                            "provenance": provenance, "took_s": None, "created": _now()}
        return state

    def _expand(self, record):
        """A stored record with the outputs of its cells' results filled in."""
        record = _copy(record)
        keys = [c["key"] for c in record["cells"] if c["status"] in ("ran", "reused")]
        results = self.store.results(keys)
        for cell in record["cells"]:
            if cell["status"] in ("ran", "reused") and "outputs" not in cell:
                cell["outputs"] = results.get(cell["key"], {}).get("outputs", [])
        return record


class _ComposeFailed(Exception):
    """The input state of a cell could not be composed; `error` says why."""

    def __init__(self, error):
        """Keep the error dict."""
        super().__init__(error["evalue"])
        self.error = error


class _Progress:
    """Updates a run's record cell by cell, and tells the caller."""

    def __init__(self, runner, run, callback):
        """Report for `run` to `callback` (or nobody)."""
        self.runner = runner
        self.run = run
        self.callback = callback

    def __call__(self, i, **fields):
        """Cell i's entry changed."""
        with self.runner.lock:
            cell = self.run.record["cells"][i]
            cell.update(fields)
            snapshot = dict(cell)
        if self.callback is not None:
            self.callback(snapshot)


def _stored_form(record):
    """A record as stored: outputs of cells with a stored result are left to the result."""
    record = _copy(record)
    for cell in record["cells"]:
        if cell["status"] in ("ran", "reused"):
            del cell["outputs"]
    return record


def _copy(record):
    """A copy of a record deep enough for its reader to keep (outputs are not changed)."""
    return dict(record, cells=[dict(c) for c in record["cells"]],
                order=list(record["order"]), diagnostics=list(record["diagnostics"]))
