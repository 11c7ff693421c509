"""The `run` command and the .ipynb files it reads and writes."""

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
