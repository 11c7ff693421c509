"""Notebook files in and out: the code cells of an .ipynb, and the executed notebook.

Reading and writing go through nbformat (version 4); every notebook run,
incremental or fresh, reads and writes its file here. Cells without an id
(nbformat before 4.5) get `cell-<index>`. The executed notebook keeps
every cell and its source; code cells get the run's outputs and execution
counts (a failing cell its error output too) as nbclient writes them:
counts 1..N in notebook order over the cells that have a result, whatever
was reused (an `execute_result` shows its cell's), nbclient's timings in
`metadata.execution` (a reused cell: those of the run that made its
result, and `metadata.snapkernel.reused` true), and the notebook's
`metadata.language_info` from the interpreter that ran it. Cells that did
not run have no count, no outputs and no timings.
"""

import platform
import warnings

import nbformat

from snapkernel.kernel import files
from snapkernel.kernel.notebook import parameters as params
from snapkernel.kernel.notebook.graph import is_parse_error
from snapkernel.kernel.notebook.model import CellStatus, NotebookCell


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
        raise NotebookFileError(f"cannot read {path}: {exc.strerror or exc}") from None
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
    """The notebook's code cells, in order, as model.NotebookCell (id, source,
    index among all its cells, tags)."""
    return [NotebookCell(id=cell.get("id") or f"cell-{n}", source=cell.source, index=n,
                         tags=tuple(cell.get("metadata", {}).get("tags", ())))
            for n, cell in enumerate(notebook.cells) if cell.cell_type == "code"]


def language_info(version=None):
    """ipykernel's metadata.language_info for Python `version` (default: this one)."""
    version = version or platform.python_version()
    return {"name": "python", "version": version, "mimetype": "text/x-python",
            "codemirror_mode": {"name": "ipython", "version": int(version.split(".")[0])},
            "pygments_lexer": f"ipython{version.split('.')[0]}",
            "nbconvert_exporter": "python", "file_extension": ".py"}


def inject(notebook, parameters):
    """A copy of `notebook` with `parameters` in a cell tagged injected-parameters where
    papermill puts it (parameters.placement), and in metadata.papermill.parameters as
    papermill records them; the notebook itself when there are none."""
    if not parameters:
        return notebook
    result = nbformat.from_dict(notebook)
    how, at = params.placement(c.get("metadata", {}).get("tags", ()) for c in result.cells)
    source = params.source(parameters)
    if how == "replace":
        result.cells[at].source = source
    else:
        cell = nbformat.v4.new_code_cell(source, id=params.unique_id(
            {c.get("id") for c in result.cells}))
        cell.metadata["tags"] = [params.INJECTED_TAG]
        result.cells.insert(at, cell)
    result.metadata.setdefault("papermill", {})["parameters"] = parameters
    return result


def executed(notebook, cells, language=None):
    """A copy of `notebook` with the outputs, execution counts and timings of the run's
    `cells` (model.NotebookCell, by index), nbformat-valid; `language` its
    metadata.language_info (default: this interpreter's)."""
    result = nbformat.from_dict(notebook)
    result.metadata["language_info"] = language or language_info()
    by_index = {cell.index: cell for cell in cells}
    count = 0
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
        cell.metadata.pop("execution", None)  # the timings of an earlier run
        cell.metadata.pop("snapkernel", None)
        if ran.execution_count is None:
            cell.execution_count = None
        else:
            count += 1
            cell.execution_count = count
            for output in outputs:
                if output.output_type == "execute_result":
                    output.execution_count = count
        if ran.execution:
            cell.metadata["execution"] = dict(ran.execution)
        if ran.status == CellStatus.REUSED:
            cell.metadata["snapkernel"] = {"reused": True}
        cell.outputs = outputs
    nbformat.validate(result)
    return result


def dumps(notebook):
    """The bytes of `notebook` as a file holds them."""
    return (nbformat.writes(notebook) + "\n").encode()


def write(notebook, path):
    """Write `notebook` to `path` atomically (a crash leaves the old file or the new one)."""
    files.promote(files.stage(path, dumps(notebook)), path, overwrite=True)
