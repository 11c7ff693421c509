"""Notebook files in and out: the code cells of an .ipynb, and the executed notebook.

Reading and writing go through nbformat (version 4). Cells without an id
(nbformat before 4.5) get `cell-<index>`. The executed notebook keeps
every cell and its source; code cells get the run's outputs and execution
counts (a failing cell its error output too); cells that did not run have
none.
"""

import os
import tempfile

import nbformat


class NotebookFileError(Exception):
    """The file is not a notebook that can be run."""


def read(path):
    """The notebook at `path` (nbformat v4), or NotebookFileError naming the problem."""
    try:
        with open(path, encoding="utf-8") as f:
            return nbformat.read(f, as_version=4)
    except OSError as exc:
        raise NotebookFileError(f"cannot read {path}: {exc.strerror}") from None
    except Exception as exc:  # not JSON, not a notebook, bad encoding
        raise NotebookFileError(f"{path} is not a Jupyter notebook: "
                                f"{type(exc).__name__}: {str(exc)[:300]}") from None


def code_cells(notebook):
    """[{id, source}] of the notebook's code cells, in order."""
    return [{"id": cell.get("id") or f"cell-{n}", "source": cell.source}
            for n, cell in enumerate(notebook.cells) if cell.cell_type == "code"]


def executed(notebook, record):
    """A copy of `notebook` with the outputs and execution counts of the run `record`."""
    result = nbformat.from_dict(notebook)
    by_id = {c["id"]: c for c in record["cells"]}
    for n, cell in enumerate(result.cells):
        if cell.cell_type != "code":
            continue
        entry = by_id.get(cell.get("id") or f"cell-{n}")
        outputs = [nbformat.from_dict(o) for o in entry["outputs"] or []]
        error = entry["error"]
        if error is not None and entry["status"] in ("failed", "blocked") and (
                entry["status"] == "failed" or error["ename"] == "SyntaxError"):
            outputs.append(nbformat.v4.new_output("error", ename=error["ename"],
                                                  evalue=error["evalue"],
                                                  traceback=error["traceback"]))
        cell.outputs = outputs
        cell.execution_count = entry["execution_count"]
    nbformat.validate(result)
    return result


def write(notebook, path):
    """Write `notebook` to `path` atomically (a crash leaves the old file or the new one)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".ipynb", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            nbformat.write(notebook, f)
        if os.path.exists(path):
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        else:  # as open() would have made it, not mkstemp's 0600
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
