"""Restored equals live: a state keeps the process context its cells set up
(kernel/worker/context.py), and a notebook runs where it lives.

Every test makes a state through a real server, restarts the server (so the
state is restored from the store in a new process), and asks the same
question again.
"""

import os
import subprocess
import sys
import textwrap

import nbformat
import pytest

from snapkernel.storage.store import Store
from support.server import ROOT, restarted_before_every_cell

# Sets every item a state keeps, the way a notebook would.
SETUP = textwrap.dedent("""\
    import logging, os, random, sys, warnings
    import numpy as np, pandas as pd, matplotlib.pyplot as plt
    np.random.seed(0); random.seed(0)
    pd.set_option('display.max_rows', 7); plt.style.use('ggplot')
    os.environ['MYVAR'] = 'x'; os.environ.pop('SNAPK_GONE', None)
    os.chdir({folder!r}); sys.path.append({lib!r})
    import mymod
    %config InlineBackend.figure_format = 'svg'
    warnings.simplefilter('error', DeprecationWarning)
    logging.getLogger('mine').setLevel(logging.DEBUG)
    logging.getLogger('mine').addHandler(logging.StreamHandler(sys.stdout))
    %precision 3
    %xmode Minimal
    %load_ext autoreload
    %autoreload 2
    %alias say_hello echo hello
    """)

# Reads every item back, one value each.
PROBE = textwrap.dedent("""\
    import io
    (np.random.rand(), random.random(), pd.get_option('display.max_rows'),
     plt.rcParams['axes.facecolor'], os.environ.get('MYVAR'), 'SNAPK_GONE' in os.environ,
     os.getcwd(), sys.path[-1], mymod.VALUE, warnings.filters[0][:1] + warnings.filters[0][2:3],
     logging.getLogger('mine').level, [type(h).__name__ for h in logging.getLogger('mine').handlers],
     get_ipython().display_formatter.formatters['text/plain'].float_precision,
     get_ipython().InteractiveTB.mode,
     any('autoreload' in e for e in get_ipython().extension_manager.loaded),
     get_ipython().magics_manager.registry['AutoreloadMagics']._reloader.check_all,
     get_ipython().alias_manager.is_alias('say_hello'), plt.plot([1, 2]) and None)
    """)


def probe(srv, state, exec_id):
    """The probe's answer in `state`, and the formats of the figure it drew."""
    answer = srv.post("/multistate_execute", {"code": PROBE, "exec_id": exec_id,
                                               "state_mapping": {}, "default_state": state}).json()
    assert answer["error"] is None, answer["error"]
    result = [o for o in answer["output"] if o["output_type"] == "execute_result"]
    figures = [sorted(o["data"]) for o in answer["output"] if o["output_type"] == "display_data"]
    return result[-1]["data"]["text/plain"], figures


def test_every_item_of_the_context_is_as_live_after_a_restart(make_server, tmp_path,
                                                              monkeypatch):
    monkeypatch.setenv("SNAPK_GONE", "here")  # the server's environment has it
    folder, lib = tmp_path / "work", tmp_path / "lib"
    folder.mkdir()
    lib.mkdir()
    (lib / "mymod.py").write_text("VALUE = 41\n")
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute(SETUP.format(folder=str(folder), lib=str(lib)), new="ctx")
    live = probe(srv, "ctx", "live")
    value, figures = live
    value = " ".join(value.split())  # IPython's pretty printer breaks the tuple's lines
    assert value == (f"(0.549, 0.844, 7, '#E5E5E5', 'x', False, '{folder}', '{lib}', 41, "
                     f"('error', DeprecationWarning), 10, ['StreamHandler'], '3', 'Minimal', "
                     f"True, True, True, None)")
    assert figures == [["image/svg+xml", "text/plain"]]
    srv.stop()
    srv = make_server(data)
    assert probe(srv, "ctx", "restored") == live
    # Twice: a second cell from the restored state (another forked process) too.
    assert probe(srv, "ctx", "again") == live
    described = srv.get("/states/ctx").json()
    assert described["cwd"] == str(folder)
    assert {"random", "numpy.random", "pandas.options", "matplotlib.rcParams", "environ",
            "cwd", "sys.path", "warnings", "logging", "ipython",
            "local_modules"} <= set(described["context"])
    assert described["local_modules"]["mymod"]["path"] == str(lib / "mymod.py")
    assert described["local_modules"]["mymod"]["changed"] is False


def test_the_random_generator_is_the_states_in_every_forked_process(server):
    server.execute("import random\nrandom.seed(0)", new="seeded")
    draws = {server.value("seeded", "random.random()") for _ in range(3)}
    assert draws == {"0.8444218515250481"}


def test_torch_global_generator_survives_a_restart(make_server, tmp_path):
    pytest.importorskip("torch", reason="torch is installed by .ci/run")
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("import torch\ntorch.manual_seed(0)", new="t")
    live = srv.value("t", "torch.rand(3).tolist()")
    srv.stop()
    srv = make_server(data)
    assert srv.value("t", "torch.rand(3).tolist()") == live


def test_a_state_with_a_module_of_its_own_restores_and_says_when_the_file_changed(
        make_server, tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "helpers.py").write_text("def twice(x):\n    return 2 * x\n")
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute(f"import sys\nsys.path.append({str(lib)!r})\nimport helpers\n"
                f"from helpers import twice", new="h")
    srv.stop()
    srv = make_server(data)
    answer = srv.execute("y = helpers.twice(2) + twice(3)", state="h", new="h2")
    assert srv.value("h2", "y") == "10" and not answer["output"]
    (lib / "helpers.py").write_text("def twice(x):\n    return 20 * x\n")
    srv.stop()
    srv = make_server(data)
    answer = srv.execute("z = helpers.twice(1)", state="h", new="h3")
    note = answer["output"][0]
    assert note["name"] == "stderr" and "helpers" in note["text"] and "changed" in note["text"]
    assert srv.value("h3", "z") == "20"
    assert srv.get("/states/h").json()["local_modules"]["helpers"]["changed"] is True
    # The state made from it records the file as it is now.
    assert srv.get("/states/h3").json()["local_modules"]["helpers"]["changed"] is False


def test_execute_from_initial_takes_the_notebooks_folder(server, tmp_path):
    (tmp_path / "helpers.py").write_text("WHERE = 'beside the notebook'\n")
    (tmp_path / "data.txt").write_text("relative paths open")
    answer = server.execute("import helpers, os\nw = helpers.WHERE\n"
                            "t = open('data.txt').read()", new="home-a",
                            extra={"cwd": str(tmp_path)})
    assert answer["error"] is None
    assert server.value("home-a", "[w, t, os.getcwd() == {!r}]".format(str(tmp_path))) == \
        "['beside the notebook', 'relative paths open', True]"
    # Inherited by the states made from it, and shown.
    server.execute("x = 1", state="home-a", new="home-b")
    assert server.get("/states/home-b").json()["cwd"] == str(tmp_path)
    for bad in ("relative/folder", str(tmp_path / "missing")):
        r = server.post("/execute", {"code": "1", "exec_id": "bad-cwd", "state_name": "initial",
                                     "cwd": bad})
        assert r.status_code == 400 and "cwd" in r.json()["error"]["message"], r.text


def notebook(path, *sources):
    """Write a notebook of code cells c0, c1, ... with these sources."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src, id=f"c{n}") for n, src in enumerate(sources)]
    nbformat.write(nb, str(path))
    return path


def outputs(path):
    """The text each code cell of a notebook file shows."""
    nb = nbformat.read(str(path), as_version=4)
    return ["".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                    for o in c.outputs) for c in nb.cells]


def test_a_notebook_runs_in_its_folder_through_the_command_and_the_route(make_server,
                                                                         tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "helpers.py").write_text("def greet():\n    return 'hello'\n")
    (folder / "data.csv").write_text("a\n1\n2\n")
    nb = notebook(folder / "nb.ipynb", "import helpers\nhelpers.greet()",
                  "import pandas as pd\nint(pd.read_csv('data.csv').a.sum())",
                  "import os\nos.getcwd() == os.path.dirname(os.path.abspath('nb.ipynb'))")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "run", str(nb),
                           "--data-dir", str(tmp_path / "store")], cwd=elsewhere,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert outputs(nb) == ["'hello'", "3", "True"]
    srv = make_server(tmp_path / "served")
    cells = [{"id": f"c{n}", "source": c.source}
             for n, c in enumerate(nbformat.read(str(nb), as_version=4).cells)]
    answer = srv.post("/notebooks/run", {"notebook": "nb", "cells": cells,
                                         "cwd": str(folder)}).json()
    assert [c["status"] for c in answer["cells"]] == ["ran"] * 3, answer
    assert [c["outputs"][0]["data"]["text/plain"] for c in answer["cells"]] == [
        "'hello'", "3", "True"]


def test_a_seed_reused_from_another_notebook_gives_the_numbers_of_a_clean_run(
        make_server, tmp_path):
    srv = make_server(tmp_path / "store")
    seed = "import numpy as np, random\nnp.random.seed(1)\nrandom.seed(1)"
    draw = "(np.random.rand(), random.random())"
    first = srv.post("/notebooks/run", {"notebook": "one", "cells": [
        {"id": "s", "source": seed}, {"id": "x", "source": "x = 1"}]}).json()
    assert [c["status"] for c in first["cells"]] == ["ran", "ran"]
    srv.stop()
    srv = make_server(tmp_path / "store")
    second = srv.post("/notebooks/run", {"notebook": "two", "cells": [
        {"id": "s", "source": seed}, {"id": "d", "source": draw}]}).json()
    assert [c["status"] for c in second["cells"]] == ["reused", "ran"]
    clean = srv.post("/multistate_execute", {"code": f"{seed}\n{draw}", "exec_id": "clean",
                                             "state_mapping": {}}).json()
    assert second["cells"][1]["outputs"] == [
        dict(clean["output"][-1], execution_count=second["cells"][1]["execution_count"])]


def test_an_edit_of_a_helper_module_runs_its_importers_and_their_dependents_only(server,
                                                                                tmp_path):
    (tmp_path / "helpers.py").write_text("def value():\n    return 1\n")
    cells = [{"id": "c0", "source": "x = 10  # helper-edit"},
             {"id": "c1", "source": "import helpers\nv = helpers.value()  # helper-edit"},
             {"id": "c2", "source": "w = v * 2  # helper-edit"},
             {"id": "c3", "source": "y = x + 1  # helper-edit"},
             {"id": "c4", "source": "print(w, y)  # helper-edit"}]
    body = {"notebook": "helper-edit", "cells": cells, "cwd": str(tmp_path)}

    def run():
        answer = server.post("/notebooks/run", body).json()
        return {c["id"]: c["status"] for c in answer["cells"]}, answer

    assert run()[0] == dict.fromkeys(["c0", "c1", "c2", "c3", "c4"], "ran")
    assert run()[0] == dict.fromkeys(["c0", "c1", "c2", "c3", "c4"], "reused")
    (tmp_path / "helpers.py").write_text("def value():\n    return 5\n")
    statuses, answer = run()
    assert statuses == {"c0": "reused", "c1": "ran", "c2": "ran", "c3": "reused",
                        "c4": "ran"}
    assert answer["cells"][4]["outputs"][0]["text"] == "10 11\n"


def test_attributes_set_on_modules_are_kept_or_named(make_server, tmp_path):
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute(textwrap.dedent("""\
        import json
        import pandas as pd
        scale = 3
        def tripled(self):
            return self * scale
        pd.DataFrame.tripled = tripled
        json.MY_CONST = 42
        json.NUMBERS = (i for i in range(3))
        """), new="patched")
    probe = "(int(pd.DataFrame({'a': [2]}).tripled().a[0]), json.MY_CONST)"
    live = srv.value("patched", probe)
    assert live == "(6, 42)"
    srv.stop()
    srv = make_server(data)
    assert srv.value("patched", probe) == live
    assert srv.get("/states/patched").json()["unkept"] == ["json.NUMBERS"]


def test_a_submodule_another_import_brought_is_there_after_a_restart(make_server, tmp_path):
    """`xml.dom` is an attribute of `xml` because importing xml.dom.minidom put it
    there: a cell that reads only `xml` finds it after a restore too (the statsmodels
    tutorials' `graphics.gofplots` after `import statsmodels.api as sm`)."""
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("import xml\nimport xml.dom.minidom as md", new="imported")
    probe = "xml.dom.minidom.parseString('<a/>').documentElement.tagName"
    assert srv.value("imported", probe) == "'a'"
    srv.stop()
    srv = make_server(data)
    assert srv.execute(probe, state="imported")["output"][0]["data"]["text/plain"] == "'a'"


def test_a_library_setting_outlives_a_restored_cell_that_does_not_import_the_library(
        make_server, tmp_path):
    """A restored process applies a library's kept settings as the library is imported;
    a cell that never imports it must still hand them on to its state (statsmodels'
    glm: `plt.rc("figure", figsize=(16, 8))`, then cells without matplotlib, then 640x480)."""
    answers = restarted_before_every_cell(make_server, tmp_path / "store", [
        "import matplotlib.pyplot as plt, numpy as np\n"
        "plt.rc('figure', figsize=(16, 8))\nnp.random.seed(3)",
        "x = 1",
        "print(tuple(plt.rcParams['figure.figsize']), np.random.randint(1000))",
    ])
    assert answers[-1]["output"][0]["text"] == "(16.0, 8.0) 874\n"


def test_a_cell_importing_a_package_finds_the_submodules_the_session_imported(
        make_server, tmp_path):
    """`from statsmodels import graphics; graphics.gofplots` works in Jupyter because
    `import statsmodels.api as sm` imported gofplots; after a restore, a cell that imports
    the package but reads no module variable of it finds them too."""
    answers = restarted_before_every_cell(make_server, tmp_path / "store", [
        "import xml.dom.minidom as md",
        "from xml import dom\ndom.minidom.parseString('<a/>').documentElement.tagName",
    ])
    assert answers[-1]["output"][0]["data"]["text/plain"] == "'a'"


def test_a_librarys_own_objects_held_by_name_are_the_librarys_after_a_restart(
        make_server, tmp_path):
    """`from pylab import *` puts matplotlib's `rcParams` in the namespace, `from sympy
    import *` sympy's domains (`RR`) and its `cacheit` (a function pickle cannot find
    by its name: dill tried for seconds, then left it volatile): stored as the
    library's attributes, they are the process's objects again after a restore
    (copies did not load: rcParams' backend sentinel, RR's mpmath context). An open
    figure of another backend, then `%matplotlib inline`, as in a tutorial that
    switches backends."""
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("import sympy, matplotlib\nfrom sympy import *\n"
                "from matplotlib.pylab import rcParams\nmatplotlib.use('svg')\n"
                "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\n"
                "line = ax.plot([1, 2])", new="held")
    probe = ("%matplotlib inline\n"
             "(rcParams is matplotlib.rcParams, RR is sympy.RR, cacheit is sympy.cacheit,"
             " RR(1) + 1, len(fig.axes))")
    live = srv.execute(probe, state="held")
    # The same function under a name of the user's, imported from its module; and only
    # inside a value of the user's.
    srv.execute("from sympy.core.cache import cacheit as memo", new="memo")
    srv.execute("import sympy.core.cache\nhandlers = {'cache': sympy.core.cache.cacheit}",
                new="nested")
    srv.stop()
    store = Store(str(data))
    try:  # every value stored, by the C pickler: none fell to dill, none left volatile
        for state in ("held", "memo", "nested"):
            manifest = store.manifest(state)
            assert {g["pickler"] for g in manifest["groups"]} == {"c"}, state
            assert manifest["volatile"] == {}, state
    finally:
        store.close()
    srv = make_server(data)
    restored = srv.execute(probe, state="held")
    assert restored["error"] is None, restored["error"]
    result = [o["data"]["text/plain"] for o in restored["output"]
              if o["output_type"] == "execute_result"]
    assert result == ["(True, True, True, mpf('2.0'), 1)"]
    assert [o["output_type"] for o in restored["output"]] == [
        o["output_type"] for o in live["output"]]
    for state, held in (("memo", "memo"), ("nested", "handlers['cache']")):
        answer = srv.execute(f"import sympy.core.cache\n{held} is sympy.core.cache.cacheit",
                             state=state)
        assert answer["output"][-1]["data"]["text/plain"] == "True", (state, answer)


def test_a_backend_the_notebook_chose_is_kept_after_a_restart(make_server, tmp_path):
    """After `matplotlib.use('svg')` a figure is not shown, as in Jupyter; a restored
    state keeps that choice until `%matplotlib inline` (scientific-python-lectures'
    Lecture-4)."""
    figure = "fig, ax = plt.subplots()\nax.plot([1, 2])\nplt.savefig('plot.svg')"
    answers = restarted_before_every_cell(make_server, tmp_path / "store", [
        f"import os, matplotlib\nos.chdir({str(tmp_path)!r})\nmatplotlib.use('svg')\n"
        "import matplotlib.pyplot as plt",
        figure, "%matplotlib inline", figure])
    assert [a["error"] for a in answers] == [None] * 4
    assert answers[1]["output"] == []
    # The figure this cell made is shown (the svg one of cell 1, loaded with `fig`, is
    # shown beside it: docs/fidelity.md).
    assert "display_data" in [o["output_type"] for o in answers[3]["output"]]
    assert (tmp_path / "plot.svg").exists()
