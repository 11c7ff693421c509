"""Streamed answers: "stream": true on /execute and /multistate_execute (NDJSON)."""

import requests

from support.server import stream


def test_first_output_arrives_before_the_cell_ends(server, gate):
    # The cell waits at a gate after its first print, and the gate opens only once that
    # output has arrived: held back until the cell's end, it would never arrive.
    held = gate()
    code = "print('before', flush=True)\n" + held.code + "print('after')\n'done'"
    lines = stream(server, "/execute", {"code": code, "exec_id": "s1",
                                        "state_name": "initial", "new_state_name": "st1"})
    first = next(lines)
    assert first == {"type": "output", "output": {"output_type": "stream", "name": "stdout",
                                                  "text": "before\n"}}
    held.arrived()  # the cell goes on to wait at the gate: it could not have ended
    held.open()
    lines = [first, *lines]
    last = lines[-1]
    assert last["type"] == "answer"
    answer = last["answer"]
    assert answer["state_name"] == "st1" and answer["error"] is None
    # The answer still carries every output, merged as without streaming.
    assert answer["output"][0]["text"] == "before\nafter\n"
    assert answer["output"][1]["data"]["text/plain"] == "'done'"
    items = [line["output"] for line in lines[:-1]]
    assert [i["output_type"] for i in items] == ["stream", "stream", "execute_result"]
    assert items[1]["text"] == "after\n"


def test_display_updates_and_clears_are_streamed(server):
    code = ("from IPython.display import display, clear_output\n"
            "h = display('one', display_id=True)\n"
            "h.update('two')\n"
            "clear_output()\n"
            "print('end')")
    lines = list(stream(server, "/multistate_execute", {
        "code": code, "exec_id": "s2", "state_mapping": {}}))
    kinds = [line["type"] if line["type"] != "output" else line["output"]["output_type"]
             for line in lines]
    assert kinds == ["display_data", "update_display_data", "clear_output", "stream",
                     "answer"], lines
    assert lines[1]["output"]["data"]["text/plain"] == "'two'"
    assert lines[1]["output"]["transient"]["display_id"] == \
        lines[0]["output"]["transient"]["display_id"]
    assert lines[-1]["answer"]["output"] == [
        {"output_type": "stream", "name": "stdout", "text": "end\n"}]


def test_errors_before_the_cell_are_plain_json(server):
    r = requests.post(server.url + "/execute", params={"token": server.token},
                      json={"code": "1", "exec_id": 5.5, "state_name": "initial",
                            "stream": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequest"
    lines = list(stream(server, "/execute", {
        "code": "1", "exec_id": "s3", "state_name": "no-such-state"}))
    assert lines == [{"type": "answer", "answer": lines[0]["answer"]}]
    assert lines[0]["answer"]["error"]["ename"] == "StateNotFound"


def test_without_stream_nothing_changes(server):
    r = server.post("/execute", {"code": "print(1)", "exec_id": "s4", "state_name": "initial",
                                 "stream": False})
    assert r.headers["Content-Type"] == "application/json"
    assert r.json()["output"] == [{"output_type": "stream", "name": "stdout", "text": "1\n"}]
