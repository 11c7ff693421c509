"""The files a cell reads are inputs of its key; results of older key rules are not reused.

Real runs of `python main.py run`, serverless and through a server (--server), on
notebooks that read their data with the idioms notebooks use every day.
"""

import os
import re
import subprocess
import sys
import time

import pytest

from support.notebook import code_cells, notebook, text
from support.server import ROOT, TOKEN, earlier_tree

IDIOMS = {  # cell id -> (its source, the file it reads, that file's first and next bytes)
    "c1": ("df = pd.read_csv('data.csv')\nprint(df.a.sum())", "data.csv",
           "a,b\n1,2\n3,4\n", "a,b\n10,2\n30,4\n"),
    "c2": ("print(open('notes.txt').read().strip())", "notes.txt", "hello\n", "bye\n"),
    "c3": ("m = np.loadtxt('m.txt')\nprint(m.sum())", "m.txt", "1 2\n3 4\n", "1 2\n3 5\n"),
    "c4": ("cfg = json.load(open('cfg.json'))\nprint(cfg['x'])", "cfg.json",
           '{"x": 1}\n', '{"x": 2}\n'),
    "c5": ("print(pathlib.Path('p.txt').read_text().strip())", "p.txt", "pp\n", "qq\n"),
}
# The cells after them read the names of c1 and c3: the dependents of an edited file.
DEPENDENTS = {"c6": ("print(df.a.sum() * 2)", "c1"), "c7": ("print(m.max())", "c3")}
IMPORTS = "import json\nimport pathlib\nimport numpy as np\nimport pandas as pd"


def run_nb(path, how, store, srv=None):
    """Run the notebook at `path` (`how`: "here" on `store`, or "server" through
    `srv`); ({cell id: status}, {cell id: the text it showed})."""
    args = ["--data-dir", store] if how == "here" else ["--server", srv.url, "--token", TOKEN]
    done = subprocess.run([sys.executable, "main.py", "run", str(path), *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    statuses = dict(re.findall(r"^cell \d+ \((c\d+)\): (\w+)", done.stderr, re.MULTILINE))
    return statuses, {c.id: text(c).strip() for c in code_cells(path)}


def ran(statuses):
    """The ids of the cells that ran."""
    return {c for c, s in statuses.items() if s == "ran"}


@pytest.fixture(params=["here", "server"])
def how(request, make_server, tmp_path):
    """(how, store, server): a run serverless on a store, or through a server."""
    store = tmp_path / "store"
    srv = make_server(store) if request.param == "server" else None
    return request.param, store, srv


def test_each_way_of_reading_a_file_makes_it_an_input_of_the_cell(tmp_path, how):
    """Editing a data file runs exactly the cells that read it and their dependents, and
    they show the new data; touching the files without a change runs nothing."""
    folder = tmp_path / "nb"
    folder.mkdir()
    for _, name, first, _ in IDIOMS.values():
        (folder / name).write_text(first)
    sources = [IMPORTS] + [IDIOMS[f"c{n}"][0] for n in range(1, 6)] + [
        DEPENDENTS[c][0] for c in ("c6", "c7")]
    path = notebook(folder / "nb.ipynb", *sources)
    statuses, shown = run_nb(path, *how)
    assert ran(statuses) == set(statuses) and len(statuses) == 8
    assert [shown[c] for c in ("c1", "c2", "c3", "c4", "c5", "c6", "c7")] == [
        "4", "hello", "10.0", "1", "pp", "8", "4.0"]
    statuses, _ = run_nb(path, *how)
    assert ran(statuses) == set(), statuses
    # Touched, not changed: the same bytes, the same keys.
    later = time.time() + 5
    for _, name, _, _ in IDIOMS.values():
        os.utime(folder / name, (later, later))
    statuses, _ = run_nb(path, *how)
    assert ran(statuses) == set(), statuses
    expected = {"c1": ("40", "80"), "c2": ("bye", None), "c3": ("11.0", "5.0"),
                "c4": ("2", None), "c5": ("qq", None)}
    for cell, (_, name, _, edited) in IDIOMS.items():
        (folder / name).write_text(edited)
        statuses, shown = run_nb(path, *how)
        dependents = {c for c, (_, of) in DEPENDENTS.items() if of == cell}
        assert ran(statuses) == {cell} | dependents, (cell, statuses)
        now, dependent = expected[cell]
        assert shown[cell] == now
        for c in dependents:
            assert shown[c] == dependent


def test_a_file_the_notebook_wrote_is_made_again_when_gone_or_changed(tmp_path, how):
    """c0 writes out.txt, c1 reads it: out.txt deleted or edited between runs, c0 runs
    again and c1 shows what a clean Run All shows; nothing changed, nothing runs."""
    folder = tmp_path / "nb"
    folder.mkdir()
    path = notebook(folder / "nb.ipynb",
                    "n = 3\nopen('out.txt', 'w').write('line\\n' * n)",
                    "print(open('out.txt').read().count('line'))", "print(n)")
    statuses, shown = run_nb(path, *how)
    assert ran(statuses) == {"c0", "c1", "c2"} and shown["c1"] == "3"
    statuses, _ = run_nb(path, *how)
    assert ran(statuses) == set(), statuses
    out = folder / "out.txt"
    for change in (out.unlink, lambda: out.write_text("something else\n")):
        change()
        statuses, shown = run_nb(path, *how)
        assert "c0" in ran(statuses) and shown["c1"] == "3", statuses
        assert out.read_text() == "line\n" * 3
        statuses, _ = run_nb(path, *how)
        assert ran(statuses) == set(), statuses


def test_the_answer_of_execute_lists_the_files_a_cell_opened(server, tmp_path):
    """Through /execute the answer names the files the cell read and wrote, and none of
    the interpreter's or the packages' own."""
    (tmp_path / "in.csv").write_text("a\n1\n")
    answer = server.execute(
        "import pandas as pd, json, decimal\n"
        f"import os\nos.chdir({str(tmp_path)!r})\n"
        "df = pd.read_csv('in.csv')\ndf.to_csv('out.csv')\n"
        "import tempfile\nwith tempfile.TemporaryFile() as t:\n    t.write(b'x')\n")
    assert answer["files_read"] == [str(tmp_path / "in.csv")]
    assert answer["files_written"] == [str(tmp_path / "out.csv")]


def test_results_stored_under_the_key_rules_before_are_not_handed_back(tmp_path):
    """A store made by an earlier version (test_upgrade's tree from git history, whose
    key rules are those of the release before this one: no salt, no files) holds the
    result of a cell that read a file; after the file is edited, this version runs
    the cell again and shows the new content, not the stored result."""
    folder = tmp_path / "nb"
    folder.mkdir()
    (folder / "data.txt").write_text("old data\n")
    path = notebook(folder / "nb.ipynb", "import json\nrows = open('data.txt').read()",
                    "print(rows.strip())", "print(json.dumps([1]))")
    store = tmp_path / "store"
    old = subprocess.run([sys.executable, "main.py", "run", str(path), "--data-dir",
                          str(store)], cwd=earlier_tree(tmp_path / "before"),
                         capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert old.returncode == 0, old.stderr
    assert text(code_cells(path)[1]).strip() == "old data"
    (folder / "data.txt").write_text("new data\n")
    statuses, shown = run_nb(path, "here", store)
    assert ran(statuses) == {"c0", "c1", "c2"}, statuses
    assert shown["c1"] == "new data"
