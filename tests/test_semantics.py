"""Notebook semantics through the real server: globals, classes, aliasing, symbols."""

import nbformat
import pytest


def result_text(answer):
    """The text/plain of the cell's execute_result."""
    results = [o for o in answer["output"] if o["output_type"] == "execute_result"]
    assert len(results) == 1, answer["output"]
    return results[0]["data"]["text/plain"]


def validate(outputs):
    """Every output validates as nbformat v4."""
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("", outputs=outputs)
    nb.cells.append(cell)
    nbformat.validate(nb)


def test_function_reads_globals_of_the_state_it_runs_in(server):
    server.execute("def f():\n    return x", new="sem-f")
    answer = server.execute("x = 5\nf()", state="sem-f", new="sem-f2")
    assert result_text(answer) == "5"
    answer = server.execute("x = 7\nf()", state="sem-f2")
    assert result_text(answer) == "7"


def test_method_reads_current_globals_and_isinstance_holds(server):
    server.execute("class C:\n    def m(self):\n        return scale * 2\nc = C()",
                   new="sem-c")
    answer = server.execute("scale = 21\n(isinstance(c, C), type(c) is C, c.m())",
                            state="sem-c", new="sem-c2")
    assert result_text(answer) == "(True, True, 42)"


def test_aliasing_within_a_state_and_independence_of_states(server):
    server.execute("a = [1, 2]\nb = a", new="sem-al")
    server.execute("b.append(3)", state="sem-al", new="sem-al2")
    assert server.value("sem-al2", "a, a is b") == "([1, 2, 3], True)"
    # The input state is untouched by the cell that mutated its list.
    assert server.value("sem-al", "a") == "[1, 2]"
    server.execute("a.append(99)", state="sem-al", new="sem-al3")
    assert server.value("sem-al2", "a") == "[1, 2, 3]"
    assert server.value("sem-al3", "b") == "[1, 2, 99]"


def test_failing_cell_stores_no_state_and_leaves_input_untouched(server):
    server.execute("data = [1]", new="sem-fail")
    before = server.get("/states").json()["states"]
    answer = server.execute("data.append(2)\nraise ValueError('boom')", state="sem-fail",
                            new="sem-fail2", ok=False)
    assert answer["state_name"] is None
    assert answer["error"]["ename"] == "ValueError"
    assert answer["error"]["evalue"] == "boom"
    assert isinstance(answer["error"]["traceback"], list)
    assert server.get("/states").json()["states"] == before
    assert server.value("sem-fail", "data") == "[1]"


def test_symbol_lists(server):
    server.execute("x = 1\ny = 2\nz = 3\nunused = 4\ndef g():\n    return z", new="sem-sym")
    answer = server.execute("x = y + 1\ndel unused\nnew = g()", state="sem-sym")
    assert answer["accessed_symbols"] == ["g", "y", "z"]
    assert answer["modified_symbols"] == ["new", "x"]
    assert answer["deleted_symbols"] == ["unused"]


def test_dynamic_reads_report_every_name(server):
    server.execute("p = 1\nq = 2", new="sem-dyn")
    answer = server.execute("r = eval('p')", state="sem-dyn")
    assert answer["accessed_symbols"] == ["p", "q"]


def test_reads_through_nested_code_and_comprehensions(server):
    server.execute("k = 3\nitems = [1, 2]\nclass K:\n    pass", new="sem-nest")
    answer = server.execute("s = [i * k for i in items]\nclass L(K):\n    v = k",
                            state="sem-nest")
    assert set(answer["accessed_symbols"]) == {"K", "items", "k"}


def test_execution_count_counts_up_a_lineage(server):
    first = server.execute("n = 0", new="sem-n1")
    second = server.execute("n += 1\nn", state="sem-n1", new="sem-n2")
    third = server.execute("n", state="sem-n2")
    assert (first["execution_count"], second["execution_count"],
            third["execution_count"]) == (1, 2, 3)
    results = [o for o in third["output"] if o["output_type"] == "execute_result"]
    assert results[0]["execution_count"] == 3
    # A sibling run from the same state gets the same count as its sibling.
    assert server.execute("n", state="sem-n1")["execution_count"] == 2


def test_last_expression_and_semicolon(server):
    answer = server.execute("1 + 1")
    assert result_text(answer) == "2"
    validate(answer["output"])
    answer = server.execute("1 + 1;")
    assert not [o for o in answer["output"] if o["output_type"] == "execute_result"]
    answer = server.execute("None")
    assert answer["output"] == []


def test_display_works_and_is_not_stored(server):
    answer = server.execute("display('shown')\nimport builtins\nv = 1", new="sem-disp")
    validate(answer["output"])
    assert answer["output"][0]["output_type"] == "display_data"
    assert answer["output"][0]["data"]["text/plain"] == "'shown'"
    state = server.get("/states/sem-disp").json()
    assert "display" not in state["variables"]
    assert server.value("sem-disp", "sorted(k for k in globals() if not k.startswith('__'))") \
        == "['builtins', 'v']"


def test_user_can_shadow_display(server):
    answer = server.execute("def display(x):\n    return 'mine'\ndisplay(1)")
    assert result_text(answer) == "'mine'"


def test_name_is_main_and_pickle_finds_main_names(server):
    server.execute("import pickle\nclass P:\n    pass\nok = __name__ == '__main__'",
                   new="sem-main")
    assert server.value("sem-main", "ok, type(pickle.loads(pickle.dumps(P()))) is P") \
        == "(True, True)"


def test_numpy_view_stays_a_view(server):
    server.execute("import numpy as np\na = np.arange(6)\nb = a[:2]", new="sem-np")
    server.execute("b[0] = 99", state="sem-np", new="sem-np2")
    assert server.value("sem-np2", "int(a[0]), b.base is a") == "(99, True)"
    assert server.value("sem-np", "int(a[0])") == "0"
    groups = server.post("/alias_groups", {"state_name": "sem-np"}).json()["groups"]
    assert ["a", "b"] in groups


def test_symbol_hashes_equal_for_equal_values(server):
    server.execute("u = [1, 2, 3]\nv = [1, 2, 3]\nw = [4]", new="sem-h")
    hashes = server.post("/symbol_hashes", {"state_name": "sem-h",
                                            "symbols": ["u", "v", "w", "nope"]}).json()
    h = hashes["hashes"]
    assert h["u"] == h["v"] != h["w"]
    assert h["nope"] is None
    server.execute("u = [1, 2, 3]\nv = [1, 2, 3]\nw = [4]", new="sem-h2")
    again = server.post("/symbol_hashes", {"state_name": "sem-h2",
                                           "symbols": ["u", "v", "w"]}).json()["hashes"]
    assert again == {k: h[k] for k in "uvw"}


def test_class_fingerprints_stable_across_reruns(server):
    code = "class Q:\n    def __init__(self):\n        self.v = 1\nq = Q()"
    server.execute(code, new="sem-q1")
    server.execute(code, new="sem-q2")
    one = server.post("/alias_groups", {"state_name": "sem-q1"}).json()
    two = server.post("/alias_groups", {"state_name": "sem-q2"}).json()
    assert one == two


@pytest.mark.parametrize("suffix", ["", "\n"])
def test_rebinding_a_name_replaces_its_state(server, suffix):
    server.execute("r = 1" + suffix, new="sem-rebind")
    server.execute("r = 2" + suffix, new="sem-rebind")
    assert server.value("sem-rebind", "r") == "2"
    assert server.get("/states").json()["states"].count("sem-rebind") == 1


def test_multistate_execute(server):
    server.execute("m = 10", new="sem-ms1")
    server.execute("m = 20\ndef twice(v):\n    return 2 * v", new="sem-ms2")
    r = server.post("/multistate_execute", {
        "code": "m + one.m + two.twice(two.m)", "exec_id": "ms1",
        "state_mapping": {"one": "sem-ms1", "two": "sem-ms2"},
        "default_state": "sem-ms2"}).json()
    assert r["error"] is None and r["state_name"] is None
    assert result_text(r) == "70"
    assert r["accessed_symbols"] == ["m", "one", "two"]
    assert set(r) >= {"output", "state_name", "error", "accessed_symbols",
                      "modified_symbols", "deleted_symbols"}
    r = server.post("/multistate_execute", {"code": "1", "exec_id": "ms2",
                                            "state_mapping": {"a": "no-such"}}).json()
    assert r["error"]["ename"] == "StateNotFound"


@pytest.mark.parametrize("restarted", [False, True], ids=["live", "restored"])
def test_a_cell_reports_the_same_symbols_through_execute_and_multistate(make_server,
                                                                        tmp_path, restarted):
    """One symbol diff for both routes: a name the cell assigns is modified even when it
    is bound to the same object again (a list's `+=`), a name it deletes is deleted,
    one it never touches is neither, also from a state restored lazily (the names the
    cell does not touch are not loaded when it runs)."""
    srv = make_server(tmp_path / "store")
    srv.execute("xs = [1, 2]\ngone = 1\nuntouched = {'k': 1}\nbig = list(range(10))",
                new="sem-diff")
    if restarted:
        srv.stop()
        srv = make_server(tmp_path / "store")
    code = "xs += [3]\ndel gone\nmade = len(xs)"
    one = srv.execute(code, state="sem-diff")
    many = srv.post("/multistate_execute", {"code": code, "exec_id": "sem-diff-ms",
                                            "state_mapping": {},
                                            "default_state": "sem-diff"}).json()
    assert many["error"] is None, many["error"]
    symbols = [(a["accessed_symbols"], a["modified_symbols"], a["deleted_symbols"])
               for a in (one, many)]
    assert symbols == [(["xs"], ["made", "xs"], ["gone"])] * 2


def test_rebuild_state(server):
    server.execute("a = [1]\nb = a\nc = 3\nd = 4", new="sem-in")
    server.execute("c = 30\nd = 40\ne = [5]", new="sem-src")
    r = server.post("/rebuild_state", {"input_state": "sem-in", "source_state": "sem-src",
                                       "source_vars": ["c", "e"], "input_vars": ["a", "b", "d"],
                                       "new_state_name": "sem-rb"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["state_name"] == "sem-rb"
    assert sorted(sum(body["groups"], [])) == ["a", "b", "c", "d", "e"]
    assert ["a", "b"] in body["groups"]
    assert len(body["fingerprints"]) == len(body["groups"])
    assert server.value("sem-rb", "a is b, c, d, e") == "(True, 30, 4, [5])"
    # Rebuilding in place (new name == source) rebinds the name.
    r = server.post("/rebuild_state", {"input_state": "sem-in", "source_state": "sem-rb",
                                       "source_vars": ["e"], "input_vars": ["c"],
                                       "new_state_name": "sem-rb"})
    assert r.status_code == 200, r.text
    assert server.value("sem-rb", "sorted(k for k in globals() if k[0] != '_'), e, c") \
        == "(['c', 'e'], [5], 3)"
