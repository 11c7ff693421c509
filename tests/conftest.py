"""Fixtures: a real server process on a free port over a temporary store.

Starting and stopping the process is scripts/harness.py's `Server`, which the
scripts share; this module adds an HTTP client made for assertions.
"""

import itertools
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
import harness  # noqa: E402
from harness import ROOT, TOKEN, free_port  # noqa: E402,F401 (the tests import them here)

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

    def execute(self, code, state="initial", new=None, exec_id=None, ok=True, cwd=None):
        """POST /execute; with ok=True, assert the cell succeeded and return the answer.
        `cwd`: the working directory of a cell run from `initial`."""
        body = {"code": code, "exec_id": exec_id or f"e{next(_ids)}", "state_name": state}
        if new is not None:
            body["new_state_name"] = new
        if cwd is not None:
            body["cwd"] = str(cwd)
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


class S3:
    """moto's S3 server (tests/s3_server.py) on a loopback port, for the remote store."""

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
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.list_buckets()
                return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("moto's S3 server did not come up")
                time.sleep(0.05)

    def bucket(self):
        """A new empty bucket's name."""
        name = f"bucket-{next(_ids)}"
        self.client.create_bucket(Bucket=name)
        return name

    def config(self, bucket, durability="sync", extra=""):
        """A config.toml for a server on s3://BUCKET/states, quick to notice a dead remote."""
        return (f'[store]\nremote = "s3://{bucket}/states"\n'
                f'remote_endpoint = "{self.endpoint}"\ndurability = "{durability}"\n'
                f"remote_refresh_s = 0.0\nremote_timeout_s = 1.0\nremote_attempts = 1\n"
                f"remote_retry_s = 0.2\n{extra}")

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
