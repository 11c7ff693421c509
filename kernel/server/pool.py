"""The server's side of the worker processes: zygote, live holders, children.

The server never forks. It spawns the zygote, listens on a Unix socket
where every worker process connects and says who it is, and keeps the live
holders in an LRU bounded by count and resident memory. A child that
dies is reported with its signal or exit code, which its parent (a holder,
or the zygote as subreaper) tells us.
"""

import collections
import itertools
import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from kernel.channel import Channel, ChannelClosed
from kernel.config import ROOT

log = logging.getLogger("snapshot_kernel")


class WorkerError(Exception):
    """A worker could not be started or reached; `ename` says which kind."""

    def __init__(self, ename, message):
        """Keep the error name for the client."""
        super().__init__(message)
        self.ename = ename


class WorkerConn:
    """The server's end of one worker process's channel."""

    def __init__(self, channel, hello):
        """Wrap a channel whose first message was `hello`."""
        self.channel = channel
        self.hello = hello
        self.pid = hello["pid"]
        self.messages = queue.Queue()
        self.alive = True

    def send(self, msg):
        """Send a message; False if the worker is gone."""
        try:
            self.channel.send(msg)
            return True
        except ChannelClosed:
            self.alive = False
            return False

    def kill(self):
        """SIGKILL the worker and its process group (what its cells left running)."""
        self.alive = False
        for target in (lambda: os.killpg(self.pid, signal.SIGKILL),
                       lambda: os.kill(self.pid, signal.SIGKILL)):
            try:
                target()
            except (ProcessLookupError, PermissionError):
                pass
        self.channel.close()


class Holder:
    """A live holder process of one state, with its spare children.

    A state made by a cell gets its holder a moment later: the child that
    made it stays as its first spare and forks the holder, which connects
    on its own (`conn` is None until then).
    """

    def __init__(self, state_id, conn, cold=False, connect_within=None):
        """Track the holder of `state_id` on `conn`; `cold`: forked by the cold zygote.

        conn None: the holder is expected to connect within `connect_within` seconds.
        """
        self.state_id = state_id
        self.conn = conn
        self.cold = cold
        self.spares = queue.Queue()
        self.owed_forks = 0  # spares asked for before the holder connected
        self.maker = None  # the child whose cell made the state, while it is a spare
        self.deadline = None if conn else time.monotonic() + connect_within

    def alive(self):
        """False once the holder process is gone, or did not connect in time."""
        if self.conn is None:
            return time.monotonic() < self.deadline
        return self.conn.alive

    def ask_fork(self):
        """Ask the holder for one more spare (or once it connects); False if it is gone.

        Called with the pool's lock held (see Pool._attach).
        """
        if self.conn is None:
            self.owed_forks += 1
            return True
        return self.conn.send({"op": "fork"})

    def kill(self):
        """Stop the holder and its idle spares."""
        if self.conn is not None:
            self.conn.kill()
        while True:
            try:
                self.spares.get_nowait().kill()
            except queue.Empty:
                break


class Pool:
    """Spawns and tracks every worker process."""

    def __init__(self, settings):
        """Prepare the socket and bookkeeping; `start` launches the zygote."""
        self.settings = settings
        _remove_stale_socket_dirs()
        self.dir = tempfile.mkdtemp(prefix=f"snapk-{os.getpid()}-")
        self.sock_path = os.path.join(self.dir, "w.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.sock_path)
        self.listener.listen(256)
        self.lock = threading.RLock()
        self.live = collections.OrderedDict()
        self.holders_by_pid = {}
        self.waiting_holders = {}
        self.early_spares = {}
        self.early_holders = {}  # state id -> holder conn that connected before its adoption
        self.dropped = set()
        self.exits = {}
        self.exit_cond = threading.Condition()
        self.conns = set()
        self.zygotes = []  # connected zygotes: the cold one, then the warm one
        self.zygote_proc = None
        self.zygote_ready = threading.Condition(self.lock)
        self.req_ids = itertools.count(1)
        self.closed = False
        self.cells = 0  # children taken whose requests are not finished
        self.deferred = set()  # holders owed a spare at the next quiet moment
        self.quiet_from = 0.0  # when the last request ended
        self.quiet_timer = None

    def start(self):
        """Start accepting workers and spawn the zygote."""
        threading.Thread(target=self._accept, name="worker-accept", daemon=True).start()
        self._spawn_zygote()

    def _spawn_zygote(self):
        """Spawn (not fork) the zygote with a fixed hash seed and the Agg backend."""
        env = dict(os.environ, PYTHONHASHSEED="0", MPLBACKEND="Agg")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
        logfile = self.settings.get("server.log_file") or os.devnull
        out = open(logfile, "ab")
        code = ("import json, sys\nfrom kernel.worker.holder import zygote_main\n"
                "zygote_main(sys.argv[1], json.loads(sys.argv[2]))")
        self.zygote_proc = subprocess.Popen(
            [sys.executable, "-c", code, self.sock_path, json.dumps(self.settings)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, cwd=ROOT,
            start_new_session=True)
        out.close()

    # Connections -------------------------------------------------------------

    def _accept(self):
        """Accept worker connections; each gets a reader thread."""
        while not self.closed:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(Channel(sock),), daemon=True).start()

    def _read(self, channel):
        """Read one worker's messages until its channel closes."""
        try:
            hello = channel.recv()
        except (ChannelClosed, EOFError):
            channel.close()
            return
        conn = WorkerConn(channel, hello)
        with self.lock:
            self.conns.add(conn)
        self._introduce(conn)
        try:
            while True:
                msg = channel.recv()
                op = msg.get("op")
                if op == "exited":
                    with self.exit_cond:
                        self.exits[msg["pid"]] = msg["text"]
                        self.exit_cond.notify_all()
                elif op == "log":
                    log.warning("worker %s: %s", conn.pid, msg["text"])
                else:
                    conn.messages.put(msg)
        except (ChannelClosed, EOFError, OSError):
            pass
        conn.alive = False
        conn.messages.put(None)
        with self.lock:
            self.conns.discard(conn)
            holder = self.holders_by_pid.pop(conn.pid, None)
            if holder is not None and self.live.get(holder.state_id) is holder:
                del self.live[holder.state_id]
            if conn in self.zygotes:
                self.zygotes.remove(conn)
        if holder is not None:
            holder.kill()

    def _introduce(self, conn):
        """File a new connection by the role its hello names."""
        role = conn.hello["role"]
        with self.lock:
            if role == "zygote":
                self.zygotes.append(conn)
                self.zygote_ready.notify_all()
                if conn.hello.get("warm"):
                    # Restored again on their next use, their cells start warm too.
                    for holder in [h for h in self.live.values() if h.cold]:
                        del self.live[holder.state_id]
                        self._drop(holder)
            elif role == "holder" and "req" in conn.hello:
                waiter = self.waiting_holders.pop(conn.hello["req"], None)
                if waiter is None:
                    conn.kill()
                else:
                    waiter.put(conn)
            elif role == "holder":
                # Forked by the child that made its state (see Holder).
                holder = self.live.get(conn.hello["state_id"])
                if holder is not None and holder.conn is None:
                    self._attach(holder, conn)
                elif conn.hello["state_id"] in self.dropped:
                    conn.kill()
                else:
                    self.early_holders[conn.hello["state_id"]] = conn
            elif role == "child":
                state_id = conn.hello["holder_state_id"]
                holder = self.live.get(state_id)
                if holder is not None and holder.alive():
                    holder.spares.put(conn)
                elif state_id in self.dropped:
                    conn.kill()  # forked just before its holder was evicted or retired
                else:
                    # A holder forks its first spare before its state is adopted.
                    self.early_spares.setdefault(state_id, []).append(conn)

    # Holders -----------------------------------------------------------------

    def _wait_zygote(self):
        """The connection of the warm zygote, else the cold one; respawns them if gone."""
        deadline = time.monotonic() + self.settings["workers.worker_start_timeout_s"]
        with self.lock:
            while True:
                alive = [z for z in self.zygotes if z.alive]
                if alive:
                    return max(alive, key=lambda z: bool(z.hello.get("warm")))
                if self.zygote_proc.poll() is not None:
                    self._spawn_zygote()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerError("WorkerStartFailed", "the zygote process did not start")
                self.zygote_ready.wait(min(left, 0.5))

    def holder(self, manifest):
        """The live holder of `manifest`'s state, restoring it if needed."""
        with self.lock:
            holder = self.live.get(manifest["id"])
            if holder is not None and holder.alive():
                self.live.move_to_end(manifest["id"])
                return holder
        return self._restore(manifest)

    def _restore(self, manifest):
        """Fork a fresh holder from the zygote for `manifest`."""
        zygote = self._wait_zygote()
        req = next(self.req_ids)
        arrived = queue.Queue()
        with self.lock:
            self.waiting_holders[req] = arrived
            self.dropped.discard(manifest["id"])  # its new holder's first spare is welcome
        zygote.send({"op": "spawn", "req": req, "manifest": manifest})
        timeout = self.settings["workers.worker_start_timeout_s"]
        try:
            conn = arrived.get(timeout=timeout)
        except queue.Empty:
            with self.lock:
                self.waiting_holders.pop(req, None)
            raise WorkerError("WorkerStartFailed", "a worker process did not start in time")
        try:
            msg = conn.messages.get(timeout=timeout)
        except queue.Empty:
            msg = {"ename": "WorkerStartFailed", "evalue": "a restored worker did not get ready"}
        if msg is None or msg.get("op") != "ready":
            conn.kill()
            msg = msg or {"ename": "WorkerDied", "evalue": "the worker restoring the state died"}
            raise WorkerError(msg.get("ename", "WorkerDied"), msg.get("evalue", str(msg)))
        return self.adopt(manifest["id"], conn, cold=not zygote.hello.get("warm"))

    def adopt(self, state_id, conn, cold=False, made=False):
        """Make `conn` the live holder of `state_id`; evict beyond the limits.

        made=True: `conn` is the child whose cell made the state; it stays
        as the first spare, and the holder it forks is attached when it connects.
        """
        holder = Holder(state_id, None if made else conn, cold,
                        self.settings["workers.worker_start_timeout_s"])
        with self.lock:
            old = self.live.pop(state_id, None)
            self.live[state_id] = holder
            self.dropped.discard(state_id)
            if made:
                holder.maker = conn
                holder.spares.put(conn)
                early = self.early_holders.pop(state_id, None)
                if early is not None:
                    self._attach(holder, early)
            else:
                self.holders_by_pid[conn.pid] = holder
            for spare in self.early_spares.pop(state_id, []):
                holder.spares.put(spare)
        if old is not None and old is not holder:
            self._drop(old)
        self._evict()
        return holder

    def _attach(self, holder, conn):
        """`conn` is the holder process of `holder`'s state (called with the lock held)."""
        holder.conn = conn
        self.holders_by_pid[conn.pid] = holder
        for _ in range(holder.owed_forks):
            conn.send({"op": "fork"})
        holder.owed_forks = 0

    def take_child(self, holder):
        """A child of `holder` ready to run a request (a spare, or a new fork).

        Pair every successful call with `cell_done` once the request is over.
        """
        timeout = self.settings["workers.worker_start_timeout_s"]
        while True:
            try:
                child = holder.spares.get_nowait()
            except queue.Empty:
                with self.lock:
                    asked = holder.ask_fork()
                    if asked and holder in self.deferred:
                        # The state is run from again: its deferred spare is due now.
                        self.deferred.discard(holder)
                        holder.ask_fork()
                if not asked:
                    raise WorkerError("WorkerDied", "the state's holder process is gone")
                try:
                    child = holder.spares.get(timeout=timeout)
                except queue.Empty:
                    raise WorkerError("WorkerStartFailed", "no child process arrived") from None
            else:
                self._replace(holder, child)
            if child.alive:
                with self.lock:
                    self.cells += 1
                return child

    def _replace(self, holder, taken):
        """Ask for a spare in place of `taken`: now, or at the next quiet moment if
        `taken` made the state.

        A notebook run top to bottom takes the child that made each state for
        the next cell and does not come back; forking a replacement then would
        compete for the cores with that cell. A later run from the state (a
        cell edited and run again) finds a spare ready; one that comes before
        that waits for a fork, and asks for the deferred spare at once.
        """
        if not self.settings["workers.spare_children"]:
            return
        with self.lock:
            if taken is holder.maker:
                holder.maker = None
                self.deferred.add(holder)
            else:
                holder.ask_fork()

    def cell_done(self):
        """A request that `take_child` served is over; once none has run for
        workers.spare_after_quiet_s, the deferred spares are asked for."""
        with self.lock:
            self.cells -= 1
            self.quiet_from = time.monotonic()
            if not self.cells and self.deferred and self.quiet_timer is None:
                self._ask_deferred_in(self.settings["workers.spare_after_quiet_s"])

    def _ask_deferred_in(self, seconds):
        """Start the timer of `_ask_deferred` (called with the lock held)."""
        self.quiet_timer = threading.Timer(seconds, self._ask_deferred)
        self.quiet_timer.daemon = True
        self.quiet_timer.start()

    def _ask_deferred(self):
        """Timer: ask for the deferred spares if no request ran for a quiet period."""
        with self.lock:
            self.quiet_timer = None
            if self.cells:
                return  # the next cell_done starts the timer again
            quiet = self.settings["workers.spare_after_quiet_s"]
            left = self.quiet_from + quiet - time.monotonic()
            if left > 0:
                self._ask_deferred_in(left)
                return
            holders, self.deferred = self.deferred, set()
            for holder in holders:
                if holder.alive() and self.live.get(holder.state_id) is holder:
                    holder.ask_fork()

    def retire(self, state_id):
        """Stop the holder of a state no name points to any more (or never adopted)."""
        with self.lock:
            holder = self.live.pop(state_id, None)
            early = self.early_spares.pop(state_id, [])
            early_holder = self.early_holders.pop(state_id, None)
            self.dropped.add(state_id)
        for spare in early + ([early_holder] if early_holder else []):
            spare.kill()
        if holder is not None:
            self._drop(holder)

    def _drop(self, holder):
        """Kill a holder that left the LRU."""
        with self.lock:
            if holder.conn is not None:
                self.holders_by_pid.pop(holder.conn.pid, None)
            self.dropped.add(holder.state_id)
        holder.kill()

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
                    over = sum(rss(h.conn.pid) for h in self.live.values()
                               if h.conn is not None) > max_bytes
                if not over:
                    return
                _, victim = self.live.popitem(last=False)
            log.info("evicting the holder of state %s", victim.state_id)
            self._drop(victim)

    def live_ids(self):
        """State ids with a live holder, least recently used first."""
        with self.lock:
            return list(self.live)

    # Children ----------------------------------------------------------------

    def exit_status(self, pid, wait=2.0):
        """How process `pid` ended (as told by its parent), waiting a little."""
        deadline = time.monotonic() + wait
        with self.exit_cond:
            while pid not in self.exits:
                left = deadline - time.monotonic()
                if left <= 0:
                    return "ended without reporting how"
                self.exit_cond.wait(left)
            return self.exits.pop(pid)

    # Shutdown ----------------------------------------------------------------

    def reset(self):
        """Stop every holder (children running cells finish on their own)."""
        with self.lock:
            holders = list(self.live.values())
            self.live.clear()
        for holder in holders:
            self._drop(holder)

    def close(self):
        """Kill every worker process and remove the socket."""
        self.closed = True
        self.reset()
        with self.lock:
            conns = list(self.conns)
        for conn in conns:
            conn.kill()
        if self.zygote_proc is not None:
            try:
                os.killpg(self.zygote_proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.zygote_proc.wait()
        try:
            self.listener.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _remove_stale_socket_dirs():
    """Remove the socket folders of this user's servers that died without removing
    them (SIGKILL, the OOM killer); a live server's folder names its pid."""
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        match = re.fullmatch(r"snapk-(\d+)-\w+", name)
        if match is None:
            continue
        path = os.path.join(base, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue  # alive under another user, or gone meanwhile


def rss(pid):
    """Resident memory of a process in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0

