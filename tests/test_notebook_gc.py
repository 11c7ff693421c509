"""scripts/gc_states.py on a store holding notebook records and cell results."""

import datetime
import subprocess
import sys

import nbformat

from snapkernel.kernel import config
from snapkernel.storage.notebooks import NotebookStore
from snapkernel.storage.store import Store
from support.notebook import run_cli
from support.server import ROOT


def gc(data_dir, *args):
    """scripts/gc_states.py on `data_dir` (the CompletedProcess)."""
    return subprocess.run([sys.executable, "scripts/gc_states.py", "--data-dir", str(data_dir),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def write(path, *sources):
    """A notebook of code cells c0, c1, ..."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s, id=f"c{n}") for n, s in enumerate(sources)]
    nbformat.write(nb, str(path))


def contents(data_dir):
    """(state names, {result key: result}, record names) of a stopped store."""
    store = Store(str(data_dir))
    try:
        notebooks = NotebookStore(store)
        return set(store.manifests()), notebooks.all_results(), set(notebooks.records())
    finally:
        store.env.close()


def backdate_results(data_dir, keys, days):
    """Move the time results were stored `days` into the past."""
    store = Store(str(data_dir), config.load())
    try:
        notebooks = NotebookStore(store)
        results = notebooks.results(keys)
        for result in results.values():
            when = datetime.datetime.fromisoformat(result["created"])
            result["created"] = (when - datetime.timedelta(days=days)).isoformat()
        notebooks.put_run(results)
    finally:
        store.env.close()


def test_gc_keeps_what_notebooks_need_and_drops_old_unused_results(tmp_path):
    data, nb = tmp_path / "store", tmp_path / "nb.ipynb"
    write(nb, "a = 1", "b = a + 1", "print(b)")
    assert run_cli(nb, "--data-dir", data).returncode == 0
    _, old_results, _ = contents(data)
    write(nb, "a = 2", "b = a + 1", "print(b)")
    assert run_cli(nb, "--data-dir", data).returncode == 0
    states, results, records = contents(data)
    assert records == {str(nb)} and len(results) == 6
    needed = {r["state"] for r in results.values()}
    assert needed <= states

    # Age and name rules never take a state a result or record needs.
    result = gc(data, "--older-than", "0s")
    assert result.returncode == 0, result.stderr
    assert "notebook records or stored results need" in result.stdout
    assert needed <= contents(data)[0]

    # Results of the first version, unused by the record and two days old, go.
    backdate_results(data, old_results, 2)
    dry = gc(data, "--notebooks-older-than", "1d", "--dry-run")
    assert "would delete 0 notebook record(s) and 3 stored result(s)" in dry.stdout
    assert contents(data)[1].keys() == results.keys()
    result = gc(data, "--notebooks-older-than", "1d")
    assert result.returncode == 0, result.stderr
    states, kept, records = contents(data)
    assert kept.keys() == results.keys() - old_results.keys() and records == {str(nb)}
    assert {old_results[k]["state"] for k in old_results} & states == set()
    assert {r["state"] for r in kept.values()} <= states
    again = run_cli(nb, "--data-dir", data)
    assert again.returncode == 0 and again.stderr.count(": reused") == 3

    # Everything older than nothing: the record, then every result, then their states.
    result = gc(data, "--notebooks-older-than", "0s")
    assert "deleted 1 notebook record(s) and 3 stored result(s)" in result.stdout
    states, kept, records = contents(data)
    assert not kept and not records and states == {"initial"}
    assert run_cli(nb, "--data-dir", data).stderr.count(": ran") == 3
