"""The HTTP API: routes, wire format, authentication and bad input."""

import requests

from support.server import TOKEN, error_of


def test_health_needs_no_token(server):
    r = requests.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_token_required_on_every_route(server):
    for method, path in [("GET", "/states"), ("GET", "/states/initial"),
                         ("POST", "/execute"), ("POST", "/reset"), ("POST", "/interrupt"),
                         ("DELETE", "/states/initial"), ("POST", "/symbol_hashes")]:
        r = requests.request(method, server.url + path, timeout=10)
        assert r.status_code == 401, (method, path)
        assert r.json()["error"]["type"] == "Unauthorized"
        r = requests.request(method, server.url + path, params={"token": "wrong"}, timeout=10)
        assert error_of(r, 401)["type"] == "Unauthorized", (method, path)


def test_bearer_header_accepted(server):
    r = requests.get(server.url + "/states", headers={"Authorization": f"Bearer {TOKEN}"},
                     timeout=60)
    assert r.status_code == 200 and "initial" in r.json()["states"]


def test_initial_state_exists(server):
    assert "initial" in server.get("/states").json()["states"]
    state = server.get("/states/initial").json()
    assert state["name"] == "initial" and state["variables"] == {}


def test_state_description(server):
    server.execute("import math\nx = [1, 2]", new="api-desc")
    state = server.get("/states/api-desc").json()
    assert set(state) >= {"name", "timestamp", "variables", "modules", "parent"}
    assert state["variables"]["x"] == {"type": "list", "repr": "[1, 2]"}
    assert state["modules"] == {"math": "math"}
    assert state["parent"] == "initial"


def test_execute_answer_keys(server):
    answer = server.execute("a = 1", new="api-keys")
    assert set(answer) >= {"output", "state_name", "error", "accessed_symbols",
                           "modified_symbols", "deleted_symbols"}
    answer = server.execute("1", new=None)
    assert len(answer["state_name"]) == 32


def test_unknown_state(server):
    r = server.post("/execute", {"code": "1", "exec_id": "u1", "state_name": "nope"})
    assert r.status_code == 200
    assert r.json()["error"]["ename"] == "StateNotFound"
    assert r.json()["state_name"] is None
    for method, path, body in [
            ("GET", "/states/nope", None), ("DELETE", "/states/nope", None),
            ("POST", "/symbol_hashes", {"state_name": "nope", "symbols": []}),
            ("POST", "/alias_groups", {"state_name": "nope"}),
            ("POST", "/rebuild_state", {"input_state": "nope", "source_state": "initial",
                                        "source_vars": [], "input_vars": []})]:
        r = server.request(method, path, json=body)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["type"] == "StateNotFound"


def test_delete_state(server):
    server.execute("x = 1", new="api-del")
    assert server.delete("/states/api-del").json() == {"deleted": "api-del"}
    assert "api-del" not in server.get("/states").json()["states"]
    assert error_of(server.delete("/states/initial"), 409)["type"] == "Conflict"
    assert "initial" in server.get("/states").json()["states"]


def test_malformed_bodies(server):
    cases = [b"{not json", b"[1, 2]", b"", "é".encode("latin-1"), b"\"str\"",
             b"[" * 100000 + b"]" * 100000]
    for raw in cases:
        r = server.post("/execute", data=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (raw[:20], r.text)
        assert r.json()["error"]["type"] == "BadRequest"


def test_missing_and_mistyped_fields(server):
    bad = [{"exec_id": "x"}, {"state_name": "initial"},
           {"code": 5, "exec_id": "x", "state_name": "initial"},
           {"code": "1", "exec_id": ["x"], "state_name": "initial"},
           {"code": "1", "exec_id": "x", "state_name": 3},
           {"code": "1", "exec_id": "x", "state_name": "initial", "new_state_name": 4}]
    for body in bad:
        error = error_of(server.post("/execute", body), 400)
        assert error["type"] == "BadRequest" and error["message"].startswith("field '"), body
    # The message names the field and what is wrong with it.
    messages = {
        "field 'exec_id' is missing": {"code": "1", "state_name": "initial"},
        "field 'code' must be string": bad[2],
        "field 'code' is missing": {"exec_id": "x", "state_name": "initial"},
        "field 'exec_id' must be string or integer": bad[3],
        "field 'new_state_name' must not contain control characters":
            {"code": "1", "exec_id": "x", "state_name": "initial", "new_state_name": "a\nb"},
    }
    for message, body in messages.items():
        assert server.post("/execute", body).json()["error"]["message"] == message
    for route, body, message in [
            ("/symbol_hashes", {"state_name": "initial", "symbols": "x"},
             "field 'symbols' must be array"),
            ("/symbol_hashes", {"state_name": "initial", "symbols": ["x"], "hash_algo": "md5"},
             "field 'hash_algo' must be one of ['full']"),
            ("/multistate_execute", {"exec_id": "m", "code": "1", "state_mapping": []},
             "field 'state_mapping' must be object"),
            ("/rebuild_state", {"input_state": "initial", "source_state": "initial",
                                "source_vars": "a", "input_vars": []},
             "field 'source_vars' must be array")]:
        assert error_of(server.post(route, body), 400) == {"type": "BadRequest",
                                                           "message": message}


def test_bad_state_names(server):
    for name in ["", "x" * 201, "a\nb", "tab\there", "nul\x00"]:
        r = server.post("/execute", {"code": "1", "exec_id": "n", "state_name": "initial",
                                     "new_state_name": name})
        error = error_of(r, 400)
        assert error["type"] == "BadRequest" and "'new_state_name'" in error["message"], name
    # 200 characters, but more bytes than the store's keys hold: refused before running.
    r = server.post("/execute", {"code": "ran = 1", "exec_id": "n", "state_name": "initial",
                                 "new_state_name": "\U0001d518" * 200})
    assert r.status_code == 400 and "800 bytes" in r.json()["error"]["message"], r.text
    server.execute("v = 1", new="x" * 200)
    server.execute("v = 1", new="\u00e9" * 200)
    server.execute("v = 2", new="päth/like ünïcode ✓")
    assert server.value("päth/like ünïcode ✓", "v") == "2"
    assert server.get("/states/päth/like ünïcode ✓").json()["variables"]["v"]["repr"] == "2"


def test_large_cell_runs_and_oversized_body_is_413(server):
    code = "s = 0\n" + "s += 1\n" * 43000
    assert len(code) > 300_000
    answer = server.execute(code + "s")
    assert answer["output"][-1]["data"]["text/plain"] == "43000"
    huge = b'{"code": "' + b"x" * (65 * 2 ** 20) + b'"}'
    r = server.post("/execute", data=huge, headers={"Content-Type": "application/json"})
    assert error_of(r, 413)["type"] == "PayloadTooLarge"


def test_syntax_error_is_an_error_answer(server):
    answer = server.execute("def (:", ok=False)
    assert answer["error"]["ename"] == "SyntaxError"
    assert answer["state_name"] is None


def test_interrupt_unknown_exec_id(server):
    assert server.post("/interrupt", {"exec_id": "never-ran"}).json() == {"interrupted": False}
    assert error_of(server.post("/interrupt", {}), 400) == {
        "type": "BadRequest", "message": "field 'exec_id' is missing"}


def test_unknown_route_and_method_are_json(server):
    assert error_of(server.get("/nowhere"), 404)["type"] == "NotFound"
    assert error_of(server.request("PUT", "/states"), 405)["type"] == "MethodNotAllowed"


def test_reset_without_body(server, make_server):
    srv = make_server()
    srv.execute("x = 1", new="r1")
    r = srv.post("/reset")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert srv.get("/states").json()["states"] == ["initial"]
    assert srv.value("initial", "1 + 1") == "2"
