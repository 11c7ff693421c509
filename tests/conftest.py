"""Fixtures: a real server process on a free port over a temporary store."""

import itertools
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "test-token"
_ids = itertools.count()


def free_port():
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess and a small HTTP client for it."""

    def __init__(self, data_dir, config=None, extra_args=(), token=TOKEN):
        """Start `python main.py` on a free port over `data_dir` and wait for it."""
        self.data_dir = str(data_dir)
        self.token = token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "main.py", "--bind", f"127.0.0.1:{self.port}",
                "--data-dir", self.data_dir, *extra_args]
        if token:
            args += ["--token", token]
        if config:
            path = os.path.join(self.data_dir + "-config.toml")
            with open(path, "w") as f:
                f.write(config)
            args += ["--config", path]
        self.log = open(self.data_dir + "-server.log", "ab")
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self.log, stderr=self.log,
                                     stdin=subprocess.DEVNULL)
        self.wait_up()

    def wait_up(self, timeout=30):
        """Wait until /health answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: "
                                   f"{open(self.data_dir + '-server.log').read()[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=1).ok:
                    return
            except requests.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("server did not come up")

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

    def execute(self, code, state="initial", new=None, exec_id=None, ok=True):
        """POST /execute; with ok=True, assert the cell succeeded and return the answer."""
        body = {"code": code, "exec_id": exec_id or f"e{next(_ids)}", "state_name": state}
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

    def stop(self, sig=signal.SIGTERM, timeout=30):
        """Stop the server with `sig` and wait for it."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


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
