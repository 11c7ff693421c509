"""The trace option: every process stamps each phase of a request into one file."""

from snapkernel.kernel import trace


def test_every_phase_of_an_execution_is_stamped_in_order(make_server, tmp_path):
    path = tmp_path / "trace.jsonl"
    srv = make_server(config=f'[server]\ntrace_file = "{path}"\n')
    state = srv.execute("x = 1", exec_id="traced-1")["state_name"]
    srv.execute("x += 1", state=state, exec_id="traced-2")
    srv.stop()
    stamps = sorted((s for s in trace.read(path) if s["exec"] == "traced-2"),
                    key=lambda s: s["t"])
    # After answering, the child forks its state's holder and rehearses a cell, while
    # the server replies: those two stamps come after "answering", in either order with
    # the server's.
    after = [s["phase"] for s in stamps if s["phase"] in ("forked", "warmed")]
    assert after in ([], ["forked"], ["forked", "warmed"])
    assert [s["phase"] for s in stamps if s["phase"] not in after] == [
        "request", "sent", "received", "compiled", "ran", "saved", "answering", "answer",
        "bound", "synced", "reply"]
    phases = [s["phase"] for s in stamps]
    assert all(phases.index(p) > phases.index("answering") for p in after)
    roles = {s["phase"]: (s["role"], s["pid"]) for s in stamps}
    assert roles["request"][0] == "server" and roles["ran"][0] == "child"
    assert roles["request"][1] == srv.proc.pid != roles["ran"][1]

