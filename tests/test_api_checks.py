"""What the routes check and bound (docs/api.md), and the operator scripts beside a server
(docs/operations.md)."""

import os
import re
import subprocess
import sys

import requests

from support.server import ROOT, run_script


def test_origin_and_host_headers_are_checked_before_the_token(server):
    url = server.url + "/execute"
    body = {"code": "x = 1", "exec_id": "o1", "state_name": "initial", "new_state_name": "o"}
    for headers in [{"Origin": "http://evil.example"}, {"Origin": "null"},
                    {"Host": "evil.example"}, {"Host": f"evil.example:{server.port}"},
                    {"Host": "10.1.2.3"}]:
        for params in ({}, {"token": server.token}):
            r = requests.post(url, params=params, json=body, headers=headers, timeout=60)
            assert r.status_code == 403, (headers, params, r.text)
            assert r.json()["error"]["type"] == "Forbidden"
    # The server's own names and origin pass: localhost, loopback, no Origin.
    for n, headers in enumerate([{"Host": f"localhost:{server.port}"}, {"Host": "[::1]"},
                                 {"Origin": server.url}, {}]):
        r = requests.post(url, params={"token": server.token}, headers=headers, timeout=60,
                          json=dict(body, exec_id=f"ok{n}"))
        assert r.status_code == 200 and r.json()["error"] is None, (headers, r.text)


def test_allowed_hosts_and_origins_come_from_the_config(make_server):
    srv = make_server(config='[server]\nallowed_hosts = ["gpu-box"]\n'
                             'allowed_origins = ["https://notebooks.example"]\n')
    for headers, status in [({"Host": "gpu-box:1"}, 200), ({"Host": "gpu-box2"}, 403),
                            ({"Origin": "https://notebooks.example"}, 200),
                            ({"Origin": "https://other.example"}, 403)]:
        r = srv.get("/states", headers=headers)
        assert r.status_code == status, (headers, r.text)


def test_execute_needs_code(server):
    r = server.post("/execute", {"exec_id": "c1", "state_name": "initial",
                                 "new_state_name": "no-code"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "field 'code' is missing"
    assert "no-code" not in server.get("/states").json()["states"]


def test_rebuild_state_names_the_variables_a_state_lacks(server):
    server.execute("a = 1\nb = 2", new="rb-src")
    server.execute("c = 3", new="rb-in")
    for field, names, state, missing in [("source_vars", ["a", "nope", "zilch"], "rb-src",
                                          "'nope', 'zilch'"),
                                         ("input_vars", ["c", "gone"], "rb-in", "'gone'")]:
        body = {"input_state": "rb-in", "source_state": "rb-src", "source_vars": ["a"],
                "input_vars": ["c"], "new_state_name": "rb-out", field: names}
        r = server.post("/rebuild_state", body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == \
            f"{field}: state {state!r} has no variable {missing}", r.text
    assert "rb-out" not in server.get("/states").json()["states"]
    # Names the states have still rebuild.
    r = server.post("/rebuild_state", {"input_state": "rb-in", "source_state": "rb-src",
                                       "source_vars": ["a"], "input_vars": ["c"],
                                       "new_state_name": "rb-out"})
    assert r.status_code == 200 and server.value("rb-out", "a + c") == "4"


def test_an_error_text_is_bounded_once_by_the_output_limit(make_server):
    # A 2 MB exception text, with max_output_bytes 100 kB: the error (message and traceback
    # together) is about 100 kB, not 2 MB counted twice.
    srv = make_server(config="[display]\nmax_output_bytes = 100000\n")
    for n, text in enumerate(["'x' * 2_000_000", "'é' * 1_000_000"]):
        r = srv.post("/execute", {"code": f"raise ValueError({text})", "exec_id": f"big{n}",
                                  "state_name": "initial"})
        assert r.status_code == 200
        error = r.json()["error"]
        assert error["ename"] == "ValueError" and "truncated" in error["evalue"]
        size = len(error["evalue"].encode()) + sum(len(t.encode()) for t in error["traceback"])
        assert 50_000 <= size <= 100_000 + 1000, size  # UTF-8 bytes of its text
    assert len(srv.post("/execute", {"code": "raise ValueError('x' * 2_000_000)",
                                     "exec_id": "big3", "state_name": "initial"}).content) \
        <= 110_000


def test_states_can_leave_notebook_runs_out(server):
    server.execute("u = 1", new="mine")
    r = server.post("/notebooks/run", {"notebook": "kinds", "cells": [
        {"id": "a", "source": "v = 2"}]})
    assert r.status_code == 200, r.text
    made = r.json()["cells"][0]["state_name"]
    assert re.fullmatch("nb-[0-9a-f]{64}", made)
    every = server.get("/states").json()["states"]
    assert "mine" in every and made in every  # the default: every state (Plainbook's view)
    user = server.get("/states", params={"kind": "user"}).json()["states"]
    assert "mine" in user and "initial" in user and made not in user
    assert server.get("/states", params={"kind": "notebook"}).json()["states"] == [made]
    r = server.get("/states", params={"kind": "mine"})
    assert r.status_code == 400 and "kind must be all, user, notebook" in r.text


def test_gc_dry_run_and_check_store_while_the_server_runs(make_server):
    srv = make_server()
    for n in range(3):
        srv.execute(f"x{n} = list(range({n} * 1000))", new=f"s{n}")
    srv.delete("/states/s1")  # its blob is then referenced by nothing
    dry = run_script("gc_states.py", srv.data_dir, "--dry-run", "--match", "s2")
    assert dry.returncode == 0, dry.stderr
    assert "would delete 1 state(s) of" in dry.stdout and "s2" in dry.stdout, dry.stdout
    assert re.search(r"would delete [1-9]\d* blob\(s\), freeing", dry.stdout), dry.stdout
    # It changed nothing, and the server carried on meanwhile.
    assert "s2" in srv.get("/states").json()["states"]
    srv.execute("y = 1", state="s2", new="s3")
    check = run_script("check_store.py", srv.data_dir)
    assert check.returncode == 0, check.stdout + check.stderr
    # The real collection still refuses while the server holds the store, saying what works.
    real = run_script("gc_states.py", srv.data_dir, "--match", "s2")
    assert real.returncode == 2 and "--dry-run works while it serves" in real.stderr, \
        real.stderr
    assert "s2" in srv.get("/states").json()["states"]


def test_data_dir_help_names_the_real_default_folder(tmp_path):
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path), COLUMNS="1000")  # one line each
    folder = str(tmp_path / "snapshot-kernel" / "store")
    for argv in (["main.py", "serve", "--help"], ["scripts/gc_states.py", "--help"],
                 ["scripts/check_store.py", "--help"]):
        out = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60).stdout
        assert f"else {folder})" in out, (argv, out)


def test_a_fresh_run_may_be_given_a_year(server):
    """The longest timeout the document allows (found by the fuzzer: the environment
    probe's wait overflowed epoll's milliseconds, a 500 OverflowError)."""
    r = server.post("/notebooks/run", {"notebook": "year", "fresh": True,
                                       "timeout": 3.1e7, "cell_timeout": 3.1e7,
                                       "cells": [{"id": "a", "source": "6 * 7"}]})
    assert r.status_code == 200, r.text
    (cell,) = r.json()["cells"]
    assert cell["status"] == "ran" and cell["outputs"][0]["data"]["text/plain"] == "42"
