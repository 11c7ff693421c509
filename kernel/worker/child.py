"""The cell child: a fork of a state's holder that runs one request at a time.

It runs the request on its copy-on-write copy of the state (`Execute`,
`Multistate`, `Rebuild`: kernel/protocol.py), and for one that made a new
state it stores what changed, answers, forks the idle holder of the new
state and stays on as that state's first spare, ready for the next request
on the same channel. Any other request's child exits after answering, so
the input state is never touched.
"""

import contextlib
import gc
import os
import select
import sys
import traceback
import types
from typing import NamedTuple

from snapkernel.kernel import protocol, trace
from snapkernel.kernel.channel import ChannelClosed
from snapkernel.kernel.protocol import ExecuteAnswer
from snapkernel.kernel.worker import context, execution, limits, opened, reads, replay
from snapkernel.kernel.worker.capture import comms
from snapkernel.kernel.worker.process import fork_worker, threads_lost_on_fork, user_names
from snapkernel.storage import serializer, snapshot
from snapkernel.storage.store import StoreError

# After its answer, the child that made a state forks the state's holder after this long
# or when the next request comes, whichever is first (see CellChild.run); a next cell
# from that state that comes within workers.chain_step_s instead runs without it.
HOLDER_AFTER_S = 0.002


class Symbols(NamedTuple):
    """What a cell did to the names of its namespace: the answer's symbols, and what
    saving the state it made needs."""
    accessed: set  # names of the state it read
    modified: set  # names it made, bound to another object, or assigned again
    deleted: set  # names of the state it deleted
    rebound: set  # names it made or bound to another object
    after: set  # every user name once it ran

    @classmethod
    def of(cls, found, namespace, before, names_before, unloaded):
        """The symbols of a cell whose reads and writes are `found` (reads.Analysis),
        which ran in `namespace`: `before` held {name: object} of the names loaded
        then, `names_before` every name of the state, `unloaded` the names still not
        loaded (the state's, not deleted)."""
        after = user_names(namespace)
        rebound = {n for n in after if n not in before or before[n] is not namespace[n]}
        return cls(accessed=found.reads & names_before,
                   modified=rebound | (found.writes & after),
                   deleted=names_before - after - unloaded, rebound=rebound, after=after)

    def answer(self, outputs, error, count, **fields):
        """The cell's answer (with the other `fields` of an ExecuteAnswer)."""
        return ExecuteAnswer(output=outputs, error=error, execution_count=count,
                             accessed_symbols=sorted(self.accessed),
                             modified_symbols=sorted(self.modified),
                             deleted_symbols=sorted(self.deleted), **fields)


class CellChild:
    """Runs requests on `state` (the StateHolder object this process inherited)."""

    def __init__(self, state):
        """Serve requests on `state`'s namespace, over its channel."""
        self.state = state
        self.channel = state.channel
        self.forked_holders = []  # pids of the holders this process forked (fork_holder)
        settings = state.settings
        self.holder_after_s = HOLDER_AFTER_S if settings["workers.hold_chain_steps"] else \
            max(settings["workers.chain_step_s"], HOLDER_AFTER_S)

    def run(self, msg):
        """Serve requests: after one that made a state, stay as a spare of that state
        (its holder forked off) and take the next; otherwise exit."""
        handlers = {protocol.Execute: self.execute, protocol.Multistate: self.multistate,
                    protocol.Rebuild: self.rebuild}
        while True:
            trace.stamp("received", msg.exec_id)
            made = None
            try:
                with self.state.cells_running.held():  # its holder does not load meanwhile
                    made, result = handlers[type(msg)](msg)
            except ChannelClosed:
                os._exit(0)
            except Exception as exc:
                result = msg.failed(protocol.error(type(exc).__name__, str(exc),
                                                   traceback.format_exc().splitlines()))
            holder = made is not None and self.holder_possible(msg)
            if made is not None and isinstance(msg, protocol.Execute):
                result = result._replace(holder=holder)
            try:
                trace.stamp("answering", msg.exec_id)
                self.channel.send(result)
                if made is None:
                    os._exit(0)
                self.state.manifest = made
                self.state.cells_running.renew()
                if not holder:
                    msg = self.channel.recv()  # no holder: this process is the state's
                    continue
                # Fork once the server has read the answer and sent its reply (a fork at
                # once delays both, by a millisecond or more when the cores were idle),
                # and the next cell had time to come as a chain step, or as soon as
                # another request comes: it must not run before the state has its
                # holder, unless the server made it a chain step.
                made_by = msg.exec_id
                msg = None
                if select.select([self.channel], [], [], self.holder_after_s)[0]:
                    msg = self.channel.recv()
                    if isinstance(msg, protocol.Execute) and not msg.input_holder:
                        continue
                self.fork_holder()
                trace.stamp("forked", made_by)
                if msg is None:
                    self.state.warm(wait=False)
                    trace.stamp("warmed", made_by)
                self.reap_holders()  # those stopped while this one was forked
                if msg is None:
                    msg = self.channel.recv()
            except (ChannelClosed, OSError):
                os._exit(0)

    def holder_possible(self, msg):
        """Whether the state `msg` made may get a holder forked from this process: not
        if the request said so (Execute.keep_live), nor if the cell left a thread pool
        that a fork would lose (workers.fork_unsafe_threads); this process then stays
        the state's only one, and a second run from the state restores it."""
        if not isinstance(msg, protocol.Execute):
            return True  # a Rebuild only loads values
        if not msg.keep_live:
            return False
        lost = threads_lost_on_fork(self.state.settings["workers.fork_unsafe_threads"])
        if lost:
            trace.stamp("holderless", f"{msg.exec_id}: {' '.join(sorted(set(lost)))}")
        return not lost

    def sink(self, msg):
        """Where the cell's outputs go as it produces them: the channel, if streamed."""
        if not msg.stream:
            return None
        return lambda item: self.channel.send(protocol.Output(item))

    def prepare(self, cell, extra_names=()):
        """Analyse the cell's reads and writes, loading what it needs first."""
        state = self.state
        names_before = state.state_names() | set(extra_names)
        while True:
            if cell.uses_ipython:
                found = reads.Analysis(set(names_before), set(names_before), True)
            else:
                found = reads.analyse(cell.codes, state.namespace, names_before)
            missing = (found.reads | found.writes) & state.unloaded_names()
            # A package's submodules are there as its attributes when the session imported
            # them: `from statsmodels import graphics` finds `graphics.gofplots` because
            # the `sm` of `import statsmodels.api as sm` brought it.
            missing |= state.module_variables_of(found.imports)
            # What the process context refers to (bokeh's current document) is the
            # state's before the cell, whatever the cell reads.
            missing |= context.variables_referred(state.context) & state.unloaded_names()
            if found.dynamic:
                missing = state.unloaded_names()
            if not missing:
                return found
            state.load(missing)

    def execute(self, msg):
        """Run a cell; on success store the new state. Returns (manifest or None, result)."""
        state, namespace = self.state, self.state.namespace
        count = msg.execution_count or state.manifest["execution_count"] + 1
        cell = execution.compile_cell(msg.code, count)
        trace.stamp("compiled", msg.exec_id)
        if cell.error:
            return None, protocol.CellResult(ExecuteAnswer.failed(cell.error, count))
        try:
            found = self.prepare(cell)
        except (StoreError, replay.ReplayFailed) as exc:
            return None, protocol.CellResult(ExecuteAnswer.failed(
                protocol.error(type(exc).__name__, str(exc), []), count))
        before = {n: namespace[n] for n in user_names(namespace)}
        names_before = state.state_names()
        note = self.context_note(msg)
        home = self.move_home(msg.home)
        if msg.fresh_imports:
            context.forget_changed_modules()
        context.fresh_generators(state.context)
        opened.start()
        try:
            with comms.answering(msg.message_id):
                outputs, error = limits.run_limited(cell, namespace, count, state.settings,
                                                    self.sink(msg))
        finally:
            files_read, files_written = opened.stop()
        outputs = note + outputs
        trace.stamp("ran", msg.exec_id)
        symbols = Symbols.of(found, namespace, before, names_before, state.unloaded_names())
        answer = symbols.answer(outputs, error, count, files_read=files_read,
                                files_written=files_written)
        if error is not None and not msg.keep_on_error:
            return None, protocol.CellResult(answer)
        context.watch_attribute_writes(cell.codes, namespace)
        self.channel.send(protocol.Phase("saving"))
        touched = found.reads | found.writes | symbols.modified | symbols.deleted
        if found.dynamic:
            touched |= names_before | symbols.after
        try:
            # Holders restoring in the background wait meanwhile, as while children load:
            # the answer waits for this save and nothing else.
            with self.state.child_loads.held():
                manifest = self.save(msg, count, touched, symbols.after, symbols.rebound,
                                     home, answer)
        except StoreError as exc:  # StoreFull among them: the server answers 507
            answer.error = protocol.error(type(exc).__name__, str(exc), [])
            return None, protocol.CellResult(answer)
        trace.stamp("saved", msg.exec_id)
        answer.state_name = msg.new_name
        answer.volatile_symbols = sorted(manifest["volatile"])
        answer.inert_symbols = sorted(snapshot.inert(manifest))
        return manifest, protocol.CellResult(answer, manifest)

    def move_home(self, folder):
        """The notebook folder the new state belongs to: `folder` when given, moving
        there first if the state's lineage started elsewhere; the state's own else.

        The cell runs in `folder` unless an earlier cell of the lineage chose
        another working directory (os.chdir, %cd), as a live kernel would.
        """
        home = self.state.manifest.get("home")
        if folder is None or folder == home:
            return home
        if home is None or os.getcwd() == home:
            os.chdir(folder)
        return folder

    def save(self, msg, count, touched, present, rebound, home, answer):
        """Write the new state: dirty groups re-pickled, the others carried.
        `rebound`: the names the cell bound to another object (or made); `home`:
        the notebook folder of the state (move_home); `answer`: the cell's, kept with
        the state when the request has an execution key."""
        parent = self.state.manifest
        manifest = snapshot.new_manifest(msg.new_name, parent, msg.code, count, msg.auto_named)
        manifest["home"] = home
        carried, replaced, dirty = [], [], set()
        for group in parent["groups"]:
            if touched.isdisjoint(group["members"]):
                carried.append(group)
            else:
                replaced.append(group)
                dirty.update(m for m in group["members"] if m in present)
        modules = [n for n in parent["modules"] if n not in touched]
        volatile = [n for n in parent["volatile"] if n not in touched]
        dirty |= (touched & present) - set(modules) - set(volatile)
        snapshot.carry(manifest, parent, carried, modules, volatile)
        tag = f"{count}:{manifest['code_digest']}"
        store = self.state.store()
        records = snapshot.save_groups(store, manifest, self.state.namespace, sorted(dirty),
                                       self.state.settings, class_tag=tag, parent=parent,
                                       rebound=rebound)
        if "ipywidgets" in sys.modules:  # a slider moved changes no variable's pickle
            snapshot.describe_again(manifest, self.state.namespace,
                                    serializer.rebuildable_widget,
                                    self.state.settings["store.repr_max_chars"])
        made_context = self.save_context(store, manifest, records)
        if msg.execution_key is not None:
            snapshot.record_execution(manifest, records, msg.execution_key, answer.to_json())
        snapshot.commit(store, manifest, records, replaced)
        self.state.context = made_context
        return manifest

    def save_context(self, store, manifest, records):
        """Put the process context as the cell left it into the new state's manifest,
        and its changed values into `records`; returns it (kernel/worker/context.py)."""
        made, payloads = context.capture(self.state.context, self.state.settings)
        for key in store.missing(payloads) - records.keys():
            records[key] = payloads[key]
        manifest["context"] = context.keys(made)
        manifest["cwd"] = made["cwd"][1]
        manifest["local_modules"] = (made.get("local_modules") or (None, {}))[1]
        manifest["unkept"] = (made.get("module_attributes") or (None, {}))[1].get("unkept", [])
        return made

    def context_note(self, msg):
        """[the output that says what a restore of this state could not apply as it
        was (a module file that changed since, say)], sent first when streamed; []
        when there is nothing to say. Said once, by the first cell after the restore."""
        warnings, self.state.context_warnings = self.state.context_warnings, []
        if not warnings:
            return []
        note = {"output_type": "stream", "name": "stderr",
                "text": "".join(f"Warning: the restored state differs from the one saved: "
                                f"{w}\n" for w in warnings)}
        sink = self.sink(msg)
        if sink is not None:
            sink({"type": "output", "output": note})
        return [note]

    def fork_holder(self):
        """Fork the idle holder of the state this process just made.

        This process, connected and warm, stays as the state's first spare:
        in a notebook run top to bottom the next cell comes from this state
        within milliseconds and need not wait for a fork.
        """
        self.reap_holders()
        gc.collect()  # the last cell's cyclic garbage, before freeze() would keep it
        gc.freeze()
        pid = fork_worker("holder")
        if pid:
            self.forked_holders.append(pid)
            return
        state = self.state
        state.channel.close()
        try:
            state.connect(protocol.HOLDER, state_id=state.manifest["id"])
        except (ChannelClosed, OSError):
            os._exit(0)
        state.serve(state.reaper(), max(state.settings["workers.spare_children"] - 1, 0))

    def reap_holders(self):
        """Reap the holders this process forked that have stopped since (by pid: a
        cell's own subprocesses are the cell's to wait for)."""
        for pid in list(self.forked_holders):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue
            self.forked_holders.remove(pid)

    def multistate(self, msg):
        """Run a cell with other states' variables under aliases; store nothing."""
        state, namespace = self.state, self.state.namespace
        with state.child_loads.held():  # holders wait while this child loads
            state.load()
            for alias, manifest in msg.aliases.items():
                scope = {"__builtins__": namespace["__builtins__"]}
                snapshot.check_compatible(manifest)
                snapshot.load_modules(manifest, scope)
                for group in manifest["groups"]:
                    snapshot.load_group(state.store(), group, scope, manifest["name"])
                replay.volatile(manifest, scope, state.settings)
                scope.pop("__builtins__")
                namespace[alias] = types.SimpleNamespace(**scope)
        count = state.manifest["execution_count"] + 1
        cell = execution.compile_cell(msg.code, count)
        if cell.error:
            return None, protocol.CellResult(ExecuteAnswer.failed(cell.error, count))
        names_before = user_names(namespace)
        found = self.prepare(cell, msg.aliases)
        before = {n: namespace[n] for n in names_before}
        context.fresh_generators(state.context)
        outputs, error = limits.run_limited(cell, namespace, count, state.settings,
                                            self.sink(msg))
        symbols = Symbols.of(found, namespace, before, names_before, state.unloaded_names())
        return None, protocol.CellResult(symbols.answer(outputs, error, count))

    def rebuild(self, msg):
        """Make a state of `source_vars` from a source state and `input_vars` from this one.

        Groups wholly wanted are carried by blob key and loaded lazily; a
        group split by the request is loaded and its wanted members re-pickled.
        Holders wait meanwhile, as while a cell's child loads and saves.
        """
        with self.state.child_loads.held():
            return self._rebuild(msg)

    def _rebuild(self, msg):
        """`rebuild`, under the children's lock."""
        state = self.state
        source = msg.source_manifest
        snapshot.check_compatible(source)
        want_source = set(msg.source_vars) & set(source["variables"])
        want_input = (set(msg.input_vars) - want_source) & state.state_names()
        parent = state.manifest
        manifest = snapshot.new_manifest(msg.new_name, parent, "", parent["execution_count"],
                                         msg.auto_named)
        manifest["rebuilt_from"] = {"input": parent["name"], "source": source["name"]}
        state.load_modules()
        dirty = set()
        sides = ((parent, want_input, state.unloaded_groups),
                 (source, want_source, source["groups"]))
        unloaded = []
        for origin, wanted, origin_unloaded in sides:
            whole = [g for g in origin["groups"] if set(g["members"]) <= wanted]
            split = [g for g in origin["groups"]
                     if not wanted.isdisjoint(g["members"]) and g not in whole]
            for group in split:
                if group in origin_unloaded or origin is source:
                    self.load_split(group, wanted, origin["name"])
                dirty |= wanted & set(group["members"])
            unloaded += [g for g in whole if g in origin_unloaded or origin is source]
            modules = [n for n in origin["modules"] if n in wanted]
            volatile = [n for n in origin["volatile"] if n in wanted]
            snapshot.carry(manifest, origin, whole, modules, volatile)
            snapshot.load_modules(origin, state.namespace, set(modules))
            if origin is source:
                state.unloaded_volatile |= set(volatile)
        keep = want_input | want_source
        for name in user_names(state.namespace) - keep:
            del state.namespace[name]
        state.unloaded_volatile &= keep
        store = state.store()
        records = snapshot.save_groups(store, manifest, state.namespace, sorted(dirty),
                                       state.settings)
        snapshot.commit(store, manifest, records)
        state.unloaded_groups = unloaded
        return manifest, protocol.RebuildResult(manifest)

    def load_split(self, group, wanted, state_name):
        """Load a group of state `state_name` but keep only its `wanted` members; others
        keep their values."""
        namespace = self.state.namespace
        saved = {m: namespace[m] for m in group["members"]
                 if m not in wanted and m in namespace}
        snapshot.load_group(self.state.store(), group, namespace, state_name)
        for m in group["members"]:
            if m not in wanted:
                if m in saved:
                    namespace[m] = saved[m]
                else:
                    del namespace[m]
