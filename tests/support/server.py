"""The server under test and a client for assertions, waiting for a condition, gates
that stage races, and the scripts run on a store.

Starting and stopping the process is scripts/harness.py's `Server`, which the
scripts share; this module adds an HTTP client made for assertions.
"""

import concurrent.futures
import itertools
import json
import os
import subprocess
import sys
import threading
import time

import lmdb
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


def run_script(script, data_dir, *args, timeout=60):
    """Run scripts/<script> on the store in `data_dir` (None: the one its arguments
    name); the CompletedProcess, with `output`: its stdout and stderr."""
    where = [] if data_dir is None else ["--data-dir", str(data_dir)]
    done = subprocess.run([sys.executable, os.path.join("scripts", script), *where, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    done.output = done.stdout + done.stderr
    return done


def error_of(r, status):
    """The JSON error of an answer that must have `status`."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["Content-Type"] == "application/json"
    return r.json()["error"]


def stream(server, path, body):
    """POST with stream on; yields the lines as they arrive (a line that does not come
    within the read timeout raises requests' ConnectionError)."""
    with requests.post(server.url + path, params={"token": server.token},
                       json=dict(body, stream=True), stream=True, timeout=(60, 120)) as r:
        assert r.status_code == 200, r.text
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        for raw in r.iter_lines():
            if raw:
                yield json.loads(raw)


def store_bytes(data_dir):
    """Bytes of blobs in use in the LMDB store (pages in use, not the file size)."""
    env = lmdb.open(str(data_dir), readonly=True, lock=False, max_dbs=4)
    try:
        info, stat = env.info(), env.stat()
        return (info["last_pgno"] + 1) * stat["psize"]
    finally:
        env.close()


def restarted_before_every_cell(make_server, data, cells):
    """Run `cells` one after another, each in a server started for it (the corpus's
    restart path); the answer of each."""
    answers, state = [], "initial"
    for i, code in enumerate(cells):
        srv = make_server(data)
        answers.append(srv.execute(code, state=state, new=f"c{i}"))
        state = f"c{i}"
        srv.stop()
    return answers


# The last commit whose packages were top-level `kernel`, `storage` and `api`.
BEFORE_THE_RENAME = "f791235"


def earlier_tree(folder):
    """The tree of BEFORE_THE_RENAME, written out into `folder`."""
    try:
        archive = subprocess.run(["git", "archive", BEFORE_THE_RENAME], cwd=ROOT,
                                 capture_output=True, check=True).stdout
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"this checkout lacks commit {BEFORE_THE_RENAME}: {exc.stderr!r}")
    folder.mkdir()
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder
