"""Outputs compared with Jupyter's: the notebooks of tests/notebooks/ run through
ipykernel (nbclient) and through the server, and their outputs compared cell by cell
after `normalize`, which masks what legitimately changes from run to run (timings,
memory addresses, Styler table ids). Differences we keep on purpose are listed in
docs/fidelity.md."""

import base64
import glob
import os
import re
import tempfile

import nbformat

from support import cells

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



NOTEBOOKS = sorted(glob.glob(os.path.join(TESTS, "notebooks", "*.ipynb")))


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


_MASKS = [
    (re.compile(r"\b0x[0-9a-fA-F]+"), "0x?"),
    (re.compile(r"(CPU times|Wall time):.*"), r"\1: ?"),
    # Anchored at line starts: unanchored, `.*` retries from every position of a line, and
    # a one-line output of megabytes (BokehJS, plotly.js) takes minutes.
    (re.compile(r"^.* per loop \(mean ± std\. dev\. of .*", re.M), "? per loop"),
    # %timeit's warning when its runs vary 4-fold: timing noise, on either side.
    (re.compile(r"The slowest run took .* being cached\.\n?"), ""),
    (re.compile(r"T_[0-9a-f]{5}"), "T_?"),  # pandas Styler's random table id
    # The wall clock in a statsmodels summary (text and HTML): "Time: 22:34:13".
    (re.compile(r"\b(Time:(?:\s|</th>|<td>)*)\d\d:\d\d:\d\d"), r"\1?"),
    (re.compile(r"\b(Date:(?:\s|</th>|<td>)*)\w{3}, \d\d \w{3} \d{4}"), r"\1?"),
    # Ids that HTML reprs draw at random or from a per-process counter, to tie their
    # elements together: BokehJS, xarray (UUIDs), Altair charts, scikit-learn estimators.
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "UUID"),
    (re.compile(r"\baltair-viz-[0-9a-f]{32}\b"), "altair-viz-?"),
    (re.compile(r"\bsk-(container|estimator)-id-\d+\b"), r"sk-\1-id-?"),
    # The wall clock matplotlib writes into an SVG's metadata.
    (re.compile(r"<dc:date>[^<]*</dc:date>"), "<dc:date>?</dc:date>"),
    # Where a warning was raised: ipykernel's temporary file, our cell name (a difference
    # kept on purpose, docs/fidelity.md).
    # (A literal start: a pattern opening with `\S*` retries from every position.)
    (re.compile(re.escape(tempfile.gettempdir()) + r"/ipykernel_\d+/\d+\.py"
                r"|<cell In\[\d+\] [0-9-]+>"), "<cell>"),
    (re.compile(r"\r\n"), "\n"),
]


def normalize_text(text):
    """Mask the parts of an output text that differ between any two runs."""
    text = _ANSI.sub("", text)
    for pattern, repl in _MASKS:
        text = pattern.sub(repl, text)
    return text


def _text(value):
    """nbformat multiline strings (str or list of str) as one string."""
    return "".join(value) if isinstance(value, list) else value


def normalize(outputs):
    """Comparable form of a cell's outputs: streams merged, volatile text masked.

    Returns (items, error): items without the error output; error as
    (ename, evalue) or None.
    """
    items, error = [], None
    for out in outputs:
        kind = out["output_type"]
        if kind == "error":
            error = (out["ename"], _error_value(out["ename"], out["evalue"]))
            continue
        if kind == "stream":
            # ipykernel buffers stdout and stderr apart and forwards fd-level output
            # from a thread, so between two displays it may reorder lines (we keep the
            # true order, see docs/fidelity.md): compare each stream's lines as a set.
            # Blank lines are left out: ipykernel's fd watcher now and then forwards a
            # stray newline of its own before a cell's first line.
            # Consecutive stream outputs are one text, however a kernel cut it up.
            if not (items and items[-1][0] == "streams"):
                items.append(("streams", {}))
            items[-1][1][out["name"]] = items[-1][1].get(out["name"], "") + _text(out["text"])
            continue
        data = {}
        for mime, value in out["data"].items():
            if mime == "image/png":
                raw = base64.b64decode(_text(value))
                data[mime] = "PNG" if raw[:8] == b"\x89PNG\r\n\x1a\n" else "NOT A PNG"
            elif isinstance(value, (str, list)):
                data[mime] = normalize_text(_text(value))
            else:
                data[mime] = value
        items.append((kind, tuple(sorted(data.items(), key=lambda kv: kv[0]))))
    items = [("streams", {k: sorted(line for line in normalize_text(v).splitlines() if line)
                          for k, v in sorted(item[1].items())})
             if item[0] == "streams" else item for item in items]
    return items, error


def _error_value(ename, evalue):
    """An error's value without the file name part a SyntaxError carries."""
    if ename in ("SyntaxError", "IndentationError", "TabError"):
        return re.sub(r"\s*\([^()]*line \d+\)$", "", evalue)
    return evalue


def validate_outputs(outputs):
    """Every output must be a valid nbformat v4 output."""
    for out in outputs:
        nbformat.validate(out, ref="output", version=4)


def compare_cell(index, source, expected, actual, actual_error):
    """Assert one cell's outputs match Jupyter's; return a readable diff on failure."""
    validate_outputs(actual)
    exp_items, exp_error = normalize(expected)
    act_items, _ = normalize(actual)
    act_error = None
    if actual_error is not None:
        act_error = (actual_error["ename"], _error_value(actual_error["ename"], actual_error["evalue"]))
        assert isinstance(actual_error["traceback"], list)
    problems = []
    if exp_error != act_error:
        problems.append(f"error: jupyter {exp_error!r}, here {act_error!r}")
    if exp_items != act_items:
        problems.append(f"outputs:\n  jupyter {exp_items!r}\n  here    {act_items!r}")
    if problems:
        return f"cell {index}:\n{source}\n" + "\n".join(problems)
    return None


# ipykernel forwards a cell's fd-level output (os.system, a C printf) from a thread that
# reads a pipe; on a loaded machine that thread may lag, and the output then shows in the
# next cell or nowhere. An IPython startup file of the reference kernels waits after each
# cell until that thread took all of it (the pipe empty, the thread blocked reading it,
# per Linux's /proc), so Jupyter's reference shows each cell's output in that cell, as
# ipykernel means to, however loaded the machine. It leaves no name in the notebook.
_DRAIN_FD_OUTPUT = """\
def _snapk_drain_fd_output():
    import fcntl, struct, sys, termios, time

    def drain(*_):
        for stream in (sys.stdout, sys.stderr):
            pipe = getattr(stream, "_fid", None)
            thread = getattr(stream, "watch_fd_thread", None)
            if pipe is None or thread is None:
                continue
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                waiting = struct.unpack("i", fcntl.ioctl(pipe, termios.FIONREAD, bytes(4)))[0]
                with open(f"/proc/self/task/{thread.native_id}/wchan") as f:
                    reading = "pipe" in f.read()
                if reading and not waiting:
                    break
                time.sleep(0.001)
            stream.flush()

    get_ipython().events.register("post_run_cell", drain)


_snapk_drain_fd_output()
del _snapk_drain_fd_output
"""


def run_in_jupyter(paths, kernel_name="python3", slots=3, in_own_folder=False, timeout=120):
    """Execute notebooks through a kernel (ipykernel's by default), `slots` at once;
    {path: [(source, outputs)]}. Each runs in tests/, or with `in_own_folder` in the
    notebook's folder (as Jupyter does)."""
    import asyncio

    from nbclient import NotebookClient

    async def one(path, gate):
        """Run one notebook when a slot is free."""
        async with gate:
            nb = nbformat.read(path, as_version=4)
            folder = os.path.dirname(path) if in_own_folder else TESTS
            client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name,
                                    allow_errors=True, resources={"metadata": {"path": folder}})
            await client.async_execute()
            return path, [(c.source, c.outputs) for c in nb.cells if c.cell_type == "code"]

    async def run_all():
        """All notebooks, at most `slots` kernels at a time."""
        gate = asyncio.Semaphore(slots)
        return dict(await asyncio.gather(*(one(p, gate) for p in paths)))

    # The kernels get Jupyter's own settings: the inline backend rather than the Agg a
    # test run may set, and fd-level capture, which ipykernel turns off under pytest.
    saved = {k: os.environ.pop(k) for k in ("MPLBACKEND", "PYTEST_CURRENT_TEST", "IPYTHONDIR")
             if k in os.environ}
    with tempfile.TemporaryDirectory() as ipython_dir:
        if kernel_name == "python3":  # ipykernel's: the fd-level output drained (above)
            startup = os.path.join(ipython_dir, "profile_default", "startup")
            os.makedirs(startup)
            with open(os.path.join(startup, "00-drain-fd-output.py"), "w") as f:
                f.write(_DRAIN_FD_OUTPUT)
            os.environ["IPYTHONDIR"] = ipython_dir
        try:
            return asyncio.run(run_all())
        finally:
            os.environ.pop("IPYTHONDIR", None)
            os.environ.update(saved)


def compare_notebook(jupyter_cells, run):
    """Compare Jupyter's outputs with `run(sources) -> [(outputs, error)]`; list the differences."""
    sources = [s for s, _ in jupyter_cells]
    results = run(sources)
    diffs = []
    for i, ((source, expected), (actual, error)) in enumerate(zip(jupyter_cells, results)):
        diff = compare_cell(i, source, expected, actual, error)
        if diff:
            diffs.append(diff)
    return diffs


def run_on_server(server):
    """A runner that sends each cell to POST /execute, chaining states like a client."""
    return lambda sources: [(a["output"], a["error"]) for a in cells.run(server, *sources)]
