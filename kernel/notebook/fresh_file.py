"""A fresh run of an .ipynb file: its files checked, its output promoted, its receipt.

The notebook is read once (its SHA-256 is over those bytes; ipynb.py reads
and writes it) and read again at the end: a source that changed meanwhile
fails the run. The executed
notebook (every code cell's stale outputs, execution count and execution
timing cleared, then the run's filled in) is written to a hidden file beside
the destination and renamed into place only after the run succeeded and
cleaned up; without --overwrite an existing destination is never replaced,
even one that appeared during the run. The receipt is written whatever the
outcome, unless its own path is the problem.
"""

import hashlib
import os

from snapkernel.kernel import files
from snapkernel.kernel.errors import Refused
from snapkernel.kernel.notebook import ipynb, parameters as params, receipt
from snapkernel.kernel.notebook.fresh import FreshRun, Limits

# Categories that say the command was asked for something it will not do (exit status 2).
REFUSALS = ("BAD_INPUT", "OUTPUT_EXISTS")


def shown(path):
    """A path as the receipt names it: relative to the working directory of the command."""
    return os.path.relpath(path)


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
    problem = files.unwritable(path, what)
    if problem:
        raise Refused("BAD_INPUT", problem)


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
        raise Refused("BAD_INPUT", "the output must differ from the source notebook: "
                                   "choose another -o (a fresh run never writes over the "
                                   "notebook it runs)")
    _check_writable(output, "output")


def run_file(source, output, options, settings, adopt_orphans=False, on_cell=None,
             cancel=None, parameters=None):
    """Run the notebook at `source` fresh, writing the executed notebook to `output`
    (None: nowhere); returns the finished FreshRun and its receipt.

    `options` is a model.FreshOptions (its `receipt`, `lock` and
    `overwrite` are about files, and this module's); Refused(BAD_INPUT),
    before anything else, when no receipt can be written at
    `options.receipt` (None: no receipt file). `on_cell(cell)` is called as
    each cell ends; `adopt_orphans` and `cancel` are FreshRun's (`adopt_orphans`
    for the command line only). `parameters` go into the notebook as papermill
    puts them (kernel/notebook/parameters.py); the receipt records them.
    """
    run = FreshRun([], settings, options, adopt_orphans=adopt_orphans, on_cell=on_cell,
                   cancel=cancel)
    source_info = {"path": shown(source), "sha256": None}
    output_info = None if output is None else {"path": shown(output), "sha256": None,
                                               "written": False}
    lock_info = notebook = None
    if options.receipt is not None:
        _check_receipt_path(options.receipt, [source, output, options.lock])
    try:
        run.limits = Limits.of(settings, options.timeout, options.cell_timeout)
        try:
            data, notebook = ipynb.read(source, strict=True)
        except ipynb.NotebookFileError as exc:
            raise Refused("BAD_INPUT", str(exc)) from None
        source_info["sha256"] = hashlib.sha256(data).hexdigest()
        try:
            params.check(parameters or {})
        except params.ParameterError as exc:
            raise Refused("BAD_INPUT", str(exc)) from None
        notebook = ipynb.inject(notebook, parameters)
        run.cells = ipynb.code_cells(notebook)
        if output is not None:
            _check_output_path(source, output)
        if options.lock is not None:
            try:
                lock_info = {"path": shown(options.lock),
                             "sha256": files.sha256_file(options.lock)}
            except OSError as exc:
                raise Refused("BAD_INPUT", f"cannot read the lock file {options.lock}: "
                                           f"{exc.strerror}") from None
        if run.cwd is None:
            run.cwd = os.path.dirname(os.path.abspath(source))
        if output is not None and os.path.lexists(output) and not options.overwrite:
            raise Refused("OUTPUT_EXISTS", f"{output} exists (--overwrite replaces it)")
    except Refused as exc:
        run.refuse(exc.category, str(exc))
    run.run()
    if run.category is None:
        _finish(run, source, source_info, notebook, output, output_info, options.overwrite)
    built = receipt.build(run, source_info, output_info, lock_info,
                          shown(run.cwd) if run.cwd else None, parameters)
    if options.receipt is not None:
        receipt.write(built, options.receipt)
    return run, built


def _finish(run, source, source_info, notebook, output, output_info, overwrite):
    """After a successful run: check the source again, promote the executed notebook."""
    tmp = None
    try:
        if output is not None:
            data = ipynb.dumps(ipynb.executed(notebook, run.cells, ipynb.language_info(
                run.interpreter["python_version"])))
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
