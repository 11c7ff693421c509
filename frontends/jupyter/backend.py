"""The server a kernel talks to: the one of its kernelspec's private store, or a given one.

By default each kernelspec has a private folder under the user's Jupyter
data directory (`snapshot-kernel/<kernelspec name>/`, mode 0700): the
LMDB store, the sessions, and `server.json` with the URL and token of the
server running on that store. A kernel that finds that server answering
attaches to it; otherwise it starts one on a free loopback port with a
random token, under the watch of `server_keeper.py`, which stops it once no
kernel has used it for `jupyter.server_idle_s`. `start.lock` makes finding
or starting the server one step for concurrent kernels (a store takes one
server). With SNAPSHOT_KERNEL_URL and SNAPSHOT_KERNEL_TOKEN set, the
kernel attaches to that server instead and keeps its sessions in a folder
named after the URL.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

from jupyter_core.paths import jupyter_data_dir

from snapkernel.api.client import Client, ServerError
from snapkernel.kernel import launch

KEEPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server_keeper.py")
# Variables the Jupyter server gives one kernel: not for the cells of every kernel
# that will share the server this kernel starts.
_PER_KERNEL_ENV = ("JPY_SESSION_NAME", "JPY_PARENT_PID", "JPY_INTERRUPT_EVENT")


def data_folder(*parts):
    """A private folder under the user's Jupyter data directory (made if missing)."""
    path = os.path.join(jupyter_data_dir(), "snapshot-kernel", *parts)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def private_folder(spec_name):
    """The folder of a kernelspec's store, sessions and server."""
    return data_folder(spec_name)


class Attached:
    """A server given by SNAPSHOT_KERNEL_URL and SNAPSHOT_KERNEL_TOKEN."""

    def __init__(self, url, token, settings):
        """Keep the address; sessions live in a folder named after the URL."""
        self.client = Client(url, token, settings["jupyter.request_timeout_s"])
        self.sessions_folder = data_folder(
            "attached", hashlib.sha256(url.encode()).hexdigest()[:16], "sessions")
        self.where = url

    def connect(self):
        """The client, once the server answers with the token."""
        if not self.client.healthy():
            raise ServerError(f"the snapshot server at {self.client.url} (SNAPSHOT_KERNEL_URL) "
                              f"does not answer with SNAPSHOT_KERNEL_TOKEN", "ServerUnreachable")
        return self.client

    def close(self):
        """Nothing to release: the server is not ours."""


class Managed:
    """The server of a kernelspec's private store, found running or started."""

    def __init__(self, spec_name, settings, config_file=None):
        """Prepare the folder; nothing starts before connect()."""
        self.folder = private_folder(spec_name)
        self.sessions_folder = os.path.join(self.folder, "sessions")
        self.settings = settings
        self.config_file = config_file
        self.keeper = None
        self.where = self.folder
        self._kernels_lock = None

    @contextlib.contextmanager
    def _start_lock(self):
        """Hold start.lock: finding or starting the server is one step for all kernels."""
        with open(os.path.join(self.folder, "start.lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def connect(self):
        """A client of the running server, started if it is not running."""
        with self._start_lock():
            if self._kernels_lock is None:
                # Held while this kernel lives: the keeper stops the server only
                # once no kernel holds it.
                self._kernels_lock = open(os.path.join(self.folder, "kernels.lock"), "a")
                fcntl.flock(self._kernels_lock, fcntl.LOCK_SH)
            try:
                with open(os.path.join(self.folder, "server.json")) as f:
                    info = json.load(f)
                client = Client(info["url"], info["token"],
                                self.settings["jupyter.request_timeout_s"])
                if client.healthy():
                    return client
            except (OSError, ValueError, KeyError, TypeError):
                pass  # no server yet, or the file of one that is gone
            return self._start()

    def _start(self):
        """Start a server on the private store, wait until it answers, write server.json."""
        port = _free_port()
        token = secrets.token_urlsafe(32)
        # The installed command line (main.py's main, as `snapshot-kernel` runs it), with
        # -P: it starts in the kernel's folder, whose own main.py must not be imported.
        command = launch.command("from snapkernel.main import main; main()",
                                 "--bind", f"127.0.0.1:{port}",
                                 "--data-dir", os.path.join(self.folder, "store"))
        if self.config_file:
            command += ["--config", self.config_file]
        env = launch.env({k: v for k, v in os.environ.items() if k not in _PER_KERNEL_ENV})
        env["SNAPSHOT_KERNEL_TOKEN"] = token
        log_path = os.path.join(self.folder, "server.log")
        with open(log_path, "ab") as log:
            # The server's working directory is the kernel's: cells find the files
            # beside the notebook that started it.
            idle_s = str(self.settings["jupyter.server_idle_s"])
            self.keeper = subprocess.Popen(
                [sys.executable, KEEPER, self.folder, idle_s, "--", *command], env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        # Reaped as soon as it ends, so it leaves no zombie while this kernel lives;
        # its returncode then tells the wait below that the server did not start.
        threading.Thread(target=self.keeper.wait, name="keeper-reaper",
                         daemon=True).start()
        client = Client(f"http://127.0.0.1:{port}", token,
                        self.settings["jupyter.request_timeout_s"])
        deadline = time.monotonic() + self.settings["jupyter.server_start_timeout_s"]
        while not client.healthy():
            if self.keeper.returncode is not None:
                raise ServerError(f"the snapshot server did not start:\n{_tail(log_path)}",
                                  "ServerStartFailed")
            if time.monotonic() > deadline:
                raise ServerError("the snapshot server did not answer within "
                                  "jupyter.server_start_timeout_s; its log is " + log_path,
                                  "ServerStartFailed")
            time.sleep(0.05)
        path = os.path.join(self.folder, "server.json")
        with open(os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump({"url": client.url, "token": token, "pid": self.keeper.pid}, f)
        os.replace(path + ".tmp", path)
        return client

    def close(self):
        """Stop counting as a user of the server (it stops after server_idle_s)."""
        if self._kernels_lock is not None:
            self._kernels_lock.close()
            self._kernels_lock = None


def backend(spec_name, settings, config_file=None):
    """The server of this kernel: SNAPSHOT_KERNEL_URL if set, else the private one."""
    url = os.environ.get("SNAPSHOT_KERNEL_URL")
    if url:
        return Attached(url, os.environ.get("SNAPSHOT_KERNEL_TOKEN", ""), settings)
    return Managed(spec_name, settings, config_file)


def _free_port():
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path, size=3000):
    """The end of a log file."""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - size))
        return f.read().decode("utf-8", "replace")
