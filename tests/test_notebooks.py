"""Notebook runs through a real server: POST /notebooks/run and the /notebooks routes.

Results are shared by every notebook of a store (a cell's key depends on
its source and inputs, not on the notebook), so each test tags its cells'
sources with its own comment to start from a store that never saw them.
"""

import itertools
import json
import os
import signal

import pytest
import requests

from support.notebook import cell, run, statuses
from support.server import in_thread, wait_for

_ids = itertools.count()


def cells(tag, *sources):
    """[{id, source}] with ids c0, c1, ... and every source tagged (a comment line)."""
    return [{"id": f"c{n}", "source": f"{src}\n# {tag}"} for n, src in enumerate(sources)]


def shown(answer, cell_id):
    """The text a cell printed or showed as its result."""
    parts = []
    for out in cell(answer, cell_id)["outputs"]:
        parts.append(out.get("text") or out.get("data", {}).get("text/plain", ""))
    return "".join(parts).strip()


def test_an_edit_runs_that_cell_and_its_dependents_only(server):
    nb = cells("edit", "import json\nbase = 2", "x = base * 3", "y = 100",
               "z = x + 1\nz", "w = y * 2\nprint(w)")
    first = run(server, "edit", nb)
    assert set(statuses(first).values()) == {"ran"}
    assert shown(first, "c3") == "7" and shown(first, "c4") == "200"
    assert first["order"] == ["c0", "c1", "c2", "c3", "c4"]
    assert [cell(first, f"c{n}")["execution_count"] for n in range(5)] == [1, 2, 3, 4, 5]
    nb[1]["source"] = nb[1]["source"].replace("base * 3", "base * 4")
    second = run(server, "edit", nb)
    # c2 lies between the edited cell and its reader c3, and does not run.
    assert statuses(second) == {"c0": "reused", "c1": "ran", "c2": "reused", "c3": "ran",
                                "c4": "reused"}
    assert shown(second, "c3") == "9" and shown(second, "c4") == "200"
    assert cell(second, "c0")["key"] == cell(first, "c0")["key"]
    assert cell(second, "c1")["key"] != cell(first, "c1")["key"]
    # Every state named in the answer goes on with /execute, the final one with all names.
    after = server.execute("print(x, z)", cell(second, "c3")["state_name"])
    assert after["output"][0]["text"] == "8 9\n"
    final = server.execute("print(base, x, y, z, w)", second["state_name"])
    assert final["output"][0]["text"] == "2 8 100 9 200\n"


def test_states_a_run_goes_on_from_get_no_holder_and_restore_from_the_store(server):
    """The process that ran a cell runs the next one without forking a holder for the
    state between them; the state the run ends on keeps one. A state left without
    one is restored from the store when something runs from it."""
    nb = cells("chain", "a = [1]", "b = a + [2]", "c = b + [3]", "print(c)")
    first = run(server, "chain", nb)
    names = [cell(first, f"c{n}")["state_name"] for n in range(4)]
    assert [server.get(f"/states/{n}").json()["live"] for n in names] == \
        [False, False, False, True]
    after = server.execute("print(a, b)", names[1])
    assert after["output"][0]["text"] == "[1] [1, 2]\n"
    nb[2]["source"] = nb[2]["source"].replace("[3]", "[4]")
    second = run(server, "chain", nb)
    assert statuses(second) == {"c0": "reused", "c1": "reused", "c2": "ran", "c3": "ran"}
    assert shown(second, "c3") == "[1, 2, 4]"


def test_a_cell_that_kills_its_process_leaves_the_state_before_it_to_the_store(server):
    """The process that made c1's state (and held it alone) died running c2; the next
    run finds that state in the store and goes on from it."""
    nb = cells("crash", "a = 1", "b = a + 1", "import os\nos._exit(3)", "print(b)")
    first = run(server, "crash", nb)
    assert statuses(first) == {"c0": "ran", "c1": "ran", "c2": "failed", "c3": "not_run"}
    assert cell(first, "c2")["error"]["ename"] == "WorkerDied"
    assert not server.get(f"/states/{cell(first, 'c1')['state_name']}").json()["live"]
    nb[2]["source"] = nb[2]["source"].replace("import os\nos._exit(3)", "c = b * 10")
    second = run(server, "crash", nb)
    assert statuses(second) == {"c0": "reused", "c1": "reused", "c2": "ran", "c3": "ran"}
    assert shown(second, "c3") == "2"


def test_an_edit_runs_on_the_last_runs_final_state_without_its_later_names(server):
    """An edited cell runs on in the state the last run ended on (live, unlike its own
    input state) when that state's process context is its input's (docs/context.md),
    but a later name that state holds is not seen before the cell that defines it."""
    probe = "print(a)\ntry:\n    c\nexcept NameError:\n    print('no c')\nelse:\n    print('c', c)"
    nb = cells("final-base", "z = 0", "a = 1", probe, "c = a * 2")
    first = run(server, "final-base", nb)
    assert shown(first, "c2") == "1\nno c"
    nb[1]["source"] = nb[1]["source"].replace("a = 1", "a = 5")
    second = run(server, "final-base", nb)
    assert statuses(second) == {"c0": "reused", "c1": "ran", "c2": "ran", "c3": "ran"}
    assert shown(second, "c2") == "5\nno c"
    # c1 ran in the last run's final state (execution counts go on from it).
    assert cell(second, "c1")["execution_count"] == cell(first, "c3")["execution_count"] + 1
    assert server.execute("print(a, c)", second["state_name"])["output"][0]["text"] == "5 10\n"


def test_an_edited_first_cell_runs_in_a_fresh_context_as_in_a_clean_run(server):
    """The first cell's context is `initial`'s, whatever state the last run ended on: what
    a later cell set there (an environment variable) is not seen by the edited first
    cell, which counts 1 as in a clean Run All."""
    nb = cells("first-edit", "import os\nprint(os.environ.get('SNAPK_FIRST'))  # v1",
               "os.environ['SNAPK_FIRST'] = 'two'")
    first = run(server, "first-edit", nb)
    assert shown(first, "c0") == "None"
    nb[0]["source"] = nb[0]["source"].replace("v1", "v2")
    second = run(server, "first-edit", nb)
    assert statuses(second) == {"c0": "ran", "c1": "ran"}
    assert shown(second, "c0") == "None"
    assert cell(second, "c0")["execution_count"] == 1


def test_after_a_restart_an_edited_cell_that_reads_nothing_runs_on_from_the_cell_before(
        make_server, tmp_path):
    """After a restart only `initial` is live: a cell that reads nothing still runs in the
    state of the cell before it (restored), not in the empty `initial`, so its state holds
    the earlier names and its execution count follows the run."""
    data = tmp_path / "store"
    srv = make_server(data)
    nb = cells("counts", "a = 1", "b = 2", "c = a + 1")
    first = run(srv, "counts", nb)
    srv.stop()
    srv = make_server(data)
    srv.execute("1 + 1")  # `initial` is the one live state now
    nb[1]["source"] = nb[1]["source"].replace("b = 2", "b = 3")
    second = run(srv, "counts", nb)
    assert statuses(second) == {"c0": "reused", "c1": "ran", "c2": "reused"}
    assert cell(second, "c1")["execution_count"] == cell(first, "c0")["execution_count"] + 1
    assert srv.execute("print(a, b)", cell(second, "c1")["state_name"])["output"][0]["text"] \
        == "1 3\n"


def test_in_place_writes_in_a_run_are_never_missed(make_server, tmp_path):
    """Within a run each cell runs in the process that made the state before it, no fork
    between them, so every page is its own: a buffer a cell only read keeps its hash (its
    chunks' digests vouch for them), one it wrote a byte of is stored anew, and a restart
    restores each state byte for byte."""
    data = tmp_path / "store"
    srv = make_server(data)
    nb = cells("inplace", "import numpy as np\narr = np.zeros(2_000_000)\n"
               "other = np.ones(2_000_000)", "total = float(arr.sum() + other.sum())",
               "arr[1_500_000] = 7.0", "after = float(arr.sum())")
    first = run(srv, "inplace", nb)
    assert set(statuses(first).values()) == {"ran"}
    names = [cell(first, f"c{n}")["state_name"] for n in range(4)]

    def hashes(state):
        """Symbol hashes of arr and other in `state`."""
        return srv.post("/symbol_hashes", {"state_name": state,
                                           "symbols": ["arr", "other"]}).json()["hashes"]

    made, read, written = hashes(names[0]), hashes(names[1]), hashes(names[2])
    assert read == made
    assert written["arr"] != made["arr"] and written["other"] == made["other"]
    srv.stop()
    srv = make_server(data)
    assert srv.value(names[0], "float(arr.sum()), float(other.sum())") == \
        "(0.0, 2000000.0)"
    assert srv.value(names[2], "float(arr[1_500_000]), float(arr.sum())") == "(7.0, 7.0)"
    assert srv.value(names[3], "after") == "7.0"


def test_a_second_run_runs_nothing_also_after_a_restart(make_server, tmp_path):
    data = tmp_path / "store"
    srv = make_server(data)
    # Each cell first notes in a file that it ran: the file, not only the statuses,
    # shows that the later runs ran nothing.
    ran = tmp_path / "ran.txt"
    sources = ["import numpy as np\nimport math", "a = np.arange(4)", "b = math.pi",
               "c = a * b\nc.round(2)", "print(c.sum().round(3))"]
    nb = cells("again", *[f"open({str(ran)!r}, 'a').write('c{n} ')\n{src}"
                          for n, src in enumerate(sources)])
    first = run(srv, "again", nb)
    assert set(statuses(first).values()) == {"ran"}
    assert ran.read_text() == "c0 c1 c2 c3 c4 "
    second = run(srv, "again", nb)
    assert set(statuses(second).values()) == {"reused"}
    assert ran.read_text() == "c0 c1 c2 c3 c4 "  # a look-up, not a run
    for n in range(5):
        assert cell(second, f"c{n}")["outputs"] == cell(first, f"c{n}")["outputs"]
        assert cell(second, f"c{n}")["execution_count"] == cell(first, f"c{n}")["execution_count"]
    assert second["state_name"] == first["state_name"]
    srv.stop()
    srv = make_server(data)
    third = run(srv, "again", nb)
    assert set(statuses(third).values()) == {"reused"}
    assert ran.read_text() == "c0 c1 c2 c3 c4 "
    assert shown(third, "c4") == shown(first, "c4") == "18.85"
    assert srv.execute("print(c.sum().round(3))", third["state_name"])["output"][0]["text"] \
        == "18.85\n"
    record = srv.get("/notebooks/again").json()
    assert record["running"] is False and statuses(record) == statuses(third)
    assert shown(record, "c3") == shown(first, "c3")


def test_a_run_cut_by_sigkill_leaves_the_store_as_before_it(make_server, tmp_path, gate):
    """The server is killed while a run's third cell runs, after its second cell made a
    state (committed without a flush of its own: the run's states become durable
    together when it ends). After a restart the store opens, what the run before made
    is intact, and the next run runs the killed run's cells again, reusing the rest."""
    data = tmp_path / "store"
    srv = make_server(data)
    ran = tmp_path / "ran.txt"
    wait = gate()
    sources = ["import numpy as np\na = np.arange(5)", "b = a * 2", "c = b + 1\nprint(c)"]
    nb = cells("sigkill", *[f"open({str(ran)!r}, 'a').write('c{n} ')\n{src}"
                            for n, src in enumerate(sources)])
    first = run(srv, "sigkill", nb)
    assert set(statuses(first).values()) == {"ran"}
    before = {c["id"]: c["state_name"] for c in first["cells"]}
    edited = [dict(c) for c in nb]
    edited[1]["source"] = edited[1]["source"].replace("a * 2", "a * 3")
    edited[2]["source"] = wait.code + edited[2]["source"]
    cut = in_thread(run, srv, "sigkill", edited)
    [child] = wait.arrived()
    record = srv.get("/notebooks/sigkill").json()
    assert record["running"] is True and statuses(record)["c1"] == "ran"
    made_in_cut = cell(record, "c1")["state_name"]
    srv.stop(signal.SIGKILL)
    with pytest.raises(requests.ConnectionError):
        cut.result(timeout=60)
    os.kill(child, signal.SIGKILL)  # the orphaned cell, left waiting at the gate
    wait.open()
    srv = make_server(data)
    for cell_id, state in before.items():
        assert srv.get(f"/states/{state}").status_code == 200
    assert srv.value(before["c1"], "b.tolist()") == "[0, 2, 4, 6, 8]"
    assert srv.value(before["c2"], "c.tolist()") == "[1, 3, 5, 7, 9]"
    assert srv.get("/notebooks/sigkill").json()["cells"] == first["cells"]
    # The killed run stored no result: its cells run again, the one before it is reused.
    ran.write_text("")
    again = run(srv, "sigkill", edited)
    assert statuses(again) == {"c0": "reused", "c1": "ran", "c2": "ran"}
    assert ran.read_text() == "c1 c2 "
    assert shown(again, "c2") == "[ 1  4  7 10 13]"
    assert cell(again, "c1")["state_name"] == made_in_cut  # the same key, named again
    # And the run before it is still whole: the first notebook is reused entirely.
    assert set(statuses(run(srv, "sigkill", nb)).values()) == {"reused"}
    assert ran.read_text() == "c1 c2 "


def test_moving_a_cell_in_dataflow_order_runs_nothing(server):
    nb = cells("move", "total = part + 1", "part = 41", "print(total)")
    first = run(server, "move", nb, order="dataflow")
    assert first["order"] == ["c1", "c0", "c2"]
    assert set(statuses(first).values()) == {"ran"} and shown(first, "c2") == "42"
    moved = [nb[2], nb[0], nb[1]]
    second = run(server, "move", moved, order="dataflow")
    assert set(statuses(second).values()) == {"reused"}
    assert second["order"] == ["c1", "c0", "c2"]
    assert [c["id"] for c in second["cells"]] == ["c2", "c0", "c1"]


@pytest.mark.parametrize("order", ["notebook", "dataflow"])
def test_an_import_added_in_another_cell_runs_nothing_else(server, order):
    tag = f"import-{order}"
    nb = cells(tag, "import math\nr = math.sqrt(16)", "s = r + 1\nprint(s)", "t = 5")
    run(server, tag, nb, order=order)
    added = [{"id": "new", "source": f"import numpy as np\n# {tag}"}] + nb
    answer = run(server, tag, added, order=order)
    assert statuses(answer) == {"new": "ran", "c0": "reused", "c1": "reused", "c2": "reused"}


def test_a_changed_environment_reruns_third_party_importers_and_dependents(
        make_server, tmp_path, monkeypatch):
    site = tmp_path / "site"
    dist = site / "fakepkg-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    srv = make_server()
    nb = cells("env", "import json\nj = json.dumps([1, 2])", "import numpy as np\nv = np.ones(3)",
               "u = v.sum()\nprint(u)", "k = len(j)\nprint(k)", "both = (k, int(u))")
    assert set(statuses(run(srv, "env", nb)).values()) == {"ran"}
    assert set(statuses(run(srv, "env", nb)).values()) == {"reused"}
    upgraded = site / "fakepkg-2.0.dist-info"
    dist.rename(upgraded)
    (upgraded / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg\nVersion: 2.0\n")
    answer = run(srv, "env", nb)
    assert statuses(answer) == {"c0": "reused", "c1": "ran", "c2": "ran", "c3": "reused",
                                "c4": "ran"}


def test_static_errors_in_dataflow_order_name_their_cells_and_names(server):
    nb = cells("static", "p = q + 1", "q = p + 1", "d1 = 1", "d1 = 2", "f1 = 1", "f1 += 1",
               "ok = 1\nprint(ok)", "print(d1)", "needs_p = p")
    answer = run(server, "static", nb, order="dataflow")
    found = {d["kind"]: d for d in answer["diagnostics"]}
    assert set(found) == {"cycle", "double_definition", "foreign_assignment"}
    assert found["cycle"]["cells"] == ["c0", "c1"] and found["cycle"]["names"] == ["p", "q"]
    assert found["double_definition"]["cells"] == ["c2", "c3"]
    assert found["double_definition"]["names"] == ["d1"]
    assert found["foreign_assignment"]["cells"] == ["c4", "c5"]
    assert found["foreign_assignment"]["names"] == ["f1"]
    for d in found.values():
        assert all(name in d["message"] for name in d["names"]), d
    assert statuses(answer) == {"c0": "blocked", "c1": "blocked", "c2": "blocked",
                                "c3": "blocked", "c4": "blocked", "c5": "blocked", "c6": "ran",
                                "c7": "blocked", "c8": "blocked"}
    assert shown(answer, "c6") == "1"
    assert cell(answer, "c0")["error"]["ename"] == "Cycle"


@pytest.mark.parametrize("order", ["notebook", "dataflow"])
def test_a_syntax_error_blocks_only_its_dependents(server, order):
    tag = f"syntax-{order}"
    nb = cells(tag, "base = 1", "broken = 2 *", "use = broken * 2", "other = base + 1\nother")
    answer = run(server, tag, nb, order=order)
    assert statuses(answer) == {"c0": "ran", "c1": "blocked", "c2": "blocked", "c3": "ran"}
    (diag,) = answer["diagnostics"]
    assert diag["kind"] == "syntax_error" and diag["cells"] == ["c1"]
    assert (diag["line"], diag["column"]) == (1, 13)
    assert "line 1, column 13" in diag["message"]
    assert cell(answer, "c1")["error"]["ename"] == "SyntaxError"
    assert cell(answer, "c1")["key"] is None
    assert shown(answer, "c3") == "2"
    nb[1]["source"] = nb[1]["source"].replace("2 *", "2 * 3")
    fixed = run(server, tag, nb, order=order)
    assert statuses(fixed) == {"c0": "reused", "c1": "ran", "c2": "ran", "c3": "reused"}


def test_a_cell_that_does_not_parse_shows_its_own_error_unless_the_run_stopped(server):
    """As Jupyter: an IndentationError is one (not a SyntaxError), with its line; after
    a failing cell (notebook order) the cells that follow are not run, and one that
    does not parse shows nothing either."""
    nb = cells("indent", "for i in range(2):\n\nprint(i)", "x = 1")
    answer = run(server, "indent", nb)
    assert statuses(answer) == {"c0": "blocked", "c1": "ran"}
    assert cell(answer, "c0")["error"]["ename"] == "IndentationError"
    assert cell(answer, "c0")["error"]["evalue"] == (
        "expected an indented block after 'for' statement on line 1 (line 3)")
    stopped = run(server, "stopped", cells("stopped", "1 / 0", "broken = 2 *"))
    assert statuses(stopped) == {"c0": "failed", "c1": "not_run"}
    assert cell(stopped, "c1")["error"] is None


def test_a_generator_is_rebuilt_only_when_its_reader_runs(server):
    nb = cells("gen", "gen = (i * i for i in range(10))", "first = next(gen)\nfirst",
               "other = 1")
    first = run(server, "gen", nb)
    assert set(statuses(first).values()) == {"ran"} and shown(first, "c1") == "0"
    nb[2]["source"] = nb[2]["source"].replace("other = 1", "other = 2")
    assert statuses(run(server, "gen", nb)) == {"c0": "reused", "c1": "reused", "c2": "ran"}
    nb[1]["source"] = nb[1]["source"].replace("next(gen)", "next(gen) + 100")
    answer = run(server, "gen", nb)
    assert statuses(answer) == {"c0": "ran", "c1": "ran", "c2": "reused"}
    # A new generator, made just before its reader: not the one c1's first run advanced.
    assert shown(answer, "c1") == "100"
    assert answer["order"] == ["c0", "c1", "c2"]


def test_rerun_forces_the_cell_and_everything_downstream(server):
    nb = cells("rerun", "import random\nr = random.random()", "s = r * 2", "t = 3",
               "print(s == 2 * r)")
    first = run(server, "rerun", nb)
    before = server.value(cell(first, "c1")["state_name"], "s")
    again = run(server, "rerun", nb, rerun=["c0"])
    assert statuses(again) == {"c0": "ran", "c1": "ran", "c2": "reused", "c3": "ran"}
    assert shown(again, "c3") == "True"
    # Same key, so the same state name, now bound to the new result.
    assert cell(again, "c1")["state_name"] == cell(first, "c1")["state_name"]
    assert server.value(cell(again, "c1")["state_name"], "s") != before


def test_a_failing_cell_stops_notebook_order_but_only_its_dependents_in_dataflow(server):
    nb = cells("fail", "x = 1", "q = 1 / 0", "r = q + 1", "s = x + 1\nprint(s)")
    answer = run(server, "fail", nb)
    assert statuses(answer) == {"c0": "ran", "c1": "failed", "c2": "not_run", "c3": "not_run"}
    assert cell(answer, "c1")["error"]["ename"] == "ZeroDivisionError"
    assert cell(answer, "c1")["state_name"] is None
    flow = run(server, "fail-flow", nb, order="dataflow")
    assert statuses(flow) == {"c0": "reused", "c1": "failed", "c2": "blocked", "c3": "ran"}
    # A failing cell stored no result: the next run tries it again.
    assert statuses(run(server, "fail", nb))["c1"] == "failed"
    # The final state has what the cells before the failure made.
    assert server.value(answer["state_name"], "x") == "1"


def test_interrupting_a_run_stops_its_cell_and_the_run(server):
    # The cell sleeps an hour: only the interrupt can end the run within the wait below.
    nb = cells("interrupt", "x = 1", "import time\ntime.sleep(3600)", "y = x")
    exec_id = f"nb-interrupt-{next(_ids)}"
    running = in_thread(run, server, "interrupt", nb, exec_id=exec_id)

    def sleeping():
        """The run's record once its second cell runs, else None."""
        record = server.get("/notebooks/interrupt")
        if record.status_code == 200 and record.json()["running"] and \
                statuses(record.json())["c1"] == "running":
            return record.json()
        assert not running.done(), running.result()  # (raises what ended the run early)
        return None

    record = wait_for(sleeping, "the sleeping cell to start")
    assert statuses(record)["c0"] == "ran" and statuses(record)["c2"] == "pending"
    # While it runs: the same notebook cannot start again, nor be deleted.
    assert run(server, "interrupt", nb, status=409)["error"]["type"] == "Conflict"
    r = server.delete("/notebooks/interrupt")
    assert r.status_code == 409 and r.json()["error"]["type"] == "Conflict", r.text
    assert server.post("/interrupt", {"exec_id": exec_id}).json() == {"interrupted": True}
    answer = running.result(timeout=60)
    assert statuses(answer) == {"c0": "ran", "c1": "failed", "c2": "not_run"}
    assert cell(answer, "c1")["error"]["ename"] == "KeyboardInterrupt"
    assert server.post("/interrupt", {"exec_id": exec_id}).json() == {"interrupted": False}
    assert statuses(server.get("/notebooks/interrupt").json()) == statuses(answer)


def test_bad_input_is_refused_with_400(server):
    good = [{"id": "a", "source": "1"}]
    for body, words in [
            ({"cells": good}, "notebook"),
            ({"notebook": "n", "cells": "x = 1"}, "cells"),
            ({"notebook": "n", "cells": [{"id": "a", "source": "1"}, {"id": "a", "source": "2"}]},
             "more than once"),
            ({"notebook": "n", "cells": [{"id": "a"}]}, "source"),
            ({"notebook": "n", "cells": [{"source": "1"}]}, "id"),
            ({"notebook": "n", "cells": [{"id": "a", "source": 5}]}, "source"),
            ({"notebook": "n", "cells": good, "order": "random"}, "order"),
            ({"notebook": "n", "cells": good, "rerun": ["zz"]}, "zz"),
            ({"notebook": "n", "cells": good, "rerun": "a"}, "rerun"),
            ({"notebook": "", "cells": good}, "notebook")]:
        r = server.post("/notebooks/run", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "BadRequest" and words in r.json()["error"]["message"]
    missing = server.get("/notebooks/n")  # none of them made a record
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotebookNotFound"


def test_notebook_records_are_listed_read_and_deleted(server):
    nb = cells("records", "print('hello')")
    run(server, "folder/records", nb)
    assert "folder/records" in server.get("/notebooks").json()["notebooks"]
    record = server.get("/notebooks/folder%2Frecords").json()
    assert record["notebook"] == "folder/records" and shown(record, "c0") == "hello"
    assert server.get("/notebooks/folder/records").json()["cells"] == record["cells"]
    assert server.delete("/notebooks/folder/records").json() == {"deleted": "folder/records"}
    for r in (server.get("/notebooks/folder/records"),
              server.delete("/notebooks/folder/records")):
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotebookNotFound", r.text
    assert "folder/records" not in server.get("/notebooks").json()["notebooks"]
    # The results stay: another notebook with the same cells reuses them.
    assert statuses(run(server, "records-2", nb)) == {"c0": "reused"}


def test_reset_forgets_results_and_records(make_server):
    srv = make_server()
    nb = cells("reset", "v = 1")
    run(srv, "reset", nb)
    assert srv.post("/reset").json() == {"status": "ok"}
    assert srv.get("/notebooks").json() == {"notebooks": []}
    assert statuses(run(srv, "reset", nb)) == {"c0": "ran"}


def test_notebook_order_follows_mutations_in_place(server):
    """A read may mutate: its reader's edit re-runs the later readers, as in Jupyter."""
    nb = cells("mutate", "xs = [1, 2]", "xs.append(3)\nlen(xs)", "n = len(xs)\nn")
    first = run(server, "mutate", nb)
    assert shown(first, "c1") == "3" and shown(first, "c2") == "3"
    nb[1]["source"] = nb[1]["source"].replace("xs.append(3)", "xs.extend([3, 4])")
    second = run(server, "mutate", nb)
    assert statuses(second) == {"c0": "reused", "c1": "ran", "c2": "ran"}
    assert shown(second, "c2") == "4"


def test_functions_read_globals_as_they_are_when_called(server):
    nb = cells("deferred", "lr = 0.1", "def step(w):\n    return w - lr", "lr = 0.5",
               "print(step(1.0))")
    first = run(server, "deferred", nb)
    assert shown(first, "c3") == "0.5"
    nb[2]["source"] = nb[2]["source"].replace("0.5", "0.25")
    second = run(server, "deferred", nb)
    assert statuses(second) == {"c0": "reused", "c1": "reused", "c2": "ran", "c3": "ran"}
    assert shown(second, "c3") == "0.75"


def test_magics_and_shell_escapes(server):
    nb = cells("magic", "%matplotlib inline\nimport os", "n = 3", "%time m = n * 2",
               "!echo shell-{n}", "print(m)")
    answer = run(server, "magic", nb)
    assert set(statuses(answer).values()) == {"ran"}, answer
    assert shown(answer, "c3") == "shell-3" and shown(answer, "c4") == "6"
    nb[1]["source"] = nb[1]["source"].replace("n = 3", "n = 4")
    again = run(server, "magic", nb)
    assert statuses(again) == {"c0": "reused", "c1": "ran", "c2": "ran", "c3": "ran",
                               "c4": "ran"}
    assert shown(again, "c4") == "8"


def test_cells_of_another_notebook_are_reused(server):
    """Results are shared by every notebook: a copy of a notebook runs nothing."""
    nb = cells("shared", "import os\npid = os.getpid()", "print(pid > 0)")
    run(server, "shared-a", nb)
    assert set(statuses(run(server, "shared-b", nb)).values()) == {"reused"}


def test_a_streamed_run_reports_each_cell_as_its_status_changes(server):
    nb = cells("streamed", "x = 1", "print(x + 1)", "1 / 0", "y = 2")
    r = server.post("/notebooks/run", {"notebook": "streamed", "cells": nb, "stream": True},
                    stream=True)
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in r.iter_lines() if line]
    seen = [(line["cell"]["id"], line["cell"]["status"]) for line in lines[:-1]]
    assert all(line["type"] == "cell" for line in lines[:-1]) and lines[-1]["type"] == "answer"
    # Each cell is reported running, then with how it ended; the run stops at c2.
    assert seen == [("c0", "running"), ("c0", "ran"), ("c1", "running"), ("c1", "ran"),
                    ("c2", "running"), ("c2", "failed"), ("c3", "not_run")]
    printed = [line["cell"] for line in lines if line.get("cell", {}).get("status") == "ran"]
    assert printed[1]["outputs"][0]["text"] == "2\n"
    answer = lines[-1]["answer"]
    assert statuses(answer) == {"c0": "ran", "c1": "ran", "c2": "failed", "c3": "not_run"}
    assert answer == server.get("/notebooks/streamed").json()
    # A bad request is refused as a whole, before any line.
    refused = server.post("/notebooks/run", {"notebook": "streamed", "stream": True,
                                             "cells": nb, "rerun": ["nope"]})
    assert refused.status_code == 400 and "'nope'" in refused.json()["error"]["message"]


def test_allow_errors_goes_on_from_what_the_failing_cell_did(server):
    nb = cells("allow-errors", "x = 1\n1 / 0\nnever = 1", "y = x + 1", "print(y)")
    answer = run(server, "allow-errors", nb, allow_errors=True)
    assert statuses(answer) == {"c0": "failed", "c1": "ran", "c2": "ran"}
    assert cell(answer, "c0")["error"]["ename"] == "ZeroDivisionError"
    assert shown(answer, "c2") == "2"
    # The failed cell's state holds what it did before it raised; /execute goes on from it.
    failed_state = cell(answer, "c0")["state_name"]
    assert server.value(failed_state, "x") == "1"
    assert server.value(failed_state, "'never' in globals()") == "False"
    # A result like any other: the next run reuses it with its error, and the cells after.
    again = run(server, "allow-errors", nb, allow_errors=True)
    assert statuses(again) == {"c0": "reused", "c1": "reused", "c2": "reused"}
    assert cell(again, "c0")["error"]["ename"] == "ZeroDivisionError"
    # Without allow_errors the run stops there, as before.
    strict = run(server, "allow-errors", nb)
    assert statuses(strict) == {"c0": "failed", "c1": "not_run", "c2": "not_run"}


@pytest.mark.parametrize("order", ["notebook", "dataflow"])
def test_a_cell_tagged_raises_exception_may_fail(server, order):
    nb = cells(f"raises-{order}", "a = 1", "b = a + 1\nNone + 1", "c = b * 10", "d = 4")
    nb[1]["tags"] = ["raises-exception"]
    nb[3]["tags"] = ["raises-exception"]  # raises nothing: reported
    answer = run(server, f"raises-{order}", nb, order=order)
    assert statuses(answer) == {"c0": "ran", "c1": "failed_as_expected", "c2": "ran",
                                "c3": "ran"}
    assert cell(answer, "c1")["error"]["ename"] == "TypeError"
    assert server.value(cell(answer, "c2")["state_name"], "c") == "20"
    assert [d["kind"] for d in answer["diagnostics"]] == ["no_error_raised"]
    assert answer["diagnostics"][0]["cells"] == ["c3"]
    # Its result is stored like any other: the next run reuses every cell.
    again = run(server, f"raises-{order}", nb, order=order)
    assert set(statuses(again).values()) == {"reused"}
    assert cell(again, "c1")["error"]["ename"] == "TypeError"


def test_fresh_runs_refuse_allow_errors(server):
    r = server.post("/notebooks/run", {"notebook": "fresh-allow", "fresh": True,
                                       "allow_errors": True,
                                       "cells": [{"id": "a", "source": "1"}]})
    assert r.status_code == 400 and "allow_errors" in r.json()["error"]["message"]
