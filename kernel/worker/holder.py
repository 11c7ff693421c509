"""The holder of one live state: an idle process whose `__main__` is the state.

A holder restored by a zygote loads its state's alias groups lazily: the
groups a cell needs first (kernel/worker/child.py asks for them), the rest
between messages. To run a cell the holder forks a child (kernel/worker/
child.py) on a copy-on-write copy of the namespace; it keeps one such spare
forked and warmed in advance. The holder itself never runs a cell, so its
state never changes.
"""

import contextlib
import fcntl
import gc
import os
import select
import signal
import time
import traceback

from snapkernel.kernel import protocol, trace
from snapkernel.kernel.channel import ChannelClosed
from snapkernel.kernel.worker import context, replay
from snapkernel.kernel.worker.process import WorkerProcess, core_free, fork_worker
from snapkernel.storage import snapshot
from snapkernel.storage.store import StoreError, encode_manifest

# A spare child warms up only after this long without a request (see StateHolder.warm).
WARM_AFTER_S = 0.05
# How often a holder that waits for busy children looks again (see ChildLock).
CHILD_LOAD_POLL_S = 0.05


class ChildLock:
    """Tells holders whether children are busy: a POSIX lock that children hold
    (shared) and holders test.

    Holders load their states in the background, between messages; a child
    forked before its holder had loaded the state loads what its cell needs
    itself (a cell after a restart). On a 1 GB frame after a restart, the
    child and its holder restored it at once, on the same cores and memory
    (2 here), and the cell waited for both; from a second state sharing the
    frame's blobs, the first state's holder did the same to that state's
    child (issue 27). So a holder loads in the background only while no
    child holds either of two such locks: the zygote's `child-loads`, made
    before any fork and shared by all holders, which every cell's child
    holds while it loads or saves (its answer waits for the save); and the
    holder's own `cells-running`, which its children hold while they serve
    a request (StateHolder.cells_running). Such a lock goes with its
    process, so a child killed meanwhile never holds a holder back.
    """

    def __init__(self, name):
        """A new file for children to lock (`name`: its name in /proc/PID/fd)."""
        self.name = name
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self.depth = 0  # held() calls open in this process (a fork inherits none open)

    @contextlib.contextmanager
    def held(self):
        """Hold the lock (in a child, while it is busy). Nested calls hold it until the
        outermost ends: one POSIX unlock would release it whole."""
        if self.depth == 0:
            fcntl.lockf(self.fd, fcntl.LOCK_SH)  # shared: several children may load at once
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def renew(self):
        """Lock another file from now on (in a child that made a state: its own children
        and those of the holder it forks are that state's, not its parent's)."""
        os.close(self.fd)
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC)

    def now(self):
        """True while a child holds the lock (asked by a holder)."""
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.lockf(self.fd, fcntl.LOCK_UN)
        return False


class StateHolder(WorkerProcess):
    """One state's namespace, loaded lazily; in a forked child, the state a cell runs on."""

    def __init__(self, sock_path, settings, namespace, manifest, child_loads):
        """Hold `manifest`'s state, its groups not yet loaded; `child_loads`: the zygote's
        `child-loads` ChildLock."""
        super().__init__(sock_path, settings)
        self.namespace = namespace
        self.manifest = manifest
        self.unloaded_groups = list(manifest["groups"])
        self.unloaded_volatile = set(manifest["volatile"])
        # Imported only when a cell needs them or in the background: `x += 1` on a
        # restored state must not wait for pandas to import.
        self.unloaded_modules = set(manifest["modules"])
        self.load_in_background = True
        self.forks_deferred = 0  # replacement spares to fork once the state is loaded
        self.child_loads = child_loads
        # Locked by this holder's children while they serve a request: the cell a client
        # waits for is run from this state, and its holder's background load would only
        # compete with it (a 1 GB frame's restore, on the cores the cell runs on).
        self.cells_running = ChildLock("cells-running")
        self.holder_pid = None  # the process serving the state (see serve)
        # The process context as of this state ({provider: (blob key, value)}, see
        # kernel/worker/context.py), and what a restore could not apply as it was.
        self.context = {}
        self.context_warnings = []

    # Loading -------------------------------------------------------------

    def state_names(self):
        """Every variable name of the state, loaded or not."""
        return set(self.manifest["variables"])

    def unloaded_names(self):
        """Names of variables not loaded yet."""
        names = {m for g in self.unloaded_groups for m in g["members"]}
        return names | self.unloaded_volatile | self.unloaded_modules

    def module_variables_of(self, packages):
        """Names of the module variables not imported yet whose top-level package is one
        of `packages`."""
        modules = self.manifest["modules"]
        return {n for n in self.unloaded_modules if modules[n].partition(".")[0] in packages}

    def load(self, names=None):
        """Load the groups holding `names` (all when None), modules, volatiles."""
        if os.getpid() == self.holder_pid:
            self._load(names)
        else:
            with self.child_loads.held():  # in a cell's child: holders wait meanwhile
                self._load(names)

    def _load(self, names):
        """`load`, in a child under the children's lock."""
        self.load_modules(names)
        keep = []
        for group in self.unloaded_groups:
            if names is None or not names.isdisjoint(group["members"]):
                # In a cell's child: a value its holder had not loaded when it forked it.
                trace.stamp("loading", self.manifest["name"])
                self.context_warnings += snapshot.load_group(
                    self.store(), group, self.namespace, self.manifest["name"])
            else:
                keep.append(group)
        self.unloaded_groups = keep
        if self.unloaded_volatile and (names is None or names & self.unloaded_volatile):
            # A replay may read anything: load the whole state first.
            self._load(set(self.state_names()) - self.unloaded_volatile)
            replay.volatile(self.manifest, self.namespace, self.settings,
                            self.unloaded_volatile)
            self.unloaded_volatile = set()
        context.after_load(self.namespace)

    def load_modules(self, names=None):
        """Import the state's module variables among `names` (all when None) not
        imported yet, with those of the same top-level packages: a package has an
        attribute for a submodule only once something imported that submodule (as
        `import statsmodels.api as sm` gives `statsmodels.graphics.gofplots`), and
        a cell that reads only the package must find it as the session that made
        the state had it."""
        modules = self.manifest["modules"]
        wanted = set(self.unloaded_modules if names is None else self.unloaded_modules & names)
        packages = {modules[n].partition(".")[0] for n in wanted}
        wanted |= self.module_variables_of(packages)
        if wanted:
            snapshot.load_modules(self.manifest, self.namespace, wanted)
            self.unloaded_modules -= wanted

    def load_step(self):
        """Load one unloaded group between messages; on failure leave it to the cells."""
        try:
            if self.unloaded_modules:
                self.load_modules()
            elif self.unloaded_groups:
                self.context_warnings += snapshot.load_group(
                    self.store(), self.unloaded_groups[0], self.namespace,
                    self.manifest["name"], self.yield_to_children)
                self.unloaded_groups.pop(0)
            elif self.unloaded_volatile:
                self.load(set(self.unloaded_volatile))
            context.after_load(self.namespace)
            if not self.unloaded_names():
                trace.stamp("loaded", self.manifest["name"])
                self.fork_deferred()
        except Exception:
            # A child that needs the value retries and reports the error itself.
            self.load_in_background = False
            self.channel.send(protocol.Log(traceback.format_exc()))
            self.fork_deferred()

    def children_busy(self):
        """Whether a background load should wait: while any cell's child loads or saves,
        or one of this holder's children serves a request."""
        return self.child_loads.now() or self.cells_running.now()

    def yield_to_children(self):
        """Wait while children are busy (between the chunks of a background load, which
        may have begun before that child did)."""
        while self.children_busy():
            time.sleep(CHILD_LOAD_POLL_S)

    def fork_deferred(self):
        """Fork the replacement spares asked for while the state was loading."""
        while self.forks_deferred:
            self.forks_deferred -= 1
            self.fork_child()

    # Holder loop ---------------------------------------------------------

    def restore(self, req):
        """Entry of a holder forked by a zygote to restore a state (answers Spawn `req`)."""
        try:
            self.connect(protocol.HOLDER, req=req, state_id=self.manifest["id"])
            snapshot.check_compatible(self.manifest)
        except snapshot.IncompatibleState as exc:
            self.channel.send(protocol.Failed("IncompatibleState", str(exc)))
            os._exit(1)
        except Exception:
            os._exit(1)
        # Before any value is loaded: the folder, sys.path and the modules imported from
        # files must be in place for the values that refer to them.
        try:
            self.context, self.context_warnings = context.restore(
                self.manifest, self.store(), self.settings)
        except StoreError as exc:
            self.channel.send(protocol.Failed(type(exc).__name__, f"state "
                                              f"{self.manifest['name']!r}: {exc}"))
            os._exit(1)
        wake = self.reaper()
        self.channel.send(protocol.Ready(self.manifest["id"]))
        self.serve(wake, self.settings["workers.spare_children"])

    def serve(self, wake, spares):
        """Idle loop: fork children on request, load unloaded groups meanwhile.

        `spares` children are forked first, so that a cell finds one ready.
        While children are busy, none are loaded here (ChildLock).
        """
        self.holder_pid = os.getpid()
        for _ in range(spares):
            self.fork_child()
        while True:
            busy = self.load_in_background and self.unloaded_names()
            timeout = None
            if busy:
                timeout = CHILD_LOAD_POLL_S if self.children_busy() else 0
            ready, _, _ = select.select([self.channel, wake], [], [], timeout)
            if wake in ready:
                self.reap(wake)
            if self.channel in ready:
                try:
                    msg = self.channel.recv()
                except ChannelClosed:
                    self.leave()
                if isinstance(msg, protocol.Fork) and not msg.now and busy:
                    self.forks_deferred += 1
                elif isinstance(msg, protocol.Fork):
                    # A cell waits for this one; it stands for a deferred one too.
                    self.forks_deferred = max(self.forks_deferred - 1, 0)
                    self.fork_child()
            elif not ready and timeout == 0:
                self.load_step()

    def leave(self):
        """Exit, taking any processes the state's cells left behind."""
        try:
            os.killpg(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(0)

    def fork_child(self):
        """Fork a spare child that waits, warmed, for a request to run."""
        trace.stamp("spare", self.manifest["name"])  # tests read which holder forked when
        # Objects inherited from now on are out of the cyclic GC's reach in the child,
        # so a collection there does not write to (and copy) every page of the state.
        gc.freeze()
        if fork_worker("child") == 0:
            self.channel.close()
            from snapkernel.kernel.worker.child import CellChild
            try:
                self.connect(protocol.SPARE, state_id=self.manifest["id"])
                self.warm()
                msg = self.channel.recv()
            except (ChannelClosed, OSError):
                os._exit(0)
            CellChild(self).run(msg)

    def warm(self, wait=True):
        """Touch what a cell run touches, so its pages are copied before the cell.

        A forked process shares its pages with its parent until it writes to
        them, and each first write costs a page fault and a copy (about 0.5 to
        2 ms for a trivial cell, more than the cell itself): rehearsing a cell
        takes those faults before the request comes instead of after.

        wait=True (a new spare): only once no request came for WARM_AFTER_S
        and a core is free, and step by step, stopping as soon as a request
        waits: in a notebook run top to bottom the next cell comes within
        milliseconds and would wait for the warm-up, and while cells keep
        every core busy the warm-up would slow them down more than it saves.
        wait=False (the child that made the state, just after forking the
        holder): at once, as its next cell would take the same faults; still
        stopping as soon as a request waits.
        """
        for step in self.rehearsal():
            if wait:
                while not select.select([self.channel], [], [], WARM_AFTER_S)[0]:
                    if core_free():
                        break
                else:
                    return
            elif select.select([self.channel], [], [], 0)[0]:
                return
            with contextlib.suppress(Exception):  # a failed rehearsal only leaves pages cold
                step()

    def rehearsal(self):
        """The steps of a throwaway cell: compile, read analysis, run, save (not written)."""
        from snapkernel.kernel.worker import reads
        from snapkernel.kernel.worker.execution import compile_cell, run_cell
        self.store()
        scratch = {"__builtins__": self.namespace["__builtins__"]}
        # len(): an int result, which needs no IPython shell in a cold worker.
        cell = compile_cell("_w = [1.0, 'x']\nlen(_w)", 0)

        def save():
            """Pickle, hash and look the scratch value up in the store, and encode a
            manifest, as a save does; nothing is written."""
            manifest = snapshot.new_manifest("", self.manifest, cell.source, 0)
            snapshot.save_groups(self.store(), manifest, scratch, ["_w"], self.settings,
                                 parent=self.manifest)
            encode_manifest(manifest)

        return (lambda: reads.analyse(cell.codes, scratch, set()),
                lambda: run_cell(cell, scratch, 0, self.settings, events=False),
                save)
