"""The worker processes: zygote, holders of live states, and cell children.

The zygote is spawned by the server; it forks at once a second, warm one
that imports what cells commonly use, and forks holders itself (cold)
only until that one is up. A zygote forks one holder per state to
restore. A holder is idle; its `__main__` is its state's namespace. To
run a cell the holder forks a child (a spare is kept forked and warmed in
advance); the child runs the cell on a copy-on-write copy of the
namespace, stores what changed, answers, forks the holder of the new
state and stays on as its first spare, ready for the next cell. A failed
cell's child exits, so the input state is never touched. Every process
talks to the server over its own channel.
"""

import contextlib
import ctypes
import gc
import os
import select
import signal
import sys
import time
import traceback
import types

from kernel.worker import limits, reads as symbols
from kernel.channel import Channel, ChannelClosed
from storage import snapshot
from storage.store import Store, StoreError, StoreFull

# The SIGCHLD pipe of this process, closed in forked children (which make their own).
_wake_fds = []
# A spare child warms up only after this long without a request (see Holder.warm).
WARM_AFTER_S = 0.05
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option, value):
    """Call prctl(2); best effort (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _core_free():
    """True if fewer processes are running right now than there are cores (this one
    included); True where /proc/loadavg cannot tell."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return True
    return running <= (os.cpu_count() or 1)


def _fresh_main():
    """Install an empty `__main__` module and return its namespace dict."""
    import builtins
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    return main.__dict__


def _user_names(namespace):
    """The notebook variable names of a namespace."""
    return {n for n in namespace if snapshot.is_user_name(n)}


def _status_text(status):
    """Describe a wait status: the signal or exit code."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        hint = " (out of memory, or killed)" if sig == signal.SIGKILL else ""
        return f"killed by signal {name}{hint}", -sig
    return f"exited with code {os.WEXITSTATUS(status)}", os.WEXITSTATUS(status)


class Process:
    """What every worker process shares: settings, its channel, the store."""

    def __init__(self, sock_path, settings):
        """Remember how to reach the server and the store."""
        self.sock_path = sock_path
        self.settings = settings
        self.channel = None

    def connect(self, hello):
        """Open this process's own channel to the server and introduce itself."""
        self.channel = Channel.connect(self.sock_path)
        self.channel.send(dict(hello, pid=os.getpid()))

    def store(self):
        """This process's handle on the store."""
        s = self.settings
        return Store.for_process(s["server.data_dir"], max_store_gb=s["store.max_store_gb"],
                                 durability=s["store.durability"],
                                 zstd_level=s["store.zstd_level"])

    def reaper(self):
        """Route SIGCHLD to a pipe so the select loop can reap children."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        _wake_fds[:] = [r, w]
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(w)
        return r

    def reap(self, wake_fd):
        """Report every exited child to the server."""
        try:
            os.read(wake_fd, 4096)
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            text, code = _status_text(status)
            self.channel.send({"op": "exited", "pid": pid, "text": text, "code": code})


def zygote_main(sock_path, settings):
    """Entry point of the zygotes: a cold one serves at once, a warm one takes over.

    The spawned process forks, first thing, a second zygote that imports
    what cells commonly use and runs a throwaway cell before it connects
    (seconds); holders forked from it start warm, so their cells do not pay
    those imports again. Meanwhile the spawned one, cold, answers spawn
    requests within milliseconds of start (a holder it forks imports what
    its cells import, as in a fresh Python), and later stays on as the
    reaper of its holders and the fallback should the warm one die.
    """
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["MPLBACKEND"] = "Agg"
    limits.init_zygote()
    from kernel.worker import runner as cell  # every holder runs cells: imported once, here
    cell.outputs.watch_imports()
    warm = os.fork() == 0
    if warm:
        # Neither attribute survives a fork; the warm zygote dies with the cold one.
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        _warm(settings)
    namespace = _fresh_main()
    proc = Process(sock_path, settings)
    proc.connect({"role": "zygote", "warm": warm})
    wake = proc.reaper()
    while True:
        ready, _, _ = select.select([proc.channel, wake], [], [])
        if wake in ready:
            proc.reap(wake)
        if proc.channel not in ready:
            continue
        try:
            msg = proc.channel.recv()
        except ChannelClosed:
            os._exit(0)
        if msg["op"] == "spawn":
            gc.freeze()
            if os.fork() == 0:
                _become_worker()
                proc.channel.close()
                holder = Holder(sock_path, settings, namespace, msg["manifest"])
                holder.run_restored(msg["req"])


def _warm(settings):
    """Import what cells commonly use and run a throwaway cell, once, before any fork."""
    for name in ("kernel.worker.runner", "numpy", "pandas", "matplotlib", "matplotlib.pyplot", "dill",
                 "IPython"):
        try:
            __import__(name)
        except Exception:
            pass
    from kernel.worker import outputs
    from kernel.worker.runner import compile_cell, run_cell
    outputs.warm()
    run_cell(compile_cell("_w = [1]\n_w", 0), {"__builtins__": __builtins__}, 0, settings)


def _become_worker():
    """Post-fork set-up of a worker: own process group, default signals."""
    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)
    for fd in _wake_fds:
        os.close(fd)
    _wake_fds.clear()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Holder(Process):
    """The holder of one live state; also, after a fork, the child running a cell."""

    def __init__(self, sock_path, settings, namespace, manifest):
        """Hold `manifest`'s state, its groups not yet loaded."""
        super().__init__(sock_path, settings)
        self.namespace = namespace
        self.manifest = manifest
        self.pending = list(manifest["groups"])
        self.volatile_pending = set(manifest["volatile"])
        self.modules_loaded = False
        self.background = True
        self.forked_holders = []  # pids of the holders this process forked (fork_holder)

    # Loading -------------------------------------------------------------

    def state_names(self):
        """Every variable name of the state, loaded or not."""
        return set(self.manifest["variables"])

    def pending_names(self):
        """Names of variables not loaded yet."""
        names = {m for g in self.pending for m in g["members"]}
        return names | self.volatile_pending | (
            set() if self.modules_loaded else set(self.manifest["modules"]))

    def load(self, names=None):
        """Load the groups holding `names` (all when None), modules, volatiles."""
        self.load_modules_now()
        keep = []
        for group in self.pending:
            if names is None or not names.isdisjoint(group["members"]):
                snapshot.load_group(self.store(), group, self.namespace)
            else:
                keep.append(group)
        self.pending = keep
        if self.volatile_pending and (names is None or names & self.volatile_pending):
            # A replay may read anything: load the whole state first.
            self.load_rest()
            snapshot.replay_volatile(self.manifest, self.namespace, self.volatile_pending)
            self.volatile_pending = set()

    def load_rest(self):
        """Load every group still pending."""
        for group in self.pending:
            snapshot.load_group(self.store(), group, self.namespace)
        self.pending = []

    # Holder loop ---------------------------------------------------------

    def run_restored(self, req):
        """Entry of a holder forked by the zygote to restore a state."""
        try:
            self.connect({"role": "holder", "req": req, "state_id": self.manifest["id"]})
            snapshot.check_compatible(self.manifest)
        except snapshot.IncompatibleState as exc:
            self.channel.send({"op": "failed", "ename": "IncompatibleState",
                               "evalue": str(exc)})
            os._exit(1)
        except Exception:
            os._exit(1)
        wake = self.reaper()
        self.channel.send({"op": "ready", "state_id": self.manifest["id"]})
        self.serve(wake, self.settings["workers.spare_children"])

    def serve(self, wake, spares):
        """Idle loop: fork children on request, load pending groups meanwhile.

        `spares` children are forked first, so that a cell finds one ready.
        """
        for _ in range(spares):
            self.fork_child()
        while True:
            busy = self.background and (self.pending or self.volatile_pending)
            timeout = 0 if busy else None
            ready, _, _ = select.select([self.channel, wake], [], [], timeout)
            if wake in ready:
                self.reap(wake)
            if self.channel in ready:
                try:
                    msg = self.channel.recv()
                except ChannelClosed:
                    self.exit()
                if msg["op"] == "fork":
                    self.fork_child()
                elif msg["op"] == "exit":
                    self.exit()
            elif not ready:
                self.load_step()

    def load_step(self):
        """Load one pending group between messages; on failure leave it to the cells."""
        try:
            if self.pending:
                snapshot.load_group(self.store(), self.pending[0], self.namespace)
                self.pending.pop(0)
            elif self.volatile_pending:
                self.load(set(self.volatile_pending))
        except Exception:
            # A child that needs the value retries and reports the error itself.
            self.background = False
            self.channel.send({"op": "log", "text": traceback.format_exc()})

    def exit(self):
        """Leave, taking any processes the state's cells left behind."""
        try:
            os.killpg(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(0)

    def fork_child(self):
        """Fork a child that waits, warmed, for a cell to run."""
        # Objects inherited from now on are out of the cyclic GC's reach in the child,
        # so a collection there does not write to (and copy) every page of the state.
        gc.freeze()
        if os.fork() == 0:
            _become_worker()
            self.channel.close()
            self.forked_holders = []  # not this process's children
            try:
                self.connect({"role": "child", "holder_state_id": self.manifest["id"]})
                self.warm()
                msg = self.channel.recv()
            except (ChannelClosed, OSError):
                os._exit(0)
            self.run(msg)

    def warm(self):
        """Touch what a cell run touches, so its pages are copied before the cell.

        Only once no request came for WARM_AFTER_S and a core is free, and
        step by step, stopping as soon as a request waits: in a notebook run
        top to bottom the next cell comes within milliseconds and would wait
        for the warm-up, and while cells keep every core busy the warm-up
        would slow them down more than it saves (about 1 ms a cell).
        """
        from kernel.worker.runner import compile_cell, run_cell
        from storage import serializer
        self.store()
        scratch = {"__builtins__": self.namespace["__builtins__"]}
        steps = (  # len(): an int result, which needs no IPython shell in a cold worker.
            lambda: run_cell(compile_cell("_w = [1.0, 'x']\nlen(_w)", 0), scratch, 0,
                             self.settings),
            lambda: serializer.dumps([scratch.get("_w")], self.namespace))
        for step in steps:
            while not select.select([self.channel], [], [], WARM_AFTER_S)[0]:
                if _core_free():
                    break
            else:
                return
            step()

    # Child: run one cell ---------------------------------------------------

    def run(self, msg):
        """Run requests in this child: after one that made a state, stay as a spare of
        that state (its holder forked off) and take the next; otherwise exit."""
        handlers = {"execute": self.execute, "multistate": self.multistate,
                    "rebuild": self.rebuild}
        while True:
            made = None
            try:
                made = handlers[msg["op"]](msg)
            except ChannelClosed:
                pass
            except Exception as exc:
                try:
                    self.channel.send({"op": "result", "error": {
                        "ename": type(exc).__name__, "evalue": str(exc),
                        "traceback": traceback.format_exc().splitlines()}, "output": []})
                except ChannelClosed:
                    pass
            if made is None:
                os._exit(0)
            self.manifest, answer = made
            try:
                self.channel.send(answer)
                self.fork_holder()
                msg = self.channel.recv()
            except (ChannelClosed, OSError):
                os._exit(0)

    def prepare(self, cell, extra_names=()):
        """Analyse the cell's reads and writes, loading what it needs first."""
        names_before = self.state_names() | set(extra_names)
        while True:
            if cell.uses_ipython:
                found = symbols.Analysis(
                    {n for n in names_before}, {n for n in names_before}, True)
            else:
                found = symbols.analyse(cell.codes, self.namespace, names_before)
            missing = (found.reads | found.writes) & self.pending_names()
            if found.dynamic:
                missing = self.pending_names()
            if not missing:
                return found
            self.load(missing)

    def run_cell(self, cell, count):
        """Run a compiled cell under the cell limits, SIGINT raising KeyboardInterrupt."""
        from kernel.worker.runner import run_cell
        applied = limits.begin_cell(self.settings)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            result = run_cell(cell, self.namespace, count, self.settings)
            return limits.relabel(result, applied)
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            limits.end_cell(applied)

    def execute(self, msg):
        """Run a cell; on success store the new state and stay as its holder."""
        from kernel.worker.runner import compile_cell
        count = self.manifest["execution_count"] + 1
        answer = {"op": "result", "output": [], "error": None, "state_name": None,
                  "accessed_symbols": [], "modified_symbols": [], "deleted_symbols": [],
                  "execution_count": count, "volatile_symbols": []}
        cell = compile_cell(msg["code"], count)
        if cell.error:
            answer["error"] = cell.error
            self.channel.send(answer)
            return
        try:
            found = self.prepare(cell)
        except (StoreError, snapshot.ReplayFailed) as exc:
            answer["error"] = {"ename": type(exc).__name__, "evalue": str(exc), "traceback": []}
            self.channel.send(answer)
            return
        before = {n: self.namespace[n] for n in _user_names(self.namespace)}
        names_before = self.state_names()
        outputs, error = self.run_cell(cell, count)
        after = _user_names(self.namespace)
        modified = {n for n in after if n not in before or before[n] is not self.namespace[n]}
        modified |= found.writes & after
        deleted = names_before - after - self.pending_names()
        answer.update(output=outputs, error=error,
                      accessed_symbols=sorted(found.reads & names_before),
                      modified_symbols=sorted(modified), deleted_symbols=sorted(deleted))
        if error is not None:
            self.channel.send(answer)
            return
        self.channel.send({"op": "phase", "phase": "saving"})
        touched = found.reads | found.writes | modified | deleted
        if found.dynamic:
            touched |= names_before | after
        try:
            manifest = self.save(msg, count, touched, after)
        except (StoreFull, StoreError) as exc:
            answer["error"] = {"ename": type(exc).__name__, "evalue": str(exc), "traceback": []}
            answer["store_full"] = isinstance(exc, StoreFull)
            self.channel.send(answer)
            return
        answer.update(state_name=msg["new_name"], manifest=manifest,
                      volatile_symbols=sorted(manifest["volatile"]))
        return manifest, answer

    def save(self, msg, count, touched, present):
        """Write the new state: dirty groups re-pickled, the others carried."""
        parent = self.manifest
        manifest = snapshot.new_manifest(msg["new_name"], parent, msg["code"], count,
                                         msg.get("auto_named", False))
        carried, dirty = [], set()
        for group in parent["groups"]:
            if touched.isdisjoint(group["members"]):
                carried.append(group)
            else:
                dirty.update(m for m in group["members"] if m in present)
        modules = [n for n in parent["modules"] if n not in touched]
        volatile = [n for n in parent["volatile"] if n not in touched]
        dirty |= (touched & present) - set(modules) - set(volatile)
        snapshot.carry(manifest, parent, carried, modules, volatile)
        tag = f"{count}:{manifest['code_digest']}"
        records = snapshot.save_groups(self.store(), manifest, self.namespace, sorted(dirty),
                                       self.settings, class_tag=tag, parent=parent)
        snapshot.commit(self.store(), manifest, records)
        return manifest

    def fork_holder(self):
        """Fork the idle holder of the state this process just made.

        This process, connected and warm, stays as the state's first spare:
        in a notebook run top to bottom the next cell comes from this state
        within milliseconds and need not wait for a fork.
        """
        # Holders forked earlier and since stopped: reaped by pid (a cell's own
        # subprocesses are the cell's to wait for).
        for pid in list(self.forked_holders):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue
            self.forked_holders.remove(pid)
        gc.collect()  # the last cell's cyclic garbage, before freeze() would keep it
        gc.freeze()
        pid = os.fork()
        if pid:
            self.forked_holders.append(pid)
            return
        _become_worker()
        self.channel.close()
        self.forked_holders = []  # not this process's children
        try:
            self.connect({"role": "holder", "state_id": self.manifest["id"]})
        except (ChannelClosed, OSError):
            os._exit(0)
        self.serve(self.reaper(), max(self.settings["workers.spare_children"] - 1, 0))

    def multistate(self, msg):
        """Run a cell with other states' variables under aliases; store nothing."""
        from kernel.worker.runner import compile_cell
        answer = {"op": "result", "output": [], "error": None, "state_name": None,
                  "accessed_symbols": [], "modified_symbols": [], "deleted_symbols": []}
        self.load()
        for alias, manifest in msg["aliases"].items():
            scope = {"__builtins__": self.namespace["__builtins__"]}
            snapshot.check_compatible(manifest)
            snapshot.load_modules(manifest, scope)
            for group in manifest["groups"]:
                snapshot.load_group(self.store(), group, scope)
            snapshot.replay_volatile(manifest, scope)
            scope.pop("__builtins__")
            self.namespace[alias] = types.SimpleNamespace(**scope)
        count = self.manifest["execution_count"] + 1
        cell = compile_cell(msg["code"], count)
        if cell.error:
            answer["error"] = cell.error
            self.channel.send(answer)
            return
        names_before = _user_names(self.namespace)
        found = self.prepare(cell, msg["aliases"])
        before = {n: self.namespace[n] for n in names_before}
        outputs, error = self.run_cell(cell, count)
        after = _user_names(self.namespace)
        answer.update(
            output=outputs, error=error,
            accessed_symbols=sorted(found.reads & names_before),
            modified_symbols=sorted(
                n for n in after if n not in before or before[n] is not self.namespace[n]),
            deleted_symbols=sorted(names_before - after))
        self.channel.send(answer)

    def rebuild(self, msg):
        """Make a state of `source_vars` from a source state and `input_vars` from this one.

        Groups wholly wanted are carried by blob key and loaded lazily; a
        group split by the request is loaded and its wanted members re-pickled.
        """
        source = msg["source_manifest"]
        snapshot.check_compatible(source)
        want_source = set(msg["source_vars"]) & set(source["variables"])
        want_input = (set(msg["input_vars"]) - want_source) & self.state_names()
        parent = self.manifest
        manifest = snapshot.new_manifest(msg["new_name"], parent, "", parent["execution_count"],
                                         msg.get("auto_named", False))
        manifest["rebuilt_from"] = {"input": parent["name"], "source": source["name"]}
        self.load_modules_now()
        dirty = set()
        sides = ((parent, want_input, self.pending), (source, want_source, source["groups"]))
        pending = []
        for origin, wanted, unloaded in sides:
            whole = [g for g in origin["groups"] if set(g["members"]) <= wanted]
            split = [g for g in origin["groups"]
                     if not wanted.isdisjoint(g["members"]) and g not in whole]
            for group in split:
                if group in unloaded or origin is source:
                    self.load_split(group, wanted)
                dirty |= wanted & set(group["members"])
            pending += [g for g in whole if g in unloaded or origin is source]
            modules = [n for n in origin["modules"] if n in wanted]
            volatile = [n for n in origin["volatile"] if n in wanted]
            snapshot.carry(manifest, origin, whole, modules, volatile)
            snapshot.load_modules(origin, self.namespace, set(modules))
            if origin is source:
                self.volatile_pending |= set(volatile)
        keep = want_input | want_source
        for name in _user_names(self.namespace) - keep:
            del self.namespace[name]
        self.volatile_pending &= keep
        records = snapshot.save_groups(self.store(), manifest, self.namespace, sorted(dirty),
                                       self.settings)
        snapshot.commit(self.store(), manifest, records)
        self.pending = pending
        answer = {"op": "result", "error": None, "state_name": msg["new_name"],
                  "manifest": manifest, "output": []}
        return manifest, answer

    def load_modules_now(self):
        """Import the state's module variables if not done yet."""
        if not self.modules_loaded:
            snapshot.load_modules(self.manifest, self.namespace)
            self.modules_loaded = True

    def load_split(self, group, wanted):
        """Load a group but keep only its `wanted` members; others keep their values."""
        saved = {m: self.namespace[m] for m in group["members"]
                 if m not in wanted and m in self.namespace}
        snapshot.load_group(self.store(), group, self.namespace)
        for m in group["members"]:
            if m not in wanted:
                if m in saved:
                    self.namespace[m] = saved[m]
                else:
                    del self.namespace[m]
