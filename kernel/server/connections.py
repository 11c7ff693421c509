"""The server's end of the workers' channels.

Every worker process connects to one Unix socket in a private folder and
introduces itself (protocol.Hello). A zygote's or holder's connection gets
a reader thread: `Exited` and `Log` are handled here; whatever else it
sends waits in the connection's queue (the pool reads a restored holder's
`Ready` there). A spare child's connection has no reader thread: the
request thread that runs a cell in it reads its messages itself
(`WorkerConn.receive`), so an answer reaches the HTTP thread without a
hand-over between threads.
"""

import logging
import os
import queue
import re
import select
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref

from snapkernel.kernel import protocol
from snapkernel.kernel.channel import Channel, ChannelClosed

log = logging.getLogger("snapshot_kernel")


class WorkerConn:
    """The server's end of one worker process's channel."""

    def __init__(self, channel, hello):
        """Wrap a channel whose first message was `hello` (a protocol.Hello)."""
        self.channel = channel
        self.hello = hello
        self.pid = hello.pid
        self.messages = queue.Queue()  # what a read worker sent; None once it is gone
        self.alive = True

    def receive(self, timeout):
        """The next message of a worker without a reader thread; None once it is gone.

        Raises TimeoutError if nothing arrived within `timeout` seconds.
        """
        try:
            ready, _, _ = select.select([self.channel], [], [], timeout)
            if ready:
                return self.channel.recv()
        except (ChannelClosed, EOFError, OSError, ValueError):
            self.alive = False
            return None
        raise TimeoutError

    def idle(self):
        """True if an idle spare is still there: it sends nothing while idle, so
        anything readable on its channel is the end of it."""
        if self.alive:
            try:
                self.alive = not select.select([self.channel], [], [], 0)[0]
            except (OSError, ValueError):
                self.alive = False
        return self.alive

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


class Connections:
    """The workers' socket, its connections, and how their children exited.

    `on_hello(conn)` files a new connection; `on_closed(conn)` is called once
    its worker is gone.
    """

    def __init__(self, on_hello, on_closed):
        """Bind the socket in a new private folder (mode 0700)."""
        self.on_hello, self.on_closed = on_hello, on_closed
        _remove_stale_socket_dirs()
        self.dir = tempfile.mkdtemp(prefix=f"snapk-{os.getpid()}-")
        self.sock_path = os.path.join(self.dir, "w.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.sock_path)
        self.listener.listen(256)
        self.lock = threading.Lock()
        self.open = set()  # connections with a reader thread
        self.spares = weakref.WeakSet()  # the others, killed at close too
        self.exits = {}
        self.exit_cond = threading.Condition()
        self.closed = False

    def start(self):
        """Accept connections in a thread of their own."""
        threading.Thread(target=self._accept, name="worker-accept", daemon=True).start()

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
        if hello.role == protocol.SPARE:
            with self.lock:
                self.spares.add(conn)
            self.on_hello(conn)
            return
        with self.lock:
            self.open.add(conn)
        self.on_hello(conn)
        try:
            while True:
                msg = channel.recv()
                if isinstance(msg, protocol.Exited):
                    with self.exit_cond:
                        self.exits[msg.pid] = msg.text
                        self.exit_cond.notify_all()
                elif isinstance(msg, protocol.Log):
                    log.warning("worker %s: %s", conn.pid, msg.text)
                else:
                    conn.messages.put(msg)
        except (ChannelClosed, EOFError, OSError):
            pass
        conn.alive = False
        conn.messages.put(None)
        with self.lock:
            self.open.discard(conn)
        self.on_closed(conn)

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

    def close(self):
        """Kill every connected worker and remove the socket's folder."""
        self.closed = True
        with self.lock:
            conns = list(self.open) + list(self.spares)
        for conn in conns:
            conn.kill()
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
