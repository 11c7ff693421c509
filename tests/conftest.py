"""Fixtures: a real server process on a free port over a temporary store.

Starting and stopping the process is scripts/harness.py's `Server`, which the
scripts share; this module adds an HTTP client made for assertions.
"""

import concurrent.futures
import itertools
import os
import subprocess
import sys
import threading
import time

import pytest
import requests

import harness  # scripts/harness.py: pyproject's pytest `pythonpath` puts scripts/ on sys.path
from harness import ROOT, S3, TOKEN, free_port  # noqa: F401 (the tests import them here)

_ids = itertools.count()


def wait_for(condition, what, timeout=60):
    """Wait until condition() is true and return its value; fail naming `what` if it is
    not within `timeout` seconds.

    The deadline only bounds a wait for something that must happen, and is generous: a
    loaded machine makes the wait longer, never the test fail. A test asserts the
    condition it waited for, never how long that took.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)  # a poll interval: the condition, not this, is what is waited for


def asleep(pid):
    """True while process `pid` is blocked in time.sleep's system call (Linux's
    /proc/PID/wchan): a SIGINT sent then interrupts the sleep itself, where one sent a
    moment before the call would be noticed only after the call returned."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return "nanosleep" in f.read()
    except FileNotFoundError:  # the process is gone: not asleep
        return False


def in_thread(fn, *args, **kw):
    """Run fn(*args, **kw) in a daemon thread; a Future whose result(timeout) returns what
    it returned or raises what it raised, so no failure in a thread goes unseen."""
    future = concurrent.futures.Future()

    def run():
        """The thread: hand the outcome to the future."""
        try:
            future.set_result(fn(*args, **kw))
        except BaseException as exc:  # handed to the test, which re-raises it
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


def warm_zygote(srv):
    """The warm zygote of server `srv` (started with wait=False to catch it before it
    connects), once the cold one forked it: the cold zygote's child in its process group
    (holders are forked into groups of their own). A test stops it (SIGSTOP) to keep
    the server on its cold path for as long as it needs."""
    import psutil

    def find():
        """The process, or None (also when one of them exited meanwhile)."""
        try:
            for cold in psutil.Process(srv.proc.pid).children():
                for child in cold.children():
                    if os.getpgid(child.pid) == cold.pid:
                        return child
        except (psutil.NoSuchProcess, ProcessLookupError):
            return None
        return None
    return wait_for(find, "the warm zygote to be forked")


class Gate:
    """A point a cell waits at until the test opens it: stages a race without a sleep.

    `code` is cell source that appends the process id to a file, then waits until the
    test calls `open`; `arrived(n)` waits until `n` processes are waiting there. It binds
    no name in the cell's namespace. The gate is opened at the end of the test whatever
    happens (the `gate` fixture), so no cell is left waiting.
    """

    def __init__(self, folder, name="gate"):
        """A closed gate whose files live in `folder`."""
        self.arrivals_path = os.path.join(str(folder), f"{name}.arrived")
        self.go_path = os.path.join(str(folder), f"{name}.go")
        if os.path.exists(self.go_path):
            os.unlink(self.go_path)
        # Cell source: say "here" (the pid, one line), then wait for the test.
        self.arrive_code = (f"__import__('pathlib').Path({self.arrivals_path!r}).open('a')"
                            f".write(str(__import__('os').getpid()) + '\\n')\n")
        self.code = (self.arrive_code +
                     f"while not __import__('os').path.exists({self.go_path!r}):\n"
                     f"    __import__('time').sleep(0.01)\n")

    def indented(self, prefix):
        """`code` for a block indented by `prefix`."""
        return "".join(prefix + line + "\n" for line in self.code.splitlines())

    def pids(self):
        """Process ids of those that arrived at the gate, in order of arrival."""
        try:
            with open(self.arrivals_path) as f:
                return [int(line) for line in f.read().split()]
        except FileNotFoundError:
            return []

    def arrived(self, count=1, timeout=60):
        """Wait until `count` processes wait at the gate; their pids."""
        return wait_for(lambda: len(self.pids()) >= count and self.pids(),
                        f"{count} cell(s) to reach the gate {self.go_path}", timeout)

    def open(self):
        """Let every process waiting at the gate (and any arriving later) through."""
        with open(self.go_path, "w"):
            pass


@pytest.fixture
def gate(tmp_path):
    """Make closed gates (`gate()` or `gate("name")`); all are opened at the test's end."""
    made = []

    def make(name="gate"):
        """A new closed gate."""
        made.append(Gate(tmp_path, name))
        return made[-1]

    yield make
    for one in made:
        one.open()


class Server(harness.Server):
    """A server subprocess and a small HTTP client for it."""

    def request(self, method, path, **kw):
        """An authenticated request."""
        params = kw.pop("params", {})
        params.setdefault("token", self.token)
        kw.setdefault("timeout", 120)
        return requests.request(method, self.url + path, params=params, **kw)

    def post(self, path, json=None, **kw):
        """POST with a JSON body."""
        return self.request("POST", path, json=json, **kw)

    def get(self, path, **kw):
        """GET."""
        return self.request("GET", path, **kw)

    def delete(self, path, **kw):
        """DELETE."""
        return self.request("DELETE", path, **kw)

    def execute(self, code, state="initial", new=None, exec_id=None, ok=True, extra=None):
        """POST /execute (with the `extra` fields of the body, if any); with ok=True,
        assert the cell succeeded and return the answer."""
        body = {"code": code, "exec_id": exec_id or f"e{next(_ids)}", "state_name": state,
                **(extra or {})}
        if new is not None:
            body["new_state_name"] = new
        r = self.post("/execute", body)
        assert r.status_code == 200, r.text
        answer = r.json()
        if ok:
            assert answer["error"] is None, answer["error"]
            assert answer["state_name"], answer
        return answer

    def value(self, state, expr):
        """The text/plain of `expr` evaluated in `state` (via multistate_execute)."""
        r = self.post("/multistate_execute", {"code": expr, "exec_id": f"v{next(_ids)}",
                                               "state_mapping": {}, "default_state": state})
        answer = r.json()
        assert answer["error"] is None, answer["error"]
        results = [o for o in answer["output"] if o["output_type"] == "execute_result"]
        return results[-1]["data"]["text/plain"] if results else None


def run_script(script, data_dir, *args):
    """Run scripts/<script> on `data_dir`; the CompletedProcess (text output)."""
    return subprocess.run([sys.executable, os.path.join("scripts", script),
                           "--data-dir", str(data_dir), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server per test module, on its own store."""
    srv = Server(tmp_path_factory.mktemp("store") / "data")
    yield srv
    srv.stop()


@pytest.fixture
def make_server(tmp_path):
    """Start servers on demand (stopped at the end of the test)."""
    started = []

    def make(data_dir=None, **kw):
        """A new server; on the same `data_dir` it resumes that store."""
        srv = Server(data_dir or tmp_path / f"data{len(started)}", **kw)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """One S3 server per test module; the servers find dummy AWS credentials in the
    environment (moto accepts any)."""
    with pytest.MonkeyPatch.context() as env:
        for var in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            env.delenv(var, raising=False)
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        server = S3(tmp_path_factory.mktemp("s3") / "s3.log")
        yield server
        server.stop()
