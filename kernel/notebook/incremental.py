"""Incremental notebook runs: the least work that brings every cell up to date.

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

The record of a run (model.NotebookRun) is kept in memory while the
run goes on, for GET /notebooks/NAME, and stored when it ends, with the
results of the cells that ran, in one synced transaction, which also makes
durable every state the run made: the cells' states are committed without
a flush of their own (Registry.execute's `durable`), as a flush per cell
cost more than the run's other bookkeeping together. A run cut short by an
error still stores its results; a crash of the server loses them (the
cells' states stay until gc_states.py; a machine crash may undo the last
of them, never tear the store), and the cells run again.
"""

import contextlib
import dataclasses
import os
import threading
import time
import uuid

from snapkernel.kernel.errors import Conflict, KernelError, NotebookNotFound
from snapkernel.kernel.notebook import analysis, graph as graph_mod, inputs, ipynb
from snapkernel.kernel.notebook import keys as keys_mod, parameters as params, planner
from snapkernel.kernel.notebook import reasons
from snapkernel.kernel.notebook.model import (NOTEBOOK_STATE_PREFIX, WITH_RESULT, CellStatus,
                                              NotebookRun, now, timing_stamp, timings)
from snapkernel.kernel.protocol import error
from snapkernel.kernel.server.registry import check_folder
from snapkernel.storage.notebooks import NotebookStore
from snapkernel.storage.store import StoreError, StoreFull

STATE_PREFIX = NOTEBOOK_STATE_PREFIX


class _Run:
    """One notebook run in progress: its record, how to stop it, and what its cells'
    planning found (the context every step of the run reads)."""

    def __init__(self, request, exec_id):
        """Track the run `request` asks for."""
        self.name = request.notebook
        self.exec_id = exec_id
        self.record = NotebookRun(request.notebook,
                                  [dataclasses.replace(c) for c in request.cells],
                                  order_kind=request.order, exec_id=exec_id)
        self.sources = [c.source for c in request.cells]
        self.cwd = request.cwd
        self.allow_errors = request.allow_errors
        self.cell_timeout = request.cell_timeout or None  # s; None: limits.cell_timeout_s
        # The whole run's deadline (time.monotonic()), from when its cells start.
        self.timeout = request.timeout
        self.deadline = None
        self.stop = threading.Event()  # set by an interrupt
        self.results = {}  # cell key -> result, stored when the run ends
        self.last_final = []  # see NotebookRunner._last_final
        # The planning, filled in before the first cell is taken:
        self.analyses = self.graph = self.keys = self.stored = self.plan = None
        self.statics = self.keyer = self.files = None  # keys before files; planner.CellKeys
        self.rerun = set()  # the positions `rerun` names
        self.before = {}  # cell id -> that cell in the notebook's last record (a dict)
        self.ran = set()  # the positions that ran so far
        # position -> (state, provenance, volatile names) of each cell taken so far
        self.states = {}
        self.previous = None  # the cell taken last: its state is the next one's first base


class NotebookRunner:
    """Runs notebooks incrementally on a Registry; keeps results and records in its
    store."""

    def __init__(self, registry, environment=None):
        """Use `registry` (kernel.server.registry.Registry) and its store."""
        self.registry = registry
        self.store = NotebookStore(registry.store)
        self.environment = environment or keys_mod.Environment()
        self.hashes = inputs.FileHashes()  # of the files cells read and write
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
        """The record (NotebookRun) of `name`: the run in progress, else the last one."""
        with self.lock:
            run = self.active.get(name)
            if run is not None:
                return run.record.copy()
        stored = self.store.record(name)
        if stored is None:
            raise NotebookNotFound(f"no notebook named {name!r}")
        return self._expand(NotebookRun.from_json(stored))

    def delete(self, name):
        """Forget a notebook's record (results stay: other notebooks may share them)."""
        with self.lock:
            if name in self.active:
                raise Conflict(f"notebook {name!r} is running: delete its record once "
                               f"the run ends (or POST /interrupt with its exec_id)")
            self.analysed.pop(name, None)
        if self.store.record(name) is None:
            raise NotebookNotFound(f"no notebook named {name!r}")
        self.store.delete_records([name])

    def clear(self):
        """Forget every result and record (after the registry's reset)."""
        with self.lock:
            self.analysed.clear()
        self.store.clear()

    def interrupt(self, exec_id):
        """Stop the run `exec_id` and its running cell; False if no such run."""
        with self.lock:
            run = self.by_exec.get(str(exec_id))
        if run is None:
            return False
        # Set first: a cell the registry does not know yet is stopped as it starts
        # (Registry.execute's `cancel`); one it knows is interrupted here.
        run.stop.set()
        self.registry.interrupt(run.exec_id)
        return True

    # A run -----------------------------------------------------------------------

    def run(self, request, progress=None):
        """Run `request` (model.NotebookRequest); returns the run's NotebookRun.

        `progress(cell)` is called with a copy of a cell (model.NotebookCell)
        whenever its status changes. Its parameters are injected into its cells
        first (kernel/notebook/parameters.py): the record holds the injected cell.
        """
        check_folder(request.cwd)
        request.check()
        request = dataclasses.replace(request, cells=params.inject(request.cells,
                                                                   request.parameters))
        exec_id = str(request.exec_id) if request.exec_id is not None else \
            f"notebook-{uuid.uuid4().hex}"
        run = _Run(request, exec_id)
        with self.lock:
            if run.name in self.active:
                raise Conflict(f"notebook {run.name!r} is already running: run it again "
                               f"once that run ends (or POST /interrupt with its exec_id)")
            if exec_id in self.by_exec:
                raise Conflict(f"exec_id {exec_id!r} is already running: give each run "
                               f"an exec_id of its own")
            known = self.analysed.get(run.name, {})
            self.active[run.name] = self.by_exec[exec_id] = run
        try:
            self._plan(run, known, request)
            run.last_final = self._last_final(run.name)
            run.record.language_info = ipynb.language_info()
            if run.timeout is not None:
                run.deadline = time.monotonic() + run.timeout
            self._cells(run, _Progress(self, run, progress))
            final = self._final(run)
            with self.lock:
                run.record.state_name = final
                run.record.running = False
                run.record.finished = now()
            self.store.put_run(run.results, run.name, run.record.stored_form(),
                               run.files.new_traces)
            run.results = {}
            return run.record.copy()
        finally:
            if run.results:  # a run cut short keeps what its cells made
                with contextlib.suppress(StoreError):
                    self.store.put_run(run.results, traces=run.files.new_traces)
            with self.lock:
                self.active.pop(run.name, None)
                self.by_exec.pop(exec_id, None)

    def _plan(self, run, known, request):
        """Analyse, build the graph, key the cells and plan which run."""
        run.analyses = [known.get(s) or analysis.analyse(s) for s in run.sources]
        with self.lock:
            self.analysed[run.name] = dict(zip(run.sources, run.analyses))
        ids = [c.id for c in run.record.cells]
        run.graph = graph_mod.build(ids, run.analyses, request.order)
        notebook = request.notebook if os.path.isabs(request.notebook) else None
        run.files = inputs.RunFiles(run.cwd, notebook, self.hashes, self.store)
        run.keyer = planner.CellKeys(run.graph, run.sources, run.analyses, self.environment,
                                     run.cwd)
        run.keys, run.statics = run.keyer.compute(run.files)
        run.stored = self._stored(k for k in run.keys.values() if k)
        volatile = {k: set(r["volatile"]) for k, r in run.stored.items()}
        rerun = [ids.index(r) for r in request.rerun]
        run.rerun = set(rerun)
        run.before = {c["id"]: c for c in (self.store.record(run.name) or {}).get("cells", [])}
        run.plan = planner.plan(run.graph, run.keys, volatile, rerun)
        stale = run.files.stale_writers(run.graph.order, run.keys, run.statics, run.plan.run)
        if stale - run.plan.run:
            run.plan = planner.plan(run.graph, run.keys, volatile, rerun, refresh=stale)
        with self.lock:
            run.record.order = [ids[i] for i in run.plan.sequence]
            run.record.diagnostics = run.graph.diagnostics
            for i, key in run.keys.items():
                run.record.cells[i].key = key

    def _stored(self, keys):
        """{key: result} of the stored results among `keys` whose state still exists."""
        found = self.store.results(set(keys))
        return {k: r for k, r in found.items() if self.registry.has_state(r["state"])}

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
        if not state.startswith(STATE_PREFIX) or not self.registry.is_live(state):
            return []
        result = self.store.results([key]).get(key)
        if result is None or result["state"] != state:
            return []
        return [(state, result["provenance"])]

    def _cells(self, run, done):
        """Take every cell of the plan, filling in `run.states`."""
        graph, plan, keys, stored = run.graph, run.plan, run.keys, run.stored
        # A cell run again for its volatile values is meanwhile as good as its stored
        # result for its other names.
        for p in plan.for_volatile:
            result = stored[keys[p]]
            run.states[p] = (result["state"], result["provenance"], set(result["volatile"]))
        failed = set()
        # A cell whose next one runs too leaves that one its process and no holder: a
        # holder would cost a fork of everything the notebook holds (10 to 30 ms) on
        # the way to the next cell, and its copy-on-write faults in that cell.
        following = dict(zip(plan.sequence, plan.sequence[1:]))
        for i in plan.sequence:
            # Notebook order stops at the first failing cell, as Jupyter does: the cells
            # after it are not run, those that could not have run either.
            # So does it with allow_errors after a cell that left no state (it timed out,
            # its process died): the cells after it that need it are blocked.
            if run.stop.is_set() or (failed and graph.kind == "notebook"
                                     and not run.allow_errors):
                done(i, status=CellStatus.NOT_RUN)
                continue
            if i in graph.blocked:
                done(i, status=CellStatus.BLOCKED, error=graph.blocked[i])
                continue
            stuck = sorted(graph.inputs[i] & failed)
            if stuck:
                failed.add(i)
                done(i, status=CellStatus.BLOCKED, error=error(
                    "Blocked", f"needs cell {graph.ids[stuck[0]]!r}, which did not run"))
                continue
            result = None if i in plan.run else self._reusable(run, i)
            if result is not None and result.get("error") and not (
                    run.allow_errors or run.record.cells[i].may_raise):
                # A failure stored by a run with allow_errors, now without: the run stops
                # there, as running it again would.
                failed.add(i)
                done(i, status=CellStatus.FAILED, took_s=0.0, outputs=result["outputs"],
                     error=result["error"], execution_count=result["execution_count"],
                     execution=result.get("execution"))
                continue
            if result is not None:
                run.states[i] = (result["state"], result["provenance"], set(result["volatile"]))
                run.previous = i
                # A stored failure keeps its error (its outputs show it).
                done(i, status=CellStatus.REUSED, took_s=0.0, outputs=result["outputs"],
                     execution_count=result["execution_count"], state_name=result["state"],
                     error=result.get("error"), execution=result.get("execution"),
                     reason=self._note(run, i, result))
                continue
            run.ran.add(i)
            done(i, status=CellStatus.RUNNING, reason=self._why(run, i))
            started = time.monotonic()
            after = following.get(i)
            # A cell that may fail (allow_errors, or tagged raises-exception) keeps what it
            # did before it raised, for the cells after it, as a live kernel does.
            may_fail = run.allow_errors or run.record.cells[i].may_raise
            answer, failure = self._execute(run, i, keep_live=after not in plan.run or
                                            after in graph.blocked, keep_on_error=may_fail)
            took = round(time.monotonic() - started, 6)
            timed_out = failure is not None and failure["ename"] == "Timeout"
            if timed_out and answer.get("state_name"):
                # As nbclient's CellTimeoutError: the cell was interrupted, its state is
                # not one a run can go on from.
                self._forget(answer["state_name"])
                answer["state_name"] = None
            went_on = failure is not None and may_fail and answer.get("state_name") and \
                not run.stop.is_set()
            if failure is not None and not went_on:
                failed.add(i)
                done(i, status=CellStatus.FAILED, took_s=took,
                     outputs=answer.get("output") or [], error=failure,
                     execution_count=answer.get("execution_count"),
                     execution=answer.get("execution"))
                continue
            state = answer["state_name"]
            run.states[i] = (state, answer["provenance"], set(answer["volatile_symbols"] or ()))
            run.previous = i
            expected = run.record.cells[i].may_raise
            files = self._rekey(run, i, answer)
            if failure is None or expected or not reasons.retried(failure):
                # A failure allow_errors let pass is a result like any other (its error
                # among its outputs, the state it left), unless it may come from outside
                # its key: then the next run tries the cell again (and its dependents).
                run.results[keys[i]] = _result(
                    keys[i], "cell", state, answer["provenance"], outputs=answer["output"],
                    execution_count=answer["execution_count"],
                    volatile=answer["volatile_symbols"] or [], took_s=took, error=failure,
                    execution=answer.get("execution"), files=files, basis=self._basis(run, i))
            if failure is None and expected:
                self._note_no_error(run, i)
            status = CellStatus.RAN if failure is None else (
                CellStatus.FAILED_AS_EXPECTED if expected else CellStatus.FAILED)
            done(i, status=status, took_s=took, outputs=answer["output"], error=failure,
                 execution_count=answer["execution_count"], state_name=state,
                 execution=answer.get("execution"), key=keys[i])

    def _basis(self, run, i):
        """What cell i's key is made of now (reasons.basis)."""
        needs = {n: None if p is None else run.keys[p] for n, p in run.graph.needs[i].items()}
        return reasons.basis(run.sources[i], run.keyer.parts[i], needs)

    def _why(self, run, i):
        """The reason cell i runs (reasons.why)."""
        before = run.before.get(run.graph.ids[i])
        old = None
        if before and before.get("key") and before["key"] != run.keys[i]:
            old = self.store.results([before["key"]]).get(before["key"])
        return reasons.why(i, run.graph, run.plan, run.rerun, run.ran, run.keys[i], before,
                           old, self._basis(run, i), run.files.content)

    def _note(self, run, i, result):
        """The note of reused cell i when its code reads the clock or an unseeded
        generator (reasons.note), also among the run's diagnostics; else None."""
        found = reasons.note(run.analyses, i, result.get("created"))
        if found is not None:
            cell_id = run.graph.ids[i]
            with self.lock:
                run.record.diagnostics.append({
                    "kind": found["kind"], "cells": [cell_id], "names": [],
                    "message": f"cell {cell_id!r}: {found['message']}"})
        return found

    def _reusable(self, run, i):
        """The stored result cell i may reuse, under its key as it is now (a cell that
        ran before it may have changed it), or None: the cell runs."""
        key = run.keys[i]
        if key not in run.stored:
            run.stored.update(self._stored([key]))
        return run.stored.get(key)

    def _rekey(self, run, i, answer):
        """Note the files cell i read and wrote as it ran, and key again it and the
        cells not taken yet; returns its result's {"reads", "writes"} ({path: hash})."""
        had = run.files.reads(i, run.statics[i]) or run.files.writes(i, run.statics[i],
                                                                    run.keys[i])
        files = run.files.record(i, run.statics[i], answer.get("files_read") or [],
                                 answer.get("files_written") or [])
        if not (had or files["reads"] or files["writes"]):
            return files  # no key depends on files of this cell
        taken = {p: (run.keys[p], run.statics[p]) for p in run.states if p != i}
        found, static = run.keyer.compute(run.files, fixed=taken)
        with self.lock:
            for p, key in found.items():
                if p not in taken:
                    run.keys[p], run.statics[p] = key, static[p]
                    run.record.cells[p].key = key
        return files

    def _note_no_error(self, run, i):
        """Say in the run's diagnostics that cell i is tagged raises-exception but did
        not raise."""
        cell_id = run.record.cells[i].id
        with self.lock:
            run.record.diagnostics.append({
                "kind": "no_error_raised", "cells": [cell_id], "names": [],
                "message": f"cell {cell_id!r} is tagged raises-exception but raised no "
                           f"error"})

    def _execute(self, run, i, keep_live=True, keep_on_error=False):
        """Run cell i in a state composed for it; returns (answer, error or None).
        `keep_live` False: its state gets no holder; `keep_on_error`: a failing cell
        still makes its state (protocol.Execute)."""
        needs = run.graph.needs[i]
        required, sourced = planner.required_versions(needs, run.states)
        volatile = {n for n, p in needs.items() if p is not None and n in run.states[p][2]}
        temps = []
        try:
            try:
                base, provenance = self._compose(run, required, sourced, volatile, temps,
                                                 previous=run.previous)
            except _ComposeFailed as exc:
                return {}, exc.error
            if run.stop.is_set():
                return {}, error("KeyboardInterrupt", "the run was interrupted")
            timeout, by_run = run.cell_timeout, False
            if run.deadline is not None:
                left = run.deadline - time.monotonic()
                if left <= 0:
                    run.stop.set()
                    return {}, _run_timeout(run)
                by_run = timeout is None or left < timeout
                timeout = min(left, timeout or left)
            busy = timing_stamp()
            answer = self.registry.execute(run.sources[i], run.exec_id, base,
                                           f"{STATE_PREFIX}{run.keys[i]}",
                                           keep_live=keep_live, cancel=run.stop,
                                           cwd=run.cwd, fresh_imports=True,
                                           keep_on_error=keep_on_error,
                                           durable=False, timeout=timeout).to_json()
            answer["execution"] = timings(busy, timing_stamp())
            if by_run and (answer["error"] or {}).get("ename") == "Timeout":
                run.stop.set()  # the rest of the run is past its deadline too
                answer["error"] = _run_timeout(run)
            if answer["state_name"] is None:
                return answer, answer["error"]
            answer["provenance"] = self._provenance(answer, base, provenance, run.keys[i],
                                                    run.analyses[i], run.graph.changes[i])
            return answer, answer["error"]
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
        names = self.registry.manifest(state)["variables"]
        changed = set(changes) | set(answer["modified_symbols"]) | set(answer["deleted_symbols"])
        maybe = [n for n in names if a.dynamic or a.unknown_writes or n in changed]
        after = self.registry.symbol_hashes(state, maybe)
        before = self.registry.symbol_hashes(base, [n for n in maybe if n in provenance])
        made = {}
        for n in names:
            same = after.get(n) is not None and after.get(n) == before.get(n)
            if n in after and not same:
                made[n] = key
            else:
                made[n] = provenance.get(n, planner.UNKNOWN)
        return made

    def _compose(self, run, required, sourced, volatile, temps, previous=None, exact=False,
                 name=None):
        """A state holding the required versions: (state name, its provenance).

        Candidates are the cells' states, the `previous` cell's first (so that
        execution counts follow the run), the latest next, then the state
        the last run ended on, `initial` last. The base is one whose process
        context is the `previous` cell's state's (`initial`'s before the
        first cell), as a Run All's process would be after that cell: the
        state the last run ended on holds the right variables for an edited
        cell, but its generators have drawn for the cells after it. States
        made on the way are added to `temps`, but for the last one when it
        is given a `name`.
        """
        states = run.states
        candidates, seen = [], set()
        order = ([previous] if previous is not None else []) + sorted(states, reverse=True)
        for state, prov, _ in [states[p] for p in order] + [
                (s, p, ()) for s, p in run.last_final] + [("initial", {}, ())]:
            if state not in seen:
                seen.add(state)
                candidates.append((state, prov))
        provenance_of = dict(candidates)
        live = {state for state, _ in candidates if self.registry.is_live(state)}
        wanted = self._context(states[previous][0] if previous is not None else "initial")
        bases = {state for state, _ in candidates if self._context(state) == wanted}
        base, takes, drops = planner.compose(
            required, sourced, candidates, volatile, exact, live,
            preferred=states[previous][0] if previous is not None else None, bases=bases)
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
                name or uuid.uuid4().hex, self.registry.manifest(base),
                [(self.registry.manifest(source), names) for source, names in takes], drops,
                auto_named=name is None)
            if made is not None:
                try:
                    self.registry.add_state(made)
                except StoreFull as exc:
                    raise _ComposeFailed(error("StoreFull",
                                               f"composing the input state failed: {exc}"))
                if name is None:
                    temps.append(made["name"])
                return made["name"], provenance
        steps = takes or [(base, [])]
        for n, (source, names) in enumerate(steps):
            keep = set(self.registry.manifest(base)["variables"]) - set(names) - set(drops)
            last = n == len(steps) - 1
            try:
                made = self.registry.rebuild(base, source, names, sorted(keep),
                                             name if last else None, durable=False)
            except (KernelError, StoreFull) as exc:  # a source cannot be loaded, store full
                raise _ComposeFailed(error(getattr(exc, "etype", "StoreFull"),
                                           f"composing the input state failed: "
                                           f"{exc}")) from None
            base = made["state_name"]
            if not (last and name):
                temps.append(base)
            drops = []
        return base, provenance

    def _context(self, state):
        """The process context of `state` ({provider: blob key} of its manifest)."""
        return self.registry.manifest(state).get("context") or {}

    def _forget(self, state):
        """Delete a state made only to run a cell from."""
        try:
            self.registry.delete(state)
        except KernelError:  # deleted meanwhile (a reset): nothing to forget
            pass

    def _final(self, run):
        """The name of a state with every name as the run left it (composed if needed)."""
        source_of = {}
        for i in run.graph.order:
            if i not in run.states:
                continue
            if run.analyses[i].unknown_writes:
                source_of.update(dict.fromkeys(run.states[i][1], i))
            source_of.update(dict.fromkeys(run.graph.provides[i], i))
        if not source_of:
            return "initial"
        required, sourced = planner.required_versions(source_of, run.states)
        required = {n: v for n, v in required.items() if v is not None}
        # The state a Run All ends in: its names, and the context of the last cell taken.
        context = self._context(run.states[run.previous][0] if run.previous is not None
                                else "initial")
        key = keys_mod.composition_key({n: run.keys[p] for n, p in source_of.items()
                                        if n in required}, context)
        found = self._stored([key])
        if key in found:
            return found[key]["state"]
        temps = []
        try:
            state, provenance = self._compose(run, required, sourced, (), temps,
                                              previous=run.previous, exact=True,
                                              name=f"{STATE_PREFIX}{key}")
        except _ComposeFailed:
            return None
        finally:
            for temp in temps:
                self._forget(temp)
        if state != f"{STATE_PREFIX}{key}":
            return state  # a cell's state holds the notebook's final names as they are
        run.results[key] = _result(key, "composition", state, provenance)
        return state

    def _expand(self, record):
        """A stored record with the outputs of its cells' results filled in."""
        results = self.store.results([c.key for c in record.cells if c.status in WITH_RESULT])
        for cell in record.cells:
            if cell.status in WITH_RESULT and not cell.outputs:
                cell.outputs = results.get(cell.key, {}).get("outputs", [])
        return record


def _result(key, kind, state, provenance, outputs=(), execution_count=None, volatile=(),
            took_s=None, error=None, execution=None, files=None, basis=None):
    """A stored result: what a cell with key `key` (or a composition) gave (`error`: the
    error it raised, tagged raises-exception or let pass by allow_errors; `execution`:
    the cell's nbclient timings; `files`: the {"reads", "writes"} of the cell, {path:
    hash}, RunFiles.record; `basis`: what its key was made of, reasons.basis)."""
    return {"key": key, "kind": kind, "state": state, "outputs": list(outputs),
            "execution_count": execution_count, "volatile": list(volatile),
            "provenance": provenance, "took_s": took_s, "created": now(), "error": error,
            "execution": execution, "basis": basis,
            **(files or {"reads": {}, "writes": {}})}


def _run_timeout(run):
    """The error of the cell running when the run's deadline passed."""
    return error("Timeout", f"the run went past its timeout of {run.timeout:g} s; the "
                            f"cells after this one did not run")


class _ComposeFailed(Exception):
    """The input state of a cell could not be composed; `error` says why."""

    def __init__(self, failure):
        """Keep the error dict."""
        super().__init__(failure["evalue"])
        self.error = failure


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
            cell = self.run.record.cells[i]
            for name, value in fields.items():
                setattr(cell, name, value)
            snapshot = dataclasses.replace(cell)
        if self.callback is not None:
            self.callback(snapshot)
