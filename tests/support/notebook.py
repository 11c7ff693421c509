"""The `run` command and the .ipynb files it reads and writes."""

import base64
import re
import struct
import subprocess
import sys

import nbformat

from support.server import ROOT


def run_cli(*args, timeout=300):
    """`python main.py run ARGS`; the CompletedProcess, text output."""
    return subprocess.run([sys.executable, "main.py", "run", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def code_cells(path, validate=True):
    """The code cells of a notebook file, which must pass nbformat's validation unless
    `validate` is False (a notebook as someone else wrote it)."""
    nb = nbformat.read(str(path), as_version=4)
    if validate:
        nbformat.validate(nb)
    return [c for c in nb.cells if c.cell_type == "code"]


def text(cell):
    """What a cell printed or showed as text."""
    return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                   for o in cell.outputs)


def png_sizes(outputs):
    """(width, height) of every PNG among `outputs`, from its IHDR chunk."""
    sizes = []
    for out in outputs:
        png = out.get("data", {}).get("image/png")
        if png:
            raw = base64.b64decode("".join(png) if isinstance(png, list) else png)
            sizes.append(struct.unpack(">II", raw[16:24]))
    return sizes


def write_notebook(path, cells):
    """Write the notebook of `cells` [(id, source)] to `path`."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source, id=cell_id) for cell_id, source in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)


def run_command(notebook, output, *extra):
    """`main.py run NOTEBOOK -o OUTPUT --allow-errors EXTRA...`: ({cell id: status},
    [outputs of each code cell])."""
    done = run_cli(notebook, "-o", output, "--allow-errors", *extra)
    assert done.returncode in (0, 1), done.stderr
    statuses = dict(re.findall(r"^(\S+): (ran|reused|failed|blocked|not_run)\b",
                               done.stderr, re.M))
    return statuses, [c.outputs for c in code_cells(output, validate=False)]


def notebook(path, *sources):
    """Write a notebook: a markdown cell, then code cells c0, c1, ... with these sources."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# A title")]
    nb.cells += [nbformat.v4.new_code_cell(src, id=f"c{n}") for n, src in enumerate(sources)]
    nbformat.write(nb, str(path))
    return path


# POST /notebooks/run through a test server, and reading its answer.

def run(server, name, notebook_cells, status=200, **fields):
    """POST /notebooks/run; the answer (asserting the HTTP status)."""
    r = server.post("/notebooks/run", dict(notebook=name, cells=notebook_cells, **fields))
    assert r.status_code == status, r.text
    return r.json()


def statuses(answer):
    """{cell id: status} of a run's answer."""
    return {c["id"]: c["status"] for c in answer["cells"]}


def cell(answer, cell_id):
    """One cell's entry of a run's answer."""
    return next(c for c in answer["cells"] if c["id"] == cell_id)
