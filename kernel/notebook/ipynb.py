"""Notebook files in and out: the code cells of an .ipynb, and the executed notebook.

Reading and writing go through nbformat (version 4); every notebook run,
incremental or fresh, reads and writes its file here. Cells without an id
(nbformat before 4.5) get `cell-<index>`. The executed notebook keeps
every cell and its source; code cells get the run's outputs and execution
counts (a failing cell its error output too) and lose the timings an
earlier run left in their metadata; cells that did not run have none.
"""

import warnings

import nbformat

from snapkernel.kernel import files
from snapkernel.kernel.notebook.graph import is_parse_error
from snapkernel.kernel.protocol import CellStatus, NotebookCell


class NotebookFileError(Exception):
    """The file is not a notebook that can be run."""


def read(path, strict=False):
    """(bytes, nbformat v4 notebook) of the .ipynb at `path`, or NotebookFileError
    naming the problem.

    `strict` (fresh runs): the notebook must also pass nbformat's validation
    and be a Python notebook.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise NotebookFileError(f"cannot read {path}: {exc.strerror}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nbformat warns about what it repairs
        try:
            notebook = nbformat.reads(data.decode("utf-8"), as_version=4)
        except Exception as exc:  # not UTF-8, not JSON, not a notebook
            raise NotebookFileError(f"{path} is not a Jupyter notebook: "
                                    f"{type(exc).__name__}: {str(exc)[:300]}") from None
        if strict:
            try:
                nbformat.validate(notebook)
            except nbformat.ValidationError as exc:
                raise NotebookFileError(f"{path} is not a valid Jupyter notebook: "
                                        f"{str(exc)[:300]}") from None
    metadata = notebook.get("metadata", {})
    language = (metadata.get("kernelspec", {}).get("language")
                or metadata.get("language_info", {}).get("name") or "python")
    if strict and language.lower() != "python":
        raise NotebookFileError(f"{path} is a {language} notebook; fresh runs run Python")
    return data, notebook


def code_cells(notebook):
    """The notebook's code cells, in order, as protocol.NotebookCell (id, source,
    index among all its cells, tags)."""
    return [NotebookCell(id=cell.get("id") or f"cell-{n}", source=cell.source, index=n,
                         tags=tuple(cell.get("metadata", {}).get("tags", ())))
            for n, cell in enumerate(notebook.cells) if cell.cell_type == "code"]


def executed(notebook, cells):
    """A copy of `notebook` with the outputs and execution counts of the run's `cells`
    (protocol.NotebookCell, by index), nbformat-valid."""
    result = nbformat.from_dict(notebook)
    by_index = {cell.index: cell for cell in cells}
    for n, cell in enumerate(result.cells):
        if cell.cell_type != "code":
            continue
        ran = by_index[n]
        outputs = [nbformat.from_dict(o) for o in ran.outputs or []]
        error = ran.error
        # A failed cell shows its error (also one tagged raises-exception, reused or
        # not); a blocked one only a syntax error of its own.
        if error is not None and (ran.status != CellStatus.BLOCKED
                                  or is_parse_error(error["ename"])):
            outputs.append(nbformat.v4.new_output("error", ename=error["ename"],
                                                  evalue=error["evalue"],
                                                  traceback=error["traceback"]))
        cell.outputs = outputs
        cell.execution_count = ran.execution_count
        cell.metadata.pop("execution", None)  # the timings of an earlier run
    nbformat.validate(result)
    return result


def dumps(notebook):
    """The bytes of `notebook` as a file holds them."""
    return (nbformat.writes(notebook) + "\n").encode()


def write(notebook, path):
    """Write `notebook` to `path` atomically (a crash leaves the old file or the new one)."""
    files.promote(files.stage(path, dumps(notebook)), path, overwrite=True)
