"""The worker pool: the zygote's lifecycle, the live states' holders, their spares.

The server never forks. It spawns the zygote, and keeps the holders of
live states in an LRU bounded by count and resident memory. Each live
state keeps spare children forked in advance, so a cell does not wait for
a fork. Messages reach the pool through kernel/server/connections.py; the
processes of one live state, and the messages to its holder, are a
LiveState (kernel/server/live.py).
"""

import collections
import itertools
import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time

from snapkernel.kernel import launch, protocol, trace
from snapkernel.kernel.server.connections import Connections
from snapkernel.kernel.server.live import LiveState, WorkerError
from snapkernel.kernel.worker.process import worker_env

log = logging.getLogger("snapshot_kernel")
# Once the child that made a state is found dead before the state's holder connected, the
# holder (if it was forked at all) has this long to connect; then the state counts as not
# live, and is restored when run from.
HOLDER_AFTER_MAKER_S = 2.0


class Pool:
    """Spawns and tracks every worker process."""

    def __init__(self, settings, env=None, cwd=None):
        """Prepare the socket and bookkeeping; `start` launches the zygote.

        The zygote starts from `env` (default: this process's environment) in
        `cwd` (default: the repository), plus the variables it always sets.
        """
        self.settings = settings
        self.env = env
        self.cwd = cwd
        self.connections = Connections(self._introduce, self._closed)
        self.lock = threading.RLock()
        self.live = collections.OrderedDict()  # state id -> LiveState, least recent first
        self.live_by_pid = {}  # holder pid -> LiveState
        self.restores_waiting = {}  # Spawn req -> queue receiving the holder's connection
        self.restoring = {}  # state id -> Event set when its restore is over
        self.spares_before_adoption = {}  # state id -> spares that connected before it was live
        # pid of a child that made a state -> the LiveState, until the holder it forks connects
        self.awaiting_holder = {}
        self.holders_before_adoption = {}  # state id -> holder conn that connected likewise
        self.stopped_states = set()  # state ids whose late-arriving workers are killed
        self.zygotes = []  # connected zygotes: the cold one, then the warm one
        self.zygote_proc = None
        self.zygote_ready = threading.Condition(self.lock)
        self.req_ids = itertools.count(1)
        self.cells = 0  # children taken whose requests are not finished
        self.owed_when_quiet = set()  # live states owed a spare at the next quiet moment
        self.quiet_from = 0.0  # when the last request ended
        self.owed_due = None  # when the spares thread next looks at owed_when_quiet
        # One thread for the owed spares, woken through this condition: a Timer thread
        # per cell cost the cell about 0.35 ms (its start waits until the new thread
        # runs, on a core that was idle), a notify 0.08 ms.
        self.owed_wake = threading.Condition(self.lock)
        self.owed_thread = threading.Thread(target=self._owed_spares, name="owed-spares",
                                            daemon=True)

    def start(self):
        """Start accepting workers and spawn the zygote; the server's trace begins (the
        zygote's hello is stamped)."""
        trace.configure(self.settings, "server")
        self.connections.start()
        self.owed_thread.start()
        self._spawn_zygote()

    def _spawn_zygote(self):
        """Spawn (not fork) the zygote with a fixed hash seed and the Agg backend."""
        if self.connections.closed:
            # A request still waiting when the pool closed must not start another zygote.
            raise WorkerError("WorkerStartFailed", "the worker pool is closed")
        env = worker_env(os.environ if self.env is None else self.env)
        out = open(self.settings["server.log_file"] or os.devnull, "ab")
        # Started with -P (our packages are imported before the working directory is on
        # sys.path); then the working directory goes first on sys.path as `python -c`
        # and ipykernel put it, so cells import the modules beside their notebook.
        code = ("import json, sys\nfrom snapkernel.kernel.worker.zygote import zygote_main\n"
                "sys.path.insert(0, '')\n"
                "zygote_main(sys.argv[1], json.loads(sys.argv[2]))")
        # Without a cwd of its own (fresh runs give one) it works in the server's.
        self.zygote_proc = subprocess.Popen(
            launch.command(code, self.connections.sock_path, json.dumps(self.settings)),
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, cwd=self.cwd,
            start_new_session=True)
        out.close()

    # Connections -------------------------------------------------------------

    def _introduce(self, conn):
        """File a new connection by the role its hello names."""
        hello = conn.hello
        with self.lock:
            if hello.role == protocol.ZYGOTE:
                self.zygotes.append(conn)
                self.zygote_ready.notify_all()
                if hello.warm:
                    # Restored again on their next use, their cells start warm too.
                    for live in [s for s in self.live.values() if s.cold]:
                        del self.live[live.state_id]
                        self._stop(live)
                trace.stamp("zygote", "warm" if hello.warm else "cold")  # read by tests
            elif hello.role == protocol.HOLDER and hello.req is not None:
                waiter = self.restores_waiting.pop(hello.req, None)
                if waiter is None:
                    conn.kill()
                else:
                    waiter.put(conn)
            elif hello.role == protocol.HOLDER:
                # Forked by the child that made its state (see LiveState).
                live = self.live.get(hello.state_id)
                if live is not None and live.conn is None:
                    self._attach(live, conn)
                elif hello.state_id in self.stopped_states:
                    conn.kill()
                else:
                    self.holders_before_adoption[hello.state_id] = conn
            elif hello.role == protocol.SPARE:
                live = self.live.get(hello.state_id)
                if live is not None and live.alive():
                    live.spares.put(conn)
                    trace.stamp("spare-ready", str(hello.pid))  # read by tests
                elif hello.state_id in self.stopped_states:
                    conn.kill()  # forked just before its holder was evicted or retired
                else:
                    # A holder forks its first spare before its state is adopted.
                    self.spares_before_adoption.setdefault(hello.state_id, []).append(conn)

    def _closed(self, conn):
        """A worker is gone: forget it, and stop the live state it held."""
        with self.lock:
            live = self.live_by_pid.pop(conn.pid, None)
            if live is not None and self.live.get(live.state_id) is live:
                del self.live[live.state_id]
            if conn in self.zygotes:
                self.zygotes.remove(conn)
        if live is not None:
            live.stop()

    def exit_status(self, pid):
        """How worker `pid` ended, in words."""
        return self.connections.exit_status(pid)

    # Live states ---------------------------------------------------------------

    def _wait_zygote(self):
        """The connection of the warm zygote, else the cold one; respawns them if gone."""
        deadline = time.monotonic() + self.settings["workers.worker_start_timeout_s"]
        with self.lock:
            while True:
                alive = [z for z in self.zygotes if z.alive]
                if alive:
                    return max(alive, key=lambda z: z.hello.warm)
                if self.zygote_proc.poll() is not None:
                    self._spawn_zygote()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerError("WorkerStartFailed", "the zygote process did not start")
                self.zygote_ready.wait(min(left, 0.5))

    def live_state(self, manifest):
        """The live state of `manifest`, restoring it if needed.

        Requests that need the same state at once share one restore: a burst
        of first cells from one state must not fork a holder each and then
        stop all but the last (which left the others waiting for spares of a
        holder that was gone).
        """
        state_id = manifest["id"]
        while True:
            with self.lock:
                live = self.live.get(state_id)
                if live is not None and live.alive():
                    self.live.move_to_end(state_id)
                    return live
                done = self.restoring.get(state_id)
                if done is None:
                    done = self.restoring[state_id] = threading.Event()
                    break
            done.wait(self.settings["workers.worker_start_timeout_s"])
            with self.lock:
                if self.restoring.get(state_id) is done and not done.is_set():
                    raise WorkerError("WorkerStartFailed",
                                      "the state's restore did not finish in time")
                if state_id not in self.live:
                    # That restore failed: this request tries once on its own.
                    if self.restoring.get(state_id) is None:
                        done = self.restoring[state_id] = threading.Event()
                        break
        try:
            return self._restore(manifest)
        finally:
            with self.lock:
                self.restoring.pop(state_id, None)
            done.set()

    def _restore(self, manifest):
        """Fork a fresh holder from the zygote for `manifest`."""
        zygote = self._wait_zygote()
        req = next(self.req_ids)
        arrived = queue.Queue()
        with self.lock:
            self.restores_waiting[req] = arrived
            self.stopped_states.discard(manifest["id"])  # its new holder's spare is welcome
        zygote.send(protocol.Spawn(req, manifest))
        timeout = self.settings["workers.worker_start_timeout_s"]
        try:
            conn = arrived.get(timeout=timeout)
        except queue.Empty:
            with self.lock:
                self.restores_waiting.pop(req, None)
            raise WorkerError("WorkerStartFailed", "a worker process did not start in time")
        try:
            msg = conn.messages.get(timeout=timeout)
        except queue.Empty:
            msg = protocol.Failed("WorkerStartFailed", "a restored worker did not get ready")
        if not isinstance(msg, protocol.Ready):
            conn.kill()
            msg = msg or protocol.Failed("WorkerDied", "the worker restoring the state died")
            raise WorkerError(msg.ename, msg.evalue)
        # A cold holder is replaced once the warm zygote is up, unless restoring its
        # state again would cost more than the imports its cells miss.
        cold = not zygote.hello.warm and buffer_bytes(manifest, self.settings) < (
            self.settings["workers.rewarm_max_mb"] * 2 ** 20)
        live = LiveState(manifest["id"], conn, cold=cold)
        live.first_spare_coming = self.settings["workers.spare_children"] > 0
        return self._adopt(manifest["id"], live)

    def adopt_made(self, state_id, child, holder=True):
        """The state `state_id` was made by `child`'s cell: it stays as the first spare,
        and the holder it forks is attached when it connects; with `holder` False,
        it forks none and is the state's only process (LiveState.holderless)."""
        live = LiveState(state_id, None, holderless=not holder,
                         connect_within=self.settings["workers.worker_start_timeout_s"])
        live.child_that_made_it = child
        live.spares.put(child)
        if holder:
            with self.lock:
                self.awaiting_holder[child.pid] = live
        self._adopt(state_id, live)

    def _adopt(self, state_id, live):
        """Make `live` the live state of `state_id`; evict beyond the limits."""
        with self.lock:
            old = self.live.pop(state_id, None)
            self.live[state_id] = live
            self.stopped_states.discard(state_id)
            if live.conn is None:
                # Looked up in the same locked step that makes the state visible: a
                # holder connecting in between would find neither and wait forever.
                early = self.holders_before_adoption.pop(state_id, None)
                if early is not None:
                    self._attach(live, early)
            else:
                self.live_by_pid[live.conn.pid] = live
            for spare in self.spares_before_adoption.pop(state_id, []):
                live.spares.put(spare)
        if old is not None and old is not live:
            self._stop(old)
        self._evict()
        return live

    def _attach(self, live, conn):
        """`conn` is the holder process of `live`'s state (called with the lock held)."""
        live.conn = conn
        self.live_by_pid[conn.pid] = live
        self._forget_maker(live)
        for _ in range(live.forks_owed):
            conn.send(protocol.Fork())
        live.forks_owed = 0

    def take_child(self, live, chain=False):
        """(a child of `live`'s holder ready to run a request (a spare, or a new
        fork), whether that child holds the state alone: it made the state and
        forks no holder, the state being holderless or this request a chain step).

        `chain` (an Execute): if the child that made the state has not forked
        its holder yet (a client that sends its next cell as soon as it has
        the answer), it takes the cell as a step of a chain: the state gets no
        holder, as a fork would hold up the cell (3 to 20 ms, and every page
        the cell writes would then be copied), and a later request restores it
        from the store (see _take_maker). Not with workers.hold_chain_steps.

        Pair every successful call with `cell_done` once the request is over.
        """
        if live.holderless:
            return self._take_only_child(live), True
        if chain and not self.settings["workers.hold_chain_steps"]:
            child = self._take_maker(live)
            if child is not None:
                return child, True
        return self._take_spare(live), False

    def _take_maker(self, live):
        """The child that made `live`'s state, if the state's holder has not connected
        yet; the state then leaves the live states (a holder already forked is
        killed when it connects). None otherwise."""
        with self.lock:
            maker = live.child_that_made_it
            if live.conn is not None or maker is None or self.live.get(live.state_id) \
                    is not live:
                return None
            try:
                child = live.spares.get_nowait()
            except queue.Empty:
                return None
            if child is not maker:
                live.spares.put(child)
                return None
            del self.live[live.state_id]
            self.stopped_states.add(live.state_id)
            self._forget_maker(live)
            live.stop()  # requests waiting for a spare of it restore it instead
            if child.idle():
                self.cells += 1
                return child
        child.kill()
        self.child_died(child.pid)
        return None

    def _take_spare(self, live):
        """A spare of `live`'s holder (or a new fork)."""
        timeout = self.settings["workers.worker_start_timeout_s"]
        while True:
            try:
                child = live.spares.get_nowait()
            except queue.Empty:
                with self.lock:
                    # A restored holder forks its first spare on its own: that one, not
                    # one more (an extra spare forked while the holder loads would hold
                    # part of the state, and a later cell would load the rest again).
                    coming = live.first_spare_coming and live.alive()
                    live.first_spare_coming = False
                    asked = coming or live.ask_fork()
                    if asked and not coming and live in self.owed_when_quiet:
                        # The state is run from again: its owed spare is due now.
                        self.owed_when_quiet.discard(live)
                        live.ask_fork()
                if not asked:
                    raise WorkerError("WorkerDied", "the state's holder process is gone")
                child = self._wait_spare(live, timeout)
                if coming and child is not None:
                    self._replace(live, child)
            else:
                live.first_spare_coming = False
                if child is not None:
                    self._replace(live, child)
            if child is None:
                # The state was stopped (evicted, replaced, its holder died) while this
                # request waited: left for the next waiter too; the caller restores it anew.
                live.spares.put(None)
                raise WorkerError("WorkerDied", "the state's holder process is gone")
            if child.idle():
                with self.lock:
                    self.cells += 1
                return child
            child.kill()
            self.child_died(child.pid)

    def child_died(self, pid):
        """Child `pid` died. If it made a state whose holder has not connected, it may have
        died before it forked that holder (the OOM killer; a cell's os.register_at_fork
        hook): the state waits HOLDER_AFTER_MAKER_S more for it, not
        worker_start_timeout_s."""
        with self.lock:
            live = self.awaiting_holder.pop(pid, None)
            if live is not None and live.conn is None:
                live.deadline = min(live.deadline, time.monotonic() + HOLDER_AFTER_MAKER_S)

    def _forget_maker(self, live):
        """`live` waits for no holder any more (lock held)."""
        for pid in [p for p, waiting in self.awaiting_holder.items() if waiting is live]:
            del self.awaiting_holder[pid]

    def _wait_spare(self, live, timeout):
        """The next spare of `live` within `timeout` seconds; WorkerError if none comes,
        or as soon as the state stops being live (its holder will not connect)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return live.spares.get(timeout=min(0.1, max(deadline - time.monotonic(), 0)))
            except queue.Empty:
                pass
            if not live.alive():
                raise WorkerError("WorkerDied", "the state's holder did not come")
            if time.monotonic() >= deadline:
                raise WorkerError("WorkerStartFailed", "no child process arrived")

    def _take_only_child(self, live):
        """The child of a holderless state; the state is no longer live once it is taken
        (a later request restores it from the store)."""
        with self.lock:
            if self.live.get(live.state_id) is live:
                del self.live[live.state_id]
            try:
                child = live.spares.get_nowait()
            except queue.Empty:
                child = None
            live.stop()
            if child is not None and child.idle():
                self.cells += 1
                return child
        if child is not None:
            child.kill()
        raise WorkerError("WorkerDied", "the state's only process is gone")

    def _replace(self, live, taken):
        """Ask for a spare in place of `taken`: now, or at the next quiet moment if
        `taken` made the state.

        A notebook run top to bottom takes the child that made each state for
        the next cell and does not come back; forking a replacement then would
        compete for the cores with that cell. A later run from the state (a
        cell edited and run again) finds a spare ready; one that comes before
        that waits for a fork, and asks for the owed spare at once.
        """
        if not self.settings["workers.spare_children"]:
            return
        with self.lock:
            if taken is live.child_that_made_it:
                live.child_that_made_it = None
                self.owed_when_quiet.add(live)
            else:
                live.ask_fork(now=False)

    def cell_done(self):
        """A request that `take_child` served is over; once none has run for
        workers.spare_after_quiet_s, the spares owed are asked for."""
        with self.lock:
            self.cells -= 1
            self.quiet_from = time.monotonic()
            if not self.cells and self.owed_when_quiet and self.owed_due is None:
                self._ask_owed_in(self.settings["workers.spare_after_quiet_s"])

    def _ask_owed_in(self, seconds):
        """Have the spares thread look at the owed spares in `seconds` (lock held)."""
        self.owed_due = time.monotonic() + seconds
        self.owed_wake.notify()

    def _owed_spares(self):
        """Thread: ask for the owed spares when due (see _ask_owed)."""
        with self.lock:
            while not self.connections.closed:
                left = None if self.owed_due is None else self.owed_due - time.monotonic()
                if left is None or left > 0:
                    self.owed_wake.wait(left)
                    continue
                self.owed_due = None
                self._ask_owed()

    def _ask_owed(self):
        """If no request ran for a quiet period, ask for one owed spare, that of the state
        used last, and for the next one a quiet period later (lock held).

        One at a time: after a notebook run a spare is owed to each of its
        states, and forking them all at once (each fork of a process holding
        the common imports costs 5 to 30 ms of a core) held up the next run's
        first cell by about 100 ms.
        """
        if self.cells:
            return  # the next cell_done sets the time again
        quiet = self.settings["workers.spare_after_quiet_s"]
        left = self.quiet_from + quiet - time.monotonic()
        if left > 0:
            self._ask_owed_in(left)
            return
        for live in reversed(self.live.values()):
            if live in self.owed_when_quiet:
                self.owed_when_quiet.discard(live)
                if live.alive() and live.ask_fork(now=False):
                    break
        # States no longer live (evicted, retired) are owed nothing.
        self.owed_when_quiet &= set(self.live.values())
        if self.owed_when_quiet:
            self._ask_owed_in(quiet)

    def retire(self, state_id):
        """Stop the holder of a state no name points to any more (or never adopted)."""
        with self.lock:
            live = self.live.pop(state_id, None)
            early = self.spares_before_adoption.pop(state_id, [])
            early_holder = self.holders_before_adoption.pop(state_id, None)
            self.stopped_states.add(state_id)
        for conn in early + ([early_holder] if early_holder else []):
            conn.kill()
        if live is not None:
            self._stop(live)

    def _stop(self, live):
        """Kill a live state's processes once it left the LRU."""
        with self.lock:
            if live.conn is not None:
                self.live_by_pid.pop(live.conn.pid, None)
            self.stopped_states.add(live.state_id)
            self._forget_maker(live)
        live.stop()

    def _evict(self):
        """Evict least recently used holders past max_live_states or memory."""
        max_states = self.settings["workers.max_live_states"]
        max_bytes = self.settings["workers.max_live_memory_mb"] * 2 ** 20
        while True:
            with self.lock:
                if len(self.live) <= 1:
                    return
                over = len(self.live) > max_states
                if not over:
                    over = sum(s.rss() for s in self.live.values()) > max_bytes
                if not over:
                    return
                _, victim = self.live.popitem(last=False)
            log.info("evicting the holder of state %s", victim.state_id)
            self._stop(victim)

    def live_ids(self):
        """State ids with a live holder, least recently used first."""
        with self.lock:
            return list(self.live)

    # Shutdown ----------------------------------------------------------------

    def reset(self):
        """Stop every holder (children running cells finish on their own)."""
        with self.lock:
            states = list(self.live.values())
            self.live.clear()
        for live in states:
            self._stop(live)

    def close(self):
        """Kill every worker process and remove the socket."""
        self.reset()
        self.connections.close()
        with self.lock:
            self.owed_wake.notify()  # the spares thread ends
        if self.zygote_proc is not None:
            try:
                os.killpg(self.zygote_proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.zygote_proc.wait()


def buffer_bytes(manifest, settings):
    """About how many bytes the large buffers of a state hold (chunks x chunk size)."""
    chunks = sum(sum(group.get("layout") or []) for group in manifest["groups"])
    return chunks * settings["store.chunk_bytes"]
