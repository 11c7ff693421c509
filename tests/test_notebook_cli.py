"""`python main.py run NB.ipynb`: the command, on a real store, with and without a server."""

import json
import os
import signal
import subprocess
import sys
import time

import nbformat
import pytest

from support.notebook import code_cells, notebook, run_cli, text
from support.server import ROOT, TOKEN


def test_run_writes_the_executed_notebook_and_reuses_results(tmp_path):
    data = tmp_path / "store"
    src = notebook(tmp_path / "nb.ipynb", "import numpy as np\nx = np.arange(4)",
                   "print(x.sum())", "x * 2",
                   "import matplotlib.pyplot as plt\nplt.plot(x)\nplt.show()")
    out = tmp_path / "out.ipynb"
    first = run_cli(src, "-o", out, "--data-dir", data)
    assert first.returncode == 0, first.stderr
    assert first.stdout == ""
    lines = first.stderr.splitlines()
    assert [line.split(" in ")[0] for line in lines[:4]] == [
        "cell 2 (c0): ran", "cell 3 (c1): ran", "cell 4 (c2): ran", "cell 5 (c3): ran"]
    cells = code_cells(out)
    assert [c.execution_count for c in cells] == [1, 2, 3, 4]
    assert text(cells[1]) == "6\n" and text(cells[2]) == "array([0, 2, 4, 6])"
    assert any("image/png" in o.get("data", {}) for o in cells[3].outputs)
    assert nbformat.read(str(out), as_version=4).cells[0].source == "# A title"
    assert all(not c.outputs for c in code_cells(src))  # -o leaves the source file alone
    # No -o: the notebook itself gets the outputs; nothing runs again.
    second = run_cli(src, "--data-dir", data)
    assert second.returncode == 0, second.stderr
    assert second.stderr.splitlines()[:4] == ["cell 2 (c0): reused", "cell 3 (c1): reused",
                                              "cell 4 (c2): reused", "cell 5 (c3): reused"]
    assert [c.outputs for c in code_cells(src)] == [c.outputs for c in code_cells(out)]
    # An edited cell and its dependents run; the rest is reused.
    nb = nbformat.read(str(src), as_version=4)
    nb.cells[1].source = "import numpy as np\nx = np.arange(5)"
    nbformat.write(nb, str(src))
    third = run_cli(src, "--data-dir", data, "--rerun", "c1")
    assert third.returncode == 0, third.stderr
    assert [line.split(" in ")[0] for line in third.stderr.splitlines()[:4]] == [
        "cell 2 (c0): ran", "cell 3 (c1): ran", "cell 4 (c2): ran", "cell 5 (c3): ran"]
    assert text(code_cells(src)[1]) == "10\n"


def test_failures_and_bad_input(tmp_path):
    data = tmp_path / "store"
    src = notebook(tmp_path / "fail.ipynb", "a = 1", "b = 1 / 0", "c = a + 1", "d = (")
    failed = run_cli(src, "--data-dir", data)
    assert failed.returncode == 1, failed.stderr
    assert "cell 3 (c1): failed" in failed.stderr and "ZeroDivisionError" in failed.stderr
    # After the failure nothing runs, as in Jupyter: nor shows its error a cell that
    # does not parse (the diagnostics name it).
    assert "cell 4 (c2): not_run" in failed.stderr and "cell 5 (c3): not_run" in failed.stderr
    assert "cell 'c3': SyntaxError" in failed.stderr
    cells = code_cells(src)
    errors = [o for o in cells[1].outputs if o.output_type == "error"]
    assert errors and errors[0].ename == "ZeroDivisionError"
    assert cells[2].execution_count is None and not cells[2].outputs
    assert cells[3].execution_count is None and not cells[3].outputs
    garbage = tmp_path / "garbage.ipynb"
    garbage.write_text("{not json")
    for args, words in [((tmp_path / "missing.ipynb",), "cannot read"),
                        ((garbage,), "is not a Jupyter notebook"),
                        ((src, "--rerun", "nope"), "'nope'"),
                        ((src, "--order", "random"), "invalid choice")]:
        refused = run_cli(*args, "--data-dir", data)
        assert refused.returncode == 2, (args, refused.stderr)
        assert words in refused.stderr and "Traceback" not in refused.stderr, refused.stderr


def test_a_server_holding_the_store_is_named_and_can_be_gone_through(make_server, tmp_path):
    data = tmp_path / "store"
    srv = make_server(data)
    src = notebook(tmp_path / "served.ipynb", "import os\nn = len(os.sep)", "print(n + 1)")
    refused = run_cli(src, "--data-dir", data)
    assert refused.returncode == 2
    assert f"http://127.0.0.1:{srv.port}" in refused.stderr and "--server" in refused.stderr
    assert "Traceback" not in refused.stderr
    through = run_cli(src, "--server", srv.url, "--token", TOKEN)
    assert through.returncode == 0, through.stderr
    assert "cell 3 (c1): ran" in through.stderr
    assert text(code_cells(src)[1]) == "2\n"
    name = os.path.abspath(src)
    assert name in srv.get("/notebooks").json()["notebooks"]
    wrong = run_cli(src, "--server", srv.url, "--token", "wrong")
    assert wrong.returncode == 2 and "401" in wrong.stderr


def wait_for_file(path, proc, timeout=120):
    """Wait until `path` exists (a cell made it); fail if `proc` ended first."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["here", "server", "fresh"])
def test_ctrl_c_interrupts_the_running_cell_and_ends_the_run(make_server, tmp_path, how):
    started = tmp_path / "started"
    src = notebook(tmp_path / "nb.ipynb", "x = 1",
                   f"import time\nopen({str(started)!r}, 'w').close()\ntime.sleep(600)",
                   "y = x + 1")
    args = {"here": ["--data-dir", tmp_path / "store"],
            "fresh": ["--fresh", "-o", tmp_path / "out.ipynb", "--receipt", tmp_path / "r.json"],
            "server": []}[how]
    if how == "server":
        srv = make_server(tmp_path / "served")
        args = ["--server", srv.url, "--token", TOKEN]
    proc = subprocess.Popen([sys.executable, "main.py", "run", str(src), *map(str, args)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)
    try:
        wait_for_file(started, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "Traceback" not in err and "interrupting the run" in err, err
    if how == "fresh":
        receipt = json.loads((tmp_path / "r.json").read_text())
        assert receipt["category"] == "CELL_ERROR" and not receipt["output"]["written"]
        assert [c["status"] for c in receipt["cells"]] == ["ran", "failed", "not_run"]
        assert receipt["cells"][1]["ename"] == "KeyboardInterrupt"
        assert receipt["cleanup"]["status"] == "ok"
        return
    assert "cell 3 (c1): failed" in err and "KeyboardInterrupt" in err, err
    assert "cell 4 (c2): not_run" in err, err
    cells = code_cells(src)
    assert cells[0].execution_count == 1 and text(cells[0]) == ""
    assert [o.ename for o in cells[1].outputs if o.output_type == "error"] == [
        "KeyboardInterrupt"]
    assert cells[2].execution_count is None


def test_allow_errors_on_the_command_line(tmp_path):
    src = notebook(tmp_path / "nb.ipynb", "x = 1\nraise ValueError('on purpose')",
                   "print(x + 1)")
    done = run_cli(src, "--data-dir", tmp_path / "store", "--allow-errors")
    assert done.returncode == 0, done.stderr
    assert "cell 2 (c0): failed" in done.stderr and "cell 3 (c1): ran" in done.stderr
    cells = code_cells(src)
    assert [o.ename for o in cells[0].outputs if o.output_type == "error"] == ["ValueError"]
    assert text(cells[1]) == "2\n"
    refused = run_cli(src, "--fresh", "--allow-errors")
    assert refused.returncode == 2 and "--allow-errors: not with --fresh" in refused.stderr


def test_a_tagged_cell_fails_a_fresh_run(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("1 / 0", id="c0",
                                          metadata={"tags": ["raises-exception"]}),
                nbformat.v4.new_code_cell("y = 1", id="c1")]
    nbformat.write(nb, str(tmp_path / "nb.ipynb"))
    done = run_cli(tmp_path / "nb.ipynb", "--fresh", "--receipt", tmp_path / "r.json")
    receipt = json.loads((tmp_path / "r.json").read_text())
    assert done.returncode == 1 and receipt["category"] == "CELL_ERROR"
    assert [c["status"] for c in receipt["cells"]] == ["failed", "not_run"]
