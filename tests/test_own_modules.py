"""A notebook's own modules named like ours are the notebook's: the installed package is
the one `snapkernel`, so `import storage` in a cell finds the `storage.py` beside the
notebook, through /execute, `run` (serverless, --server, --fresh) alike. (The Jupyter
kernel: tests/test_jupyter.py; the installed wheel: tests/test_package.py.)"""

import subprocess
import sys

import nbformat

from support.server import ROOT, TOKEN

# Names of our packages and modules (before and after the move into `snapkernel`) and
# other common ones: each a module of the notebook's folder.
NAMES = ("storage", "kernel", "api", "main", "config", "protocol", "server", "worker",
         "launch", "snapshot", "registry", "client")
CELL = ("import importlib\n"
        f"print([importlib.import_module(n).WHO for n in {NAMES!r}])")
EXPECTED = f"{['notebook ' + n for n in NAMES]}\n"


def own_modules(folder):
    """A notebook folder holding a module of each name of NAMES (kernel/ a package)."""
    folder.mkdir()
    for name in NAMES:
        if name == "kernel":
            (folder / "kernel").mkdir()
            (folder / "kernel" / "__init__.py").write_text(f"WHO = 'notebook {name}'\n")
        else:
            (folder / f"{name}.py").write_text(f"WHO = 'notebook {name}'\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(CELL, id="own")]
    nbformat.write(nb, str(folder / "nb.ipynb"))
    return folder


def printed(path):
    """What the notebook's one cell printed."""
    (cell,) = nbformat.read(str(path), as_version=4).cells
    assert all(o["output_type"] == "stream" for o in cell.outputs), cell.outputs
    return "".join(o["text"] for o in cell.outputs)


def run(*args):
    """`python main.py run ARGS` from the checkout; the CompletedProcess."""
    return subprocess.run([sys.executable, "main.py", "run", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def test_execute_imports_the_notebooks_own_modules(make_server, tmp_path):
    """/execute in the notebook's folder, and again after a restart of the server (the
    restored state's worker imports them afresh)."""
    folder = own_modules(tmp_path / "nb")
    server = make_server(tmp_path / "store")
    r = server.call("POST", "/execute", {"code": CELL, "exec_id": "own-1",
                                         "state_name": "initial", "cwd": str(folder),
                                         "new_state_name": "own"})
    assert r["error"] is None, r["error"]
    assert "".join(o["text"] for o in r["output"]) == EXPECTED
    server.stop()
    server = make_server(tmp_path / "store")
    r = server.call("POST", "/execute", {"code": CELL, "exec_id": "own-2",
                                         "state_name": "own"})
    assert r["error"] is None, r["error"]
    assert "".join(o["text"] for o in r["output"]) == EXPECTED


def test_run_imports_the_notebooks_own_modules(make_server, tmp_path):
    """`run` serverless, through a server, and fresh."""
    folder = own_modules(tmp_path / "nb")
    done = run(folder / "nb.ipynb", "-o", tmp_path / "serverless.ipynb",
               "--data-dir", tmp_path / "store")
    assert done.returncode == 0, done.stderr
    assert printed(tmp_path / "serverless.ipynb") == EXPECTED

    srv = make_server()
    done = run(folder / "nb.ipynb", "-o", tmp_path / "served.ipynb", "--server", srv.url,
               "--token", TOKEN)
    assert done.returncode == 0, done.stderr
    assert printed(tmp_path / "served.ipynb") == EXPECTED

    done = run(folder / "nb.ipynb", "--fresh", "-o", tmp_path / "fresh.ipynb",
               "--receipt", tmp_path / "receipt.json")
    assert done.returncode == 0, done.stderr
    assert printed(tmp_path / "fresh.ipynb") == EXPECTED
