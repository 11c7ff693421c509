"""A fresh run of an .ipynb file: its files checked, its output promoted, its receipt.

The notebook is read once (its SHA-256 is over those bytes) and read again
at the end: a source that changed meanwhile fails the run. The executed
notebook (every code cell's stale outputs, execution count and execution
timing cleared, then the run's filled in) is written to a hidden file beside
the destination and renamed into place only after the run succeeded and
cleaned up; without --overwrite an existing destination is never replaced,
even one that appeared during the run. The receipt is written whatever the
outcome, unless its own path is the problem.
"""

import hashlib
import os
import warnings

import nbformat

from kernel.notebook import files, receipt
from kernel.notebook.fresh import SKIP_TAGS, Cell, FreshRun, Limits, Refused

# Exit statuses of `main.py run --fresh`.
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
# Categories that say the command was asked for something it will not do.
_REFUSALS = ("BAD_INPUT", "OUTPUT_EXISTS")


def shown(path):
    """A path as the receipt names it: relative to the working directory of the command."""
    return os.path.relpath(path)


def read(path):
    """(bytes, nbformat notebook) of the .ipynb at `path`; Refused(BAD_INPUT) if it is
    not a readable, valid notebook of Python code."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise Refused("BAD_INPUT", f"cannot read {path}: {exc.strerror}") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nbformat warns about what it repairs
            notebook = nbformat.reads(data.decode("utf-8"), as_version=4)
            nbformat.validate(notebook)
    except Exception as exc:  # not UTF-8, not JSON, not a valid notebook
        raise Refused("BAD_INPUT", f"{path} is not a valid Jupyter notebook: "
                                   f"{type(exc).__name__}: {str(exc)[:300]}") from None
    metadata = notebook.get("metadata", {})
    language = (metadata.get("kernelspec", {}).get("language")
                or metadata.get("language_info", {}).get("name") or "python")
    if language.lower() != "python":
        raise Refused("BAD_INPUT", f"{path} is a {language} notebook; fresh runs run Python")
    return data, notebook


def cells_of(notebook):
    """The code cells of a notebook as fresh.Cell (ids `cell-N` where it has none)."""
    return [Cell(index=n, id=cell.get("id") or f"cell-{n}", source=cell.source,
                 skip=bool(set(cell.get("metadata", {}).get("tags", [])) & set(SKIP_TAGS)))
            for n, cell in enumerate(notebook.cells) if cell.cell_type == "code"]


def executed(notebook, cells):
    """The notebook as the run leaves it: stale outputs, counts and timings cleared, the
    run's outputs and execution counts filled in (nbformat-valid)."""
    result = nbformat.from_dict(notebook)
    by_index = {cell.index: cell for cell in cells}
    for n, cell in enumerate(result.cells):
        if cell.cell_type != "code":
            continue
        ran = by_index[n]
        cell.outputs = [nbformat.from_dict(o) for o in ran.outputs]
        cell.execution_count = ran.execution_count
        cell.metadata.pop("execution", None)  # nbclient's timings of an earlier run
    nbformat.validate(result)
    return result


def _same(a, b):
    """True when two paths name one file (or would, once created)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _check_writable(path, what):
    """Refused(BAD_INPUT) unless a file can be written at `path` (`what` names it)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise Refused("BAD_INPUT", f"cannot write the {what} {path}: its folder does not "
                                   f"exist or is not writable")
    if os.path.isdir(path):
        raise Refused("BAD_INPUT", f"the {what} {path} is a folder")


def _check_receipt_path(path, others):
    """Refused(BAD_INPUT) unless a receipt can be written at `path` without touching
    the files in `others`."""
    _check_writable(path, "receipt")
    for other in others:
        if other is not None and _same(path, other):
            raise Refused("BAD_INPUT", f"the receipt {path} would overwrite {other}")


def _check_output_path(source, output):
    """Refused(BAD_INPUT) unless the executed notebook can be written at `output`."""
    if _same(source, output):
        raise Refused("BAD_INPUT", "the output must differ from the source notebook")
    _check_writable(output, "output")


def run_file(source, output, receipt_path, settings, timeout=None, cell_timeout=None,
             cwd=None, variables=(), lock=None, expected_environment=None, overwrite=False,
             keep_states=None, adopt_orphans=False, on_cell=None):
    """Run the notebook at `source` fresh; returns (exit status, receipt).

    Refused(BAD_INPUT), before anything else, when no receipt can be written
    at `receipt_path` (None: no receipt file); `on_cell(cell)` is called as
    each cell ends; `adopt_orphans` is FreshRun's (for the command line only).
    The other arguments are the command's options (README).
    """
    run = FreshRun([], settings, variables=variables, expected_environment=expected_environment,
                   keep_states=keep_states, adopt_orphans=adopt_orphans, on_cell=on_cell)
    source_info = {"path": shown(source), "sha256": None}
    output_info = None if output is None else {"path": shown(output), "sha256": None,
                                               "written": False}
    lock_info = notebook = None
    if receipt_path is not None:
        _check_receipt_path(receipt_path, [source, output, lock])
    try:
        run.limits = Limits.of(settings, timeout, cell_timeout)
        data, notebook = read(source)
        source_info["sha256"] = hashlib.sha256(data).hexdigest()
        run.cells = cells_of(notebook)
        if output is not None:
            _check_output_path(source, output)
        if lock is not None:
            try:
                lock_info = {"path": shown(lock), "sha256": files.sha256_file(lock)}
            except OSError as exc:
                raise Refused("BAD_INPUT", f"cannot read the lock file {lock}: "
                                           f"{exc.strerror}") from None
        run.cwd = cwd if cwd is not None else os.path.dirname(os.path.abspath(source))
        if output is not None and os.path.lexists(output) and not overwrite:
            raise Refused("OUTPUT_EXISTS", f"{output} exists (--overwrite replaces it)")
    except Refused as exc:
        run.refuse(exc.category, str(exc))
    run.run()
    if run.category is None:
        _finish(run, source, source_info, notebook, output, output_info, overwrite)
    built = receipt.build(run, source_info, output_info, lock_info,
                          shown(run.cwd) if run.cwd else None)
    if receipt_path is not None:
        receipt.write(built, receipt_path)
    if run.success:
        return EXIT_OK, built
    return (EXIT_BAD_INPUT if run.category in _REFUSALS else EXIT_FAILED), built


def _finish(run, source, source_info, notebook, output, output_info, overwrite):
    """After a successful run: check the source again, promote the executed notebook."""
    tmp = None
    try:
        if output is not None:
            data = (nbformat.writes(executed(notebook, run.cells)) + "\n").encode()
            tmp = files.stage(output, data)
        try:
            unchanged = files.sha256_file(source) == source_info["sha256"]
        except OSError:
            unchanged = False
        if not unchanged:
            run.refuse("SOURCE_CHANGED", f"{source} changed while it ran; nothing was "
                                         f"written")
            return
        if tmp is not None:
            try:
                files.promote(tmp, output, overwrite)
            except FileExistsError:
                run.refuse("OUTPUT_EXISTS", f"{output} appeared while the notebook ran; it "
                                            f"was left as it is")
                return
            tmp = None
            output_info.update(sha256=hashlib.sha256(data).hexdigest(), written=True)
    except OSError as exc:
        run.refuse("BAD_INPUT", f"cannot write {output}: {exc.strerror}")
    finally:
        if tmp is not None:
            files.discard(tmp)
