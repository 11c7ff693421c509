"""A reused or restored result is a clean Run All's, for every item of a state's context.

Each item of what a state holds (kernel/worker/context.py) gets a notebook
of three cells: `set` gives the item a value, `read` shows it, `change`
gives it another value (for a generator, drawing is changing). A clean
Run All (the first run, on an empty store, anchored to ipykernel by
`test_a_clean_run_here_is_jupyters`) shows the first value in `read`. Then
`read` is edited (a comment) and the notebook run again, through the
paths a user takes: the same server (whose last run ended on a live state
in which `change` ran), after a restart, with one live state at most
(holders evicted), from a copy of the notebook in another folder, through
`run --server` and serverless `run`, and cell by cell with `/execute` after
a restart. Every time `read` must show what the clean run showed.
"""

import os
import shutil
import subprocess
import sys

import nbformat
import pytest

from support.server import ROOT

# item -> (set, read, change)
ITEMS = {
    "random": ("import random\nrandom.seed(0)", "random.random()", "random.random()"),
    "numpy.random": ("import numpy as np\nnp.random.seed(0)", "np.random.rand(3)",
                     "np.random.rand(3)"),
    "pandas.options": ("import pandas as pd\npd.set_option('display.precision', 2)",
                       "pd.get_option('display.precision')",
                       "pd.set_option('display.precision', 5)"),
    "matplotlib.rcParams": ("import matplotlib.pyplot as plt\n"
                            "plt.rcParams['lines.linewidth'] = 3",
                            "plt.rcParams['lines.linewidth']",
                            "plt.rcParams['lines.linewidth'] = 7"),
    # The Handbook's 04.11: a style, then %matplotlib inline (which sets no rcParams in
    # ipykernel): classic's 80 dpi make 640x480 figures.
    "inline figures": ("import matplotlib.pyplot as plt\nplt.style.use('classic')\n"
                       "%matplotlib inline",
                       "fig = plt.figure()\nprint(fig.get_size_inches() * fig.dpi)\n"
                       "plt.close(fig)",
                       "plt.rcParams['figure.dpi'] = 50"),
    "environ": ("import os\nos.environ['SNAPK_ITEM'] = 'one'", "os.environ.get('SNAPK_ITEM')",
                "os.environ['SNAPK_ITEM'] = 'two'"),
    "cwd": ("import os\nos.makedirs('one', exist_ok=True)\nos.chdir('one')",
            "os.path.basename(os.getcwd())",
            "os.makedirs('../two', exist_ok=True)\nos.chdir('../two')"),
    "sys.path": ("import sys\nsys.path.append('/snapk/one')", "sys.path[-1]",
                 "sys.path.append('/snapk/two')"),
    "warnings": ("import warnings\nwarnings.simplefilter('error')", "warnings.filters[0][0]",
                 "warnings.simplefilter('ignore')"),
    "logging": ("import logging\nlogging.getLogger('snapk').setLevel(10)",
                "logging.getLogger('snapk').level",
                "logging.getLogger('snapk').setLevel(40)"),
    "extensions": ("%load_ext autoreload",
                   "any('autoreload' in e for e in get_ipython().extension_manager.loaded)",
                   "%unload_ext autoreload"),
    "precision": ("%precision 2", "1/3", "%precision 5"),
    "config": ("import matplotlib.pyplot as plt\n%config InlineBackend.figure_formats = ['svg']",
               "plt.plot([1, 2]);", "%config InlineBackend.figure_formats = ['png']"),
    "local modules": ("x = 1", "import sys\n'snapk_helper' in sys.modules",
                      "import snapk_helper"),
    "module attributes": ("import snapk_helper\nsnapk_helper.VALUE = 1", "snapk_helper.VALUE",
                          "snapk_helper.VALUE = 2"),
}
HELPER = "VALUE = 0\n"


def cold_server(make_server, data):
    """A server on `data` without a warm zygote: states are restored in forks of the cold
    one, which has not imported numpy, pandas or matplotlib, so a state's settings for
    them are applied as the library is imported (the first cell after a restart, before
    the warm zygote is up, takes that path)."""
    return make_server(data, config="[workers]\nwarm_zygote = false\n")


def folder_for(base, item):
    """A notebook folder for `item` under `base`, with the helper module in it."""
    folder = base / item.replace(" ", "_").replace(".", "_")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "snapk_helper.py").write_text(HELPER)
    return folder


def cells_of(item, edits=0):
    """The item's cells for POST /notebooks/run, `read` edited `edits` times."""
    sources = list(ITEMS[item])
    sources[1] += "".join(f"  # edit {n}" for n in range(edits))
    return [{"id": name, "source": source} for name, source in zip(("set", "read", "change"),
                                                                   sources)]


def shown(outputs):
    """What outputs show: their text (stream or text/plain), and the formats of a
    display (a figure's)."""
    return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") +
                   (" " + " ".join(sorted(o["data"])) if o["output_type"] == "display_data"
                    else "")
                   for o in outputs)


def run(srv, item, folder, edits=0, name=None):
    """POST /notebooks/run of the item's notebook; {cell id: (status, shown)}."""
    answer = srv.post("/notebooks/run", {"notebook": name or str(folder / "nb.ipynb"),
                                         "cells": cells_of(item, edits),
                                         "cwd": str(folder)}).json()
    assert "cells" in answer, answer
    for cell in answer["cells"]:
        assert cell["error"] is None, (item, cell)
    return {c["id"]: (c["status"], shown(c["outputs"])) for c in answer["cells"]}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """{item: what `read` shows in a clean Run All}, from a server on an empty store."""
    from support.server import Server
    base = tmp_path_factory.mktemp("clean")
    srv = Server(base / "store")
    try:
        return {item: run(srv, item, folder_for(base, item))["read"][1] for item in ITEMS}
    finally:
        srv.stop()


def test_a_clean_run_here_is_jupyters(clean, tmp_path):
    """The reference: ipykernel (nbclient) runs each item's notebook in its folder."""
    from nbclient import NotebookClient
    saved = {k: os.environ.pop(k) for k in ("MPLBACKEND", "PYTEST_CURRENT_TEST")
             if k in os.environ}
    try:
        # One kernel for all: each item's cells, in its own folder (os.chdir first), with
        # matplotlib's defaults back (an item's `change` would show in the next one's).
        nb = nbformat.v4.new_notebook()
        for item in ITEMS:
            folder = folder_for(tmp_path, item)
            nb.cells.append(nbformat.v4.new_code_cell(
                f"import os as _os, sys as _sys\n_os.chdir({str(folder)!r})\n"
                f"_sys.path.insert(0, {str(folder)!r})\n"
                f"if 'matplotlib' in _sys.modules:\n"
                f"    _sys.modules['matplotlib'].rcdefaults()"))
            nb.cells += [nbformat.v4.new_code_cell(c["source"]) for c in cells_of(item)]
        NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    finally:
        os.environ.update(saved)
    jupyter = {item: shown(nb.cells[4 * n + 2].outputs) for n, item in enumerate(ITEMS)}
    assert clean == jupyter


def test_an_edited_cell_sees_the_context_of_a_clean_run_on_every_path(clean, tmp_path,
                                                                      make_server):
    """Edit `read` and run again: on the server whose last run ended where `change` ran,
    from a copy of the notebook in another folder, after a restart, with holders
    evicted (one live state at most). {path: {item: what `read` shows}}, each equal
    to the clean run's."""
    folders = {item: folder_for(tmp_path, item) for item in ITEMS}
    copies = {item: folder_for(tmp_path / "copy", item) for item in ITEMS}
    seen = {}
    srv = make_server(tmp_path / "store")
    for item, folder in folders.items():
        assert run(srv, item, folder)["read"] == ("ran", clean[item])
    # The same server: the state each last run ended on is live, `change` ran in it.
    seen["edited"] = {item: run(srv, item, folder, edits=1) for item, folder in folders.items()}
    # A copy of the notebook in another folder is handed those results.
    seen["copy"] = {item: run(srv, item, copies[item], edits=1) for item in ITEMS}
    srv.stop()
    # Restarted: the states restored from the store.
    srv = cold_server(make_server, tmp_path / "store")
    seen["restarted"] = {item: run(srv, item, folder, edits=2)
                         for item, folder in folders.items()}
    srv.stop()
    # One live state at most: every other holder evicted as the runs go on.
    srv = make_server(tmp_path / "evicting", config="[workers]\nmax_live_states = 1\n")
    for item, folder in folders.items():
        run(srv, item, folder)
    seen["evicted"] = {item: run(srv, item, folder, edits=1) for item, folder in folders.items()}
    for path in seen.values():
        assert {item: cells["set"][0] for item, cells in path.items()} == dict.fromkeys(
            ITEMS, "reused")
    wrong = {f"{path}: {item}": cells["read"][1] for path, items in seen.items()
             for item, cells in items.items() if cells["read"][1] != clean[item]}
    assert wrong == {}, {"clean": {k.split(": ")[1]: clean[k.split(": ")[1]] for k in wrong}}


def test_a_cell_run_after_a_restart_from_each_items_state_is_as_a_clean_run(clean, tmp_path,
                                                                            make_server):
    """/execute chains: each item's `set` run from `initial`, the server restarted, then
    `read` from that state (restored): what the clean run showed, for every item."""
    srv = make_server(tmp_path / "store")
    for n, item in enumerate(ITEMS):
        folder = folder_for(tmp_path, item)
        srv.execute(ITEMS[item][0], new=f"set{n}", extra={"cwd": str(folder)})
    srv.stop()
    srv = cold_server(make_server, tmp_path / "store")
    restored = {}
    for n, item in enumerate(ITEMS):
        answer = srv.execute(ITEMS[item][1], state=f"set{n}", new=f"read{n}")
        restored[item] = shown(answer["output"])
    assert {k: v for k, v in restored.items() if v != clean[k]} == {}


def write_notebook(path, sources):
    """An .ipynb of these code cells."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s, id=f"c{n}") for n, s in enumerate(sources)]
    nbformat.write(nb, str(path))


def run_command(path, *args):
    """`main.py run` of the notebook at `path`; what each of its cells shows."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "run", str(path),
                           *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [shown(c.outputs) for c in nbformat.read(str(path), as_version=4).cells]


@pytest.mark.parametrize("where", ["--server", "serverless"])
def test_the_reported_seed_notebook_edited_gives_a_clean_runs_numbers(where, tmp_path,
                                                                      make_server):
    """issue 41: `[import numpy as np; np.random.seed(0)]`, `[np.random.rand(3)]` (and
    `random.seed`), run, a comment added to the second cell, run again: 0.5488, not
    the second draw 0.5449; in the copy of the notebook in another folder too."""
    seed = "import numpy as np, random\nnp.random.seed(0)\nrandom.seed(0)"
    draw = "(np.random.rand(3), random.random())"
    if where == "--server":
        srv = make_server(tmp_path / "store")
        args = ["--server", srv.url, "--token", srv.token]
    else:
        args = ["--data-dir", str(tmp_path / "store")]
    nb = tmp_path / "nb.ipynb"
    write_notebook(nb, [seed, draw])
    clean = run_command(nb, *args)
    assert "0.5488135" in clean[1] and "0.8444218" in clean[1]
    write_notebook(nb, [seed, draw + "  # a comment"])
    assert run_command(nb, *args) == clean
    (tmp_path / "copy").mkdir()
    shutil.copy(nb, tmp_path / "copy" / "nb.ipynb")
    assert run_command(tmp_path / "copy" / "nb.ipynb", *args) == clean
