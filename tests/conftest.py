"""Fixtures: a real server process on a free port over a temporary store.

Starting and stopping the process is scripts/harness.py's `Server`, which the
scripts share; this module adds an HTTP client made for assertions.
"""

import itertools
import os
import subprocess
import sys

import pytest
import requests

import harness  # scripts/harness.py: pyproject's pytest `pythonpath` puts scripts/ on sys.path
from harness import ROOT, S3, TOKEN, free_port  # noqa: F401 (the tests import them here)

_ids = itertools.count()


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
