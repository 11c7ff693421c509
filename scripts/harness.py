"""Starting servers and describing the run: shared by the scripts and the tests.

scripts/bench.py, load.py and faults.py import it as `harness` (a script's
own folder is first on its sys.path); tests/conftest.py puts this folder on
sys.path and builds its fixtures on `Server`. Requests go through the
server's own client (api/client.py).
"""

import os
import platform
import signal
import socket
import subprocess
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from api.client import Client, ServerError  # noqa: E402

TOKEN = "test-token"


def free_port():
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess listening on 127.0.0.1:`port`, its output in a log file.

    Any HTTP answer to GET /health counts as up (the reference server has no
    such route and answers 404).
    """

    def __init__(self, argv, port, log_path, cwd=ROOT, token=TOKEN, wait=True, poll_s=0.05,
                 timeout=60):
        """Start `argv`; with `wait`, return once it answers HTTP."""
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.token = token
        self.log_path = log_path
        self.poll_s = poll_s
        self.log = open(log_path, "ab")
        # The reference server reads the token only from the query.
        self.client = Client(self.url, token, token_in_query=True)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(argv, cwd=cwd, stdout=self.log, stderr=self.log,
                                     stdin=subprocess.DEVNULL)
        self.up_s = None
        if wait:
            try:
                self.up_s = self.wait_up(timeout)
            except BaseException:
                self.stop(signal.SIGKILL)  # one that never came up is not left running
                raise

    def wait_up(self, timeout=60):
        """Wait until the server answers HTTP; seconds from its start to then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            try:
                self.client.call("GET", "/health", timeout=1)
                return time.perf_counter() - self.started
            except ServerError as exc:
                if exc.status is not None:
                    return time.perf_counter() - self.started  # an answer all the same
                self.client.close()
                time.sleep(self.poll_s)
        raise RuntimeError(f"server did not come up in {timeout} s: {self.log_tail()}")

    def log_tail(self, chars=3000):
        """The end of the server's log."""
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def call(self, method, path, body=None, timeout=60):
        """One request with the token; the decoded JSON answer (api.client.ServerError
        for an error answer or none)."""
        return self.client.call(method, path, body, timeout)

    def workers(self):
        """Pids of every process below the server."""
        return descendants(self.proc.pid)

    def stop(self, sig=signal.SIGTERM, timeout=30):
        """Stop the server with `sig` and wait for it (SIGKILL if it takes longer)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Server(ServerProcess):
    """This repository's server, `python main.py`, over the store `data_dir`.

    `config` is the text of a TOML file given with --config; the log and that
    file go beside the store (`<data_dir>-server.log`, `<data_dir>-config.toml`)
    unless `log_path` says otherwise.
    """

    def __init__(self, data_dir, config=None, extra_args=(), token=TOKEN, log_path=None,
                 **kw):
        """Start the server on a free port."""
        self.data_dir = str(data_dir)
        port = free_port()
        argv = [sys.executable, "main.py", "--bind", f"127.0.0.1:{port}",
                "--data-dir", self.data_dir, *extra_args]
        if token:
            argv += ["--token", token]
        if config is not None:
            path = self.data_dir + "-config.toml"
            with open(path, "w") as f:
                f.write(config)
            argv += ["--config", path]
        super().__init__(argv, port, log_path or self.data_dir + "-server.log", token=token,
                         **kw)


def descendants(pid):
    """Pids of every process below `pid` ([] once it is gone)."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def alive(pid):
    """True if process `pid` exists and is not a zombie (which only waits to be reaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def machine():
    """One line describing this machine and interpreter."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return (f"{model or platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}")


def revision():
    """The checked-out commit (+ " + uncommitted changes"), or "unknown" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    if not head:
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")
