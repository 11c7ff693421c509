"""Bad input: /openapi.json, a schemathesis fuzz of every route, handcrafted nasty requests.

Any 5xx answer, an answer its declared schema does not describe, or a dead
server is a failure. The fuzz is bounded
(FUZZ_EXAMPLES per operation and mode) so the module stays well under a minute.
"""

import collections
import contextlib
import http.client
import json
import os
import re
import socket

import hypothesis
import psutil
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import (content_type_conformance, negative_data_rejection,
                                 response_schema_conformance)
from schemathesis.core.failures import FailureGroup

from snapkernel import main
from support.server import TOKEN

# Examples per operation and mode; SNAPK_FUZZ_EXAMPLES=200 for a deeper run.
FUZZ_EXAMPLES = int(os.environ.get("SNAPK_FUZZ_EXAMPLES", "12"))
# What every answer of the fuzz is checked against, beyond being no 5xx: the schema and the
# content type the OpenAPI document declares for its status.
ANSWER_CHECKS = [response_schema_conformance, content_type_conformance]
# What the document allows and the routes still refuse with 400, each said in the words of
# the field's description: what no schema can know (a folder that does not exist, ids the
# notebook lacks or repeats).
SEMANTIC_REFUSALS = re.compile(r"cwd '.*' is not a folder on the server|the working directory "
                               r".* is not a folder|rerun names cell\(s\) "
                               r"not in the notebook|cell id '.*' appears more than once|--env .*: the "
                               r"variable is not set", re.S)
# Operations whose negative mode has nothing to vary (no parameter, no body): hypothesis
# finds it cannot make an example for them.
NOTHING_TO_GET_WRONG = {("GET /health", "NEGATIVE")}
POST_ROUTES = ["/execute", "/multistate_execute", "/symbol_hashes", "/alias_groups",
               "/rebuild_state", "/interrupt"]


def document(server):
    """The server's OpenAPI document."""
    r = server.get("/openapi.json")
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    return r.json()


def alive(server):
    """The server process runs and answers a cell."""
    assert server.proc.poll() is None
    assert server.value("initial", "6 * 7") == "42"


def test_openapi_document_describes_every_route(server):
    doc = document(server)
    assert doc["openapi"].startswith("3.")
    r = requests.get(server.url + "/openapi.json", timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized"
    routes = {(r.method.lower(), re.sub(r"<(\w+)(:\w+)?>", r"{\1}", r.rule))
              for r in main.app.routes}
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented
    for (method, path) in documented:
        op = doc["paths"][path][method]
        assert "200" in op["responses"], (method, path)
        if path != "/health":
            assert "401" in op["responses"], (method, path)
    assert doc["paths"]["/health"]["get"]["security"] == []
    schemes = doc["components"]["securitySchemes"]
    assert schemes["token"] == dict(schemes["token"], type="apiKey", name="token", **{
        "in": "query"})
    assert schemes["bearer"]["scheme"] == "bearer"
    assert set(doc["components"]["schemas"]["Error"]["properties"]["error"]["required"]) \
        == {"type", "message"}


def test_answer_checks_catch_an_answer_its_schema_does_not_describe(server):
    """The fuzz's answer checks are not vacuous: /health's real answer fails them once
    its schema requires a field the server does not send."""
    doc = document(server)
    schema = doc["paths"]["/health"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]
    schema["required"].append("missing")
    schema["properties"]["missing"] = {"type": "integer"}
    case = schemathesis.openapi.from_dict(doc)["/health"]["GET"].Case()
    response = case.call(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=60)
    assert response.status_code == 200
    with pytest.raises((AssertionError, FailureGroup)):
        case.validate_response(response, checks=ANSWER_CHECKS)


def fuzz(server, headers, examples):
    """Send every operation's generated requests (valid ones, then invalid ones) with
    `headers`; the failures, and the operations hypothesis could make no example for.

    A failure is a 5xx, an answer its declared schema or content type does not
    describe, a valid request refused 400 or 415 (the document allows what the route
    refuses), or an invalid one answered 2xx (schemathesis's negative_data_rejection).
    """
    schema = schemathesis.openapi.from_dict(document(server))
    session = requests.Session()
    failures, unsatisfiable, sent = [], [], collections.Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 16
    for operation in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(generation_mode=mode)
            checks = ANSWER_CHECKS + ([negative_data_rejection] if mode.is_negative else [])

            @settings(max_examples=examples, deadline=None, database=None,
                      phases=[Phase.generate], derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def run(case):
                """Send one generated request; remember what is wrong with its answer."""
                sent[operation.label] += 1
                response = case.call(base_url=server.url, session=session, headers=headers,
                                     timeout=60)
                where = (operation.label, mode.name, response.status_code)
                if response.status_code >= 500:
                    failures.append(where + (response.text[:300], repr(case)[:500]))
                    return
                if mode.is_positive and response.status_code in (400, 415) and \
                        not SEMANTIC_REFUSALS.search(response.json()["error"]["message"]):
                    failures.append(where + ("refused what the document allows: " +
                                             response.json()["error"]["message"][:300],
                                             repr(case.body)[:300]))
                try:
                    case.validate_response(response, checks=checks)
                except (AssertionError, FailureGroup) as exc:  # one failure, or several
                    failures.append(where + (str(exc)[:500], response.text[:300]))

            try:
                run()
            except hypothesis.errors.Unsatisfiable:
                # A mode that cannot make any example: a negative request for an
                # operation that takes nothing a client could get wrong.
                unsatisfiable.append((operation.label, mode.name))
    print(f"schemathesis: {sum(sent.values())} requests over {len(operations)} operations")
    # The fuzz did run: every operation was sent requests.
    assert set(sent) == {operation.label for operation in operations}, sent
    return failures, unsatisfiable


def test_fuzz_every_route_with_schemathesis(server):
    failures, unsatisfiable = fuzz(server, {"Authorization": f"Bearer {TOKEN}"},
                                   FUZZ_EXAMPLES)
    assert not failures, failures[:5]
    assert set(unsatisfiable) <= NOTHING_TO_GET_WRONG, unsatisfiable
    alive(server)


def test_fuzz_every_route_without_the_token(make_server):
    # Without the token every route but /health answers 401, as its document says, and
    # nothing happens: the store holds only `initial` afterwards.
    srv = make_server()
    failures, _ = fuzz(srv, {}, max(FUZZ_EXAMPLES // 3, 3))
    refused = [f for f in failures if f[2] != 401 or "GET /health" in f[0]]
    assert not refused, refused[:5]
    assert srv.get("/states").json()["states"] == ["initial"]
    alive(srv)


def raw_request(server, method, path, body=b"", headers=None):
    """Send exactly `path` and `body` (no client normalisation); (status, JSON answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    sep = "&" if "?" in path else "?"
    conn.request(method, f"{path}{sep}token={TOKEN}", body=body, headers=headers or {})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, data  # cheroot's own plain-text 4xx (malformed request line or length)


@pytest.mark.parametrize("route", POST_ROUTES)
def test_non_utf8_and_wrong_content_types(server, route):
    for raw in [b'{"code": "\xff\xfe", "exec_id": "x", "state_name": "initial"}',
                b"\x80\x81\x82"]:
        status, answer = raw_request(server, "POST", route, raw,
                                     {"Content-Type": "application/json; charset=utf-8"})
        assert status == 400 and answer["error"]["type"] == "BadRequest", (route, answer)
    # A body of any other type is refused 415 before it is read, a JSON one too: what a
    # plain HTML form or a no-cors fetch sends (text/plain) never reaches a route.
    good = json.dumps(BODIES[route]).encode()
    for raw, ctype in [(good, "text/plain"), (good, "text/plain;charset=UTF-8"), (good, None),
                       (b"code=1&exec_id=x&state_name=initial",
                        "application/x-www-form-urlencoded"),
                       (b"--b\r\nContent-Disposition: form-data; name=code\r\n\r\n1\r\n"
                        b"--b--\r\n", "multipart/form-data; boundary=b"),
                       (b"<xml/>", "text/xml"), (b"\x00" * 100, "application/octet-stream")]:
        status, answer = raw_request(server, "POST", route, raw,
                                     {"Content-Type": ctype} if ctype else {})
        assert status == 415, (route, raw[:20], ctype, answer)
        assert answer["error"]["type"] == "UnsupportedMediaType", answer
    assert server.get("/states").json()["states"].count("hn") == 0  # nothing ran


# Values of the wrong kind put in each field of a good body (test below).
ODD_VALUES = {"huge": "é" * 2 ** 20, "nested": {"é" * 2 ** 20: ["é" * 2 ** 20]},
              "bigint": 10 ** 400, "true": True, "null": None}
# The (route, field, value) among them that the field's schema allows: answered 200, the
# answer checked by `check_accepted`. Every other one is refused 400, naming the field.
ACCEPTED = {("/execute", "code", "huge"),
            ("/execute", "exec_id", "huge"), ("/execute", "exec_id", "bigint"),
            ("/execute", "new_state_name", "null"),
            ("/multistate_execute", "code", "huge"),
            ("/multistate_execute", "exec_id", "huge"),
            ("/multistate_execute", "exec_id", "bigint"),
            ("/multistate_execute", "default_state", "null"),
            ("/rebuild_state", "new_state_name", "null"),
            ("/interrupt", "exec_id", "huge"), ("/interrupt", "exec_id", "bigint")}


def check_accepted(route, key, kind, answer):
    """The answer of a body with an odd but allowed value: what that value means."""
    auto_name = re.compile("[0-9a-f]{32}")
    if route == "/interrupt":
        assert answer == {"interrupted": False}
    elif route == "/rebuild_state":  # new_state_name null: a name is made up
        assert auto_name.fullmatch(answer["state_name"]) and answer["groups"] == []
    elif key == "code" and kind == "huge":  # "ééé..." is one long name, read and unknown
        assert answer["error"]["ename"] == "NameError" and answer["state_name"] is None
    else:
        assert answer["error"] is None, answer["error"]
        results = [o["data"]["text/plain"] for o in answer["output"]]
        assert results == ["1"]
        if route == "/multistate_execute":
            assert answer["state_name"] is None
        elif key == "new_state_name":
            assert auto_name.fullmatch(answer["state_name"])
        else:
            assert answer["state_name"] == BODIES[route]["new_state_name"]


BODIES = {
    "/execute": {"code": "1", "exec_id": "h", "state_name": "initial",
                 "new_state_name": "hn"},
    "/multistate_execute": {"code": "1", "exec_id": "h", "state_mapping": {"a": "initial"},
                            "default_state": "initial"},
    "/symbol_hashes": {"state_name": "initial", "symbols": ["x"], "hash_algo": "full"},
    "/alias_groups": {"state_name": "initial"},
    "/rebuild_state": {"input_state": "initial", "source_state": "initial",
                       "source_vars": [], "input_vars": [], "new_state_name": "hr"},
    "/interrupt": {"exec_id": "h"},
}


@pytest.mark.parametrize("route", POST_ROUTES)
def test_huge_strings_and_deep_nesting_in_every_field(server, route):
    deep = "[" * 100_000 + "1" + "]" * 100_000
    for key in BODIES[route]:
        for kind, value in ODD_VALUES.items():
            body = dict(BODIES[route], **{key: value})
            r = server.post(route, data=json.dumps(body).encode(),
                            headers={"Content-Type": "application/json"})
            if (route, key, kind) in ACCEPTED:
                assert r.status_code == 200, (route, key, kind, r.text[:300])
                check_accepted(route, key, kind, r.json())
            else:
                assert r.status_code == 400, (route, key, kind, r.text[:300])
                error = r.json()["error"]
                assert error["type"] == "BadRequest" and \
                    error["message"].startswith(f"field '{key}"), (route, key, kind, error)
        raw = json.dumps(dict(BODIES[route], **{key: 0})).replace(
            f'"{key}": 0', f'"{key}": {deep}')
        r = server.post(route, data=raw.encode(), headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (route, key, r.text[:300])
        assert r.json()["error"]["message"].startswith("the body is not valid JSON"), r.text
    # The huge code ran or failed as a cell, not as a server error: the server is fine.
    alive(server)


PATH_NAMES = ["../../etc/passwd", "a/../b", "/abs/path", "..", ".", "a//b", "%2e%2e%2f",
              "C:\\Windows\\system32", "ünïcödé ✓", "名前/状態", "emoji 🐍🔥", "\u202eevil",
              "x" * 200, "sp ace", "q?x=1", "h#frag", "semi;colon", "quote\"'"]


def quote_name(name):
    """A state name as a path segment: every reserved byte encoded, dots too.

    Clients normalise literal `.` and `..` segments away, so those go as %2E.
    """
    return requests.utils.quote(name, safe="").replace(".", "%2E")


def test_path_like_and_unicode_state_names(server):
    before = set(os.listdir(server.data_dir))
    for i, name in enumerate(PATH_NAMES):
        server.execute(f"v = {i}", new=name)
        assert server.value(name, "v") == str(i), name
        path = "/states/" + quote_name(name)
        r = server.get(path)
        assert r.status_code == 200 and r.json()["name"] == name, (name, r.text)
        assert r.json()["variables"]["v"]["repr"] == str(i)
    listed = server.get("/states").json()["states"]
    assert set(PATH_NAMES) <= set(listed)
    # Names are keys in the store, never paths: nothing appeared beside it.
    assert set(os.listdir(server.data_dir)) == before
    for name in PATH_NAMES:
        r = server.delete("/states/" + quote_name(name))
        assert r.status_code == 200 and r.json() == {"deleted": name}, (name, r.text)
    # Unquoted dot segments and odd paths sent verbatim: a JSON answer, never a 5xx.
    for raw in ["/states/../states", "/states/%2e%2e/x", "/states/%ff%fe", "/states/%00",
                "/states/a%0ab", "/states/" + "y" * 5000, "/states//"]:
        status, answer = raw_request(server, "GET", raw)
        assert status < 500 and ("error" in answer or "name" in answer or "states" in answer), \
            (raw, status, answer)
    alive(server)


def test_huge_tokens_headers_and_lengths(server):
    huge = "t" * (2 ** 20)
    for params, headers in [({"token": huge}, {}), ({}, {"Authorization": "Bearer " + huge}),
                            ({}, {"X-Junk": huge})]:
        # Past server.max_header_kb (64 KiB): 431, as JSON, before any token is looked at.
        r = requests.get(server.url + "/states", params=params, headers=headers, timeout=60)
        assert r.status_code == 431, (r.status_code, r.text[:200])
        assert r.json()["error"]["type"] == "RequestHeaderFieldsTooLarge", r.text
        assert "max_header_kb (64 KiB)" in r.json()["error"]["message"]
    for params, headers in [({"token": "t" * 60_000}, {}),
                            ({}, {"Authorization": "Bearer \u00e9"})]:
        r = requests.get(server.url + "/states", params=params, headers=headers, timeout=60)
        assert r.status_code == 401, (r.status_code, r.text[:200])
        assert r.json() == {"error": {"type": "Unauthorized",
                                      "message": "missing or invalid token"}}
    for length, expect in [("-1", (400, {"error": {
                                "type": "BadRequest",
                                "message": "the request needs a JSON object body"}})),
                           ("abc", (400, b"Malformed Content-Length Header.")),
                           ("99999999999999999999", (413, {"error": {
                                "type": "PayloadTooLarge",
                                "message": "the body is larger than max_body_mb (64 MiB)"}}))]:
        answer = raw_request(server, "POST", "/execute", b'{"code": "1"}',
                             {"Content-Type": "application/json", "Content-Length": length})
        assert answer == expect, (length, answer)
    alive(server)


def test_a_huge_header_without_the_token_costs_the_server_no_memory(make_server):
    # A client without the token sends a 64 MiB header: the server answers 431 (or closes
    # the connection) once past max_header_kb, having read a few KiB of it, not 64 MiB
    # (before the limit it grew by 193 MiB before answering 401).
    srv = make_server()
    rss = psutil.Process(srv.proc.pid).memory_info().rss
    answer = b""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as sock:
        try:
            sock.sendall(b"GET /states HTTP/1.1\r\nHost: localhost\r\nX-Junk: " +
                         b"j" * (64 * 2 ** 20) + b"\r\n\r\n")
        except OSError:
            pass  # closed on us once past the limit
        with contextlib.suppress(OSError):
            answer = sock.recv(65536)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    grown = psutil.Process(srv.proc.pid).memory_info().rss - rss
    assert grown < 16 * 2 ** 20, f"the server grew by {grown / 2 ** 20:.0f} MiB"
    # A request line past the limit is answered the same way.
    status, answer = raw_request(srv, "GET", "/states/" + "y" * 70_000)
    assert status == 431 and answer["error"]["type"] == "RequestHeaderFieldsTooLarge"
    alive(srv)
