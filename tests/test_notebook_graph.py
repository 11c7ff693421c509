"""The notebook analysis, graph, keys and planner on their own (no server, no execution)."""

import pytest

from snapkernel.kernel.notebook import analysis, graph, keys, planner


def names(source):
    """The analysis of `source` as plain sorted lists (only the non-empty fields)."""
    a = analysis.analyse(source)
    return {k: sorted(v) if isinstance(v, frozenset) else v
            for k, v in vars(a).items() if v}


@pytest.mark.parametrize("source, defines, free_reads", [
    ("x = 1", ["x"], []),
    ("a, (b, *c) = t", ["a", "b", "c"], ["t"]),
    ("x += 1", ["x"], ["x"]),
    ("def f(a, *b, c=d, **e):\n    return a + g", ["f"], ["d", "g"]),
    ("class C(B):\n    k = v\n    def m(self):\n        return w", ["C"], ["B", "v", "w"]),
    ("import a.b.c, d as e\nfrom f import g as h, i", ["a", "e", "h", "i"], []),
    ("for i, j in pairs:\n    pass", ["i", "j"], ["i", "j", "pairs"]),
    ("with open(p) as fh, lock:\n    pass", ["fh"], ["fh", "lock", "p"]),
    ("try:\n    pass\nexcept E as err:\n    pass", ["err"], ["E", "err"]),
    ("if (n := 10) > 5:\n    pass", ["n"], ["n"]),
    ("match p:\n    case Pt(x=px):\n        pass\n    case [q, *_r]:\n        pass\n"
     "    case {'k': v, **kw}:\n        pass", ["_r", "kw", "px", "q", "v"],
     ["Pt", "_r", "kw", "p", "px", "q", "v"]),
    ("def f():\n    global g\n    g = 1", ["f", "g"], []),
    ("[y for y in xs if y > t]", [], ["t", "xs"]),
    ("lambda q: q + z", [], ["z"]),
    ("df = load()\ndf = df.dropna()", ["df"], ["load"]),
    ("del q", [], ["q"]),
    ("print(len(s))", [], ["s"]),
])
def test_definitions_and_free_reads(source, defines, free_reads):
    a = analysis.analyse(source)
    assert sorted(a.defines) == defines
    assert sorted(a.free_reads) == free_reads
    assert not a.dynamic


def test_scopes_are_resolved():
    a = analysis.analyse("def outer():\n    k = 1\n    def inner():\n        nonlocal k\n"
                         "        return k + far\n    return inner\n")
    assert sorted(a.free_reads) == ["far"] and sorted(a.deferred_reads) == ["far"]
    a = analysis.analyse("class C:\n    y = 1\n    def m(self):\n        return y\n")
    assert "y" in a.free_reads  # class bodies do not enclose their methods
    a = analysis.analyse("def f():\n    global counter\n    counter += 1\n")
    assert a.deferred_writes == {"counter"} and a.deferred_reads == {"counter"}
    a = analysis.analyse("gen = (x * k for x in xs)")
    assert a.free_reads == {"k", "xs"} and a.deferred_reads == {"k"}


def test_deletions_and_imports():
    a = analysis.analyse("import numpy as np, os.path\nfrom . import rel\ndel old")
    assert a.imports == {"numpy", "os.path", "."}
    assert a.deletes == {"old"}
    assert keys.imports_third_party(a)
    assert not keys.imports_third_party(analysis.analyse("import json, os.path"))


@pytest.mark.parametrize("source, writes", [
    ("eval(text)", True), ("exec(code)", True), ("globals()['x'] = 1", True),
    ("vars()", True), ("from math import *", True), ("sys.modules['__main__']", True),
    ("df.query('a > @b')", False), ("%who", True), ("!ls {path}", False),
])
def test_unknown_reads_make_a_cell_dynamic(source, writes):
    a = analysis.analyse(source)
    assert a.dynamic and a.unknown_writes == writes


def test_magics_with_a_known_effect():
    assert names("%matplotlib inline") == {}
    a = analysis.analyse("%time r = f(s)")
    assert a.defines == {"r"} and {"f", "s"} <= a.free_reads and not a.dynamic
    a = analysis.analyse("%%capture out\nprint(v)")
    assert a.defines == {"out"} and a.free_reads == {"v"}
    a = analysis.analyse("files = !ls")
    assert a.defines == {"files"} and not a.dynamic
    a = analysis.analyse("%%bash\necho $HOME")
    assert not a.dynamic and not a.defines


def test_a_syntax_error_has_line_and_column_and_probable_definitions():
    a = analysis.analyse("ok = 1\ndf2 = df.dropna(\n")
    assert a.error["line"] == 2 and a.error["column"] == 16
    assert "never closed" in a.error["message"]
    assert a.probable_defines == {"ok", "df2"}
    assert analysis.analyse("return 1").error["message"].endswith("outside function")


def build(order, *sources):
    """The graph of cells c0, c1, ... with these sources."""
    return graph.build([f"c{n}" for n in range(len(sources))],
                       [analysis.analyse(s) for s in sources], order)


def test_notebook_order_inputs_include_readers_since_the_last_definition():
    g = build("notebook", "x = []", "x.append(1)", "y = 2", "print(x, y)", "x = 0", "x")
    assert g.inputs[3] == {0, 1, 2} and g.needs[3] == {"x": 1, "y": 2}
    assert g.inputs[5] == {4} and g.needs[5] == {"x": 4}
    assert g.order == [0, 1, 2, 3, 4, 5]


def test_a_function_needs_what_its_body_reads_when_called():
    g = build("notebook", "lr = 0.1", "def f(w):\n    return w - lr", "lr = 0.5", "f(1)")
    assert g.needs[3] == {"f": 1, "lr": 2} and g.inputs[3] == {1, 2}


def test_unknown_reads_depend_on_every_earlier_cell():
    g = build("notebook", "a = 1", "b = 2", "print(eval('a + b'))", "c = b")
    assert g.inputs[2] == {0, 1}
    # eval may have rebound anything: later readers depend on it too.
    assert g.inputs[3] == {1, 2}
    g = build("notebook", "a = 1", "exec('b = 2')", "a.bit_length()", "print(a)")
    assert g.needs[3]["a"] == 2 and g.inputs[3] == {0, 1, 2}


def test_dataflow_order_is_topological_with_ties_by_position():
    g = build("dataflow", "c = a + b", "b = 2", "a = 1", "d = 4", "e = c + d")
    assert g.order == [1, 2, 0, 3, 4]
    assert g.needs[4] == {"c": 0, "d": 3}
    assert not g.diagnostics and not g.blocked


def test_dataflow_static_errors():
    g = build("dataflow", "p = q", "q = p", "x = 1", "x = 2", "y = 1", "del y", "z = x")
    kinds = {d["kind"]: (d["cells"], d["names"]) for d in g.diagnostics}
    assert kinds == {"cycle": (["c0", "c1"], ["p", "q"]),
                     "double_definition": (["c2", "c3"], ["x"]),
                     "foreign_assignment": (["c4", "c5"], ["y"])}
    assert set(g.blocked) == {0, 1, 2, 3, 4, 5, 6}
    assert g.blocked[6]["ename"] == "Blocked"


def test_syntax_errors_block_their_dependents_in_both_orders():
    for order in graph.ORDERS:
        g = build(order, "a = 1", "b = a +", "c = b", "d = a")
        assert set(g.blocked) == {1, 2}, order
        assert g.blocked[1]["ename"] == "SyntaxError"
        assert g.diagnostics[0]["kind"] == "syntax_error"


class FixedEnvironment:
    """An Environment whose digest the test sets."""

    def __init__(self, digest):
        """Start with `digest`."""
        self.value = digest

    def digest(self):
        """The digest set by the test."""
        return self.value


def keyed(order, sources, env):
    """(graph, keys) of cells with these sources."""
    g = build(order, *sources)
    return g, planner.cell_keys(g, sources, [analysis.analyse(s) for s in sources], env)


def test_keys_ignore_position_and_follow_inputs_and_environment():
    env = FixedEnvironment("one")
    _, k1 = keyed("dataflow", ["a = 1", "b = a + 1", "import numpy\nn = 1"], env)
    _, k2 = keyed("dataflow", ["b = a + 1", "import numpy\nn = 1", "a = 1"], env)
    assert [k1[0], k1[1], k1[2]] == [k2[2], k2[0], k2[1]]
    _, k3 = keyed("dataflow", ["a = 2", "b = a + 1", "import numpy\nn = 1"], env)
    assert k3[0] != k1[0] and k3[1] != k1[1] and k3[2] == k1[2]
    env.value = "two"
    _, k4 = keyed("dataflow", ["a = 1", "b = a + 1", "import numpy\nn = 1"], env)
    assert k4[0] == k1[0] and k4[1] == k1[1] and k4[2] != k1[2]
    # The same cell and input keys mean something else in the other order.
    _, n1 = keyed("notebook", ["xs = []", "xs.append(1)\nys = 2", "print(xs, ys)"], env)
    _, d1 = keyed("dataflow", ["xs = []", "xs.append(1)\nys = 2", "print(xs, ys)"], env)
    assert n1[0] == d1[0] and n1[2] != d1[2]


def test_plan_runs_changed_cells_their_dependents_and_volatile_makers():
    env = FixedEnvironment("e")
    sources = ["g = iter(range(9))", "a = 1", "b = a + 1", "v = next(g)", "w = v + b"]
    g, k = keyed("notebook", sources, env)
    stored = {key: set() for key in k.values()}
    stored[k[0]] = {"g"}
    stored[k[3]] = {"g"}
    assert planner.plan(g, k, stored).run == set()
    del stored[k[2]]
    p = planner.plan(g, k, stored)
    assert p.run == {2, 4} and p.sequence == [0, 1, 2, 3, 4]
    p = planner.plan(g, k, stored, rerun=[3])
    # v = next(g) must run: g is volatile, so its maker runs again just before it.
    assert p.run == {0, 2, 3, 4} and p.for_volatile == {0: 3}
    assert p.sequence == [1, 2, 0, 3, 4]


def test_compose_picks_the_best_base_and_takes_the_rest():
    required = {"a": "k1", "c": "k3", "b": "k2", "gone": None}
    sources = {"a": "s1", "c": "s1", "b": "s2"}
    candidates = [("s1", {"a": "k1", "c": "k3", "b": "old", "gone": "k0"}),
                  ("s2", {"b": "k2"})]
    base, takes, drops = planner.compose(required, sources, candidates)
    assert base == "s1" and takes == [("s2", ["b"])] and drops == ["gone"]
    base, takes, drops = planner.compose(required, sources, candidates, volatile={"b"})
    assert base == "s2" and takes == [("s1", ["a", "c"])] and drops == []
    base, takes, drops = planner.compose({"a": "k1"}, sources, candidates, exact=True)
    assert base == "s1" and takes == [] and drops == ["b", "c", "gone"]
    # An unknown origin never matches, except in the source state itself.
    base, takes, _ = planner.compose({"a": planner.UNKNOWN}, {"a": "s2"},
                                     [("s1", {"a": planner.UNKNOWN}), ("s2", {})])
    assert base == "s2" and takes == []


def test_environment_digest_follows_installs(tmp_path):
    site = tmp_path / "site"
    (site / "pkg-1.0.dist-info").mkdir(parents=True)
    (site / "pkg-1.0.dist-info" / "METADATA").write_text("Name: pkg\nVersion: 1.0\n")
    env = keys.Environment([str(site)])
    first = env.digest()
    assert env.digest() == first
    (site / "pkg-1.0.dist-info").rename(site / "pkg-2.0.dist-info")
    (site / "pkg-2.0.dist-info" / "METADATA").write_text("Name: pkg\nVersion: 2.0\n")
    assert env.digest() != first
