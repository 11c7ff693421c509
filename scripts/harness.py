"""Starting servers and describing the run: shared by the scripts and the tests.

scripts/bench.py, load.py, faults.py and bench_remote.py import it as
`harness` (a script's own folder is first on its sys.path); the tests find it
through pytest's `pythonpath` (pyproject.toml) and build their fixtures on
`Server` and `S3`. Requests go through the server's own client
(api/client.py); `S3` imports boto3 when made (the test extra). `Server`
runs this checkout's main.py.
"""

import itertools
import os
import platform
import signal
import socket
import subprocess
import sys
import time

import psutil

from snapkernel.api.client import Client, ServerError

# The checkout: where main.py and the git history are.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
                 timeout=60, env=None):
        """Start `argv` (in environment `env`, default this one's); with `wait`, return
        once it answers HTTP."""
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
                                     stdin=subprocess.DEVNULL, env=env)
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


class S3:
    """moto's S3 server (tests/s3_server.py) on a loopback port, for the remote store
    (the tests' fixture and scripts/bench_remote.py; needs the test extra)."""

    _buckets = itertools.count()

    def __init__(self, log_path):
        """Start it and wait until it answers."""
        import boto3
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = str(log_path)
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "tests/s3_server.py", str(self.port)],
                                     cwd=ROOT, stdout=self.log, stderr=self.log,
                                     stdin=subprocess.DEVNULL)
        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
        from botocore.exceptions import EndpointConnectionError
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto's S3 server exited: see {self.log_path}")
            try:
                self.client.list_buckets()
                return
            except EndpointConnectionError:  # not listening yet: nothing else is excused
                if time.monotonic() > deadline:
                    raise RuntimeError("moto's S3 server did not come up in 120 s") from None
                time.sleep(0.05)

    def bucket(self):
        """A new empty bucket's name."""
        name = f"bucket-{next(self._buckets)}"
        self.client.create_bucket(Bucket=name)
        return name

    def config(self, bucket, durability="sync", extra="", timeout_s=10.0):
        """A config.toml for a server on s3://BUCKET/states: one try per request, a
        look at the names on every request, and waits for the remote long enough for
        a loaded machine (moto is a Python server: an 8 MB blob under load took over
        the 1 s timeout this had, and the names a look slower than remote_list_wait_s
        found came a request late). A paused remote is noticed after `timeout_s`: the
        tests that pause it make that shorter (their requests while it runs are small)."""
        return (f'[store]\nremote = "s3://{bucket}/states"\n'
                f'remote_endpoint = "{self.endpoint}"\ndurability = "{durability}"\n'
                f"remote_refresh_s = 0.0\nremote_timeout_s = {timeout_s}\n"
                f"remote_attempts = 1\nremote_list_wait_s = 30.0\nremote_retry_s = 0.2\n"
                f"{extra}")

    def objects(self, bucket, under):
        """{key below `under`: object listing entry} of a bucket."""
        found = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=f"states/{under}/"):
            for item in page.get("Contents", []):
                found[item["Key"].rsplit("/", 1)[1]] = item
        return found

    def pause(self):
        """Stop answering (SIGSTOP): requests hang until they time out."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self):
        """Answer again (SIGCONT)."""
        self.proc.send_signal(signal.SIGCONT)

    def stop(self):
        """Kill the server."""
        self.resume()
        self.proc.kill()
        self.proc.wait()
        self.log.close()


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
