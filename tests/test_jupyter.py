"""The Jupyter kernel (frontends/jupyter/) through its installed kernelspec.

Every test starts real kernels with jupyter_client (or nbclient, papermill,
JupyterLab in Chromium) from a kernelspec that `python main.py
install-kernelspec` installed into a temporary Jupyter data directory. The
kernels share the server they start on that kernelspec's private store.
"""

import io
import json
import os
import re
import subprocess
import sys

import nbformat
import psutil
import pytest

from snapkernel.kernel import __version__
from support.fidelity import NOTEBOOKS, compare_notebook, run_in_jupyter, run_on_server
from support.jupyter import (  # noqa: F401 (data_dir, kernel, lab: fixtures)
    IDLE_S, SPEC, Kernel, data_dir, jupyter_env, kernel, lab, server_info)
from support.server import ROOT, wait_for


def test_install_kernelspec(data_dir):
    """The CLI installs a kernelspec with message interrupts; bad input exits 2 with a message."""
    spec = json.loads((data_dir / "kernels" / SPEC / "kernel.json").read_text())
    assert spec["display_name"] == f"Python (snapshot: {SPEC})"
    assert spec["interrupt_mode"] == "message" and spec["language"] == "python"
    # -P: Jupyter starts kernels in the notebook's folder, whose own kernel/ must not be
    # imported; the package is installed (editable), so no path to the checkout either.
    assert spec["argv"][:2] == [sys.executable, "-P"] and ROOT not in spec["argv"]
    bad = subprocess.run([sys.executable, "main.py", "install-kernelspec", "--user",
                          "--name", "no spaces"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "kernelspec name" in bad.stderr
    bad = subprocess.run([sys.executable, "main.py", "install-kernelspec", "--config",
                          "/nonexistent.toml"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "nonexistent.toml" in bad.stderr


def test_kernel_info_and_cells(kernel):
    """kernel_info names Python; a cell's outputs and execution count reach the client."""
    info = kernel.client.kernel_info(reply=True)["content"]
    assert info["language_info"]["name"] == "python"
    assert info["language_info"]["version"].startswith(f"{sys.version_info[0]}.")
    assert info["implementation_version"] == __version__  # the package's one version
    assert "%undo" in info["banner"]
    # No debugger: debugpy cannot reach the cells' processes (and JupyterLab would offer it).
    assert "debugger" not in info.get("supported_features", [])
    content, outputs = kernel.run("x = 6 * 7\nprint('x is', x)\nx")
    assert content["status"] == "ok"
    # The printed line may come in pieces (each as it is written), then the result.
    assert {o["msg_type"] for o in outputs[:-1]} == {"stream"}
    assert "".join(o["text"] for o in outputs[:-1]) == "x is 42\n"
    assert outputs[-1]["msg_type"] == "execute_result"
    assert outputs[-1]["execution_count"] == content["execution_count"]
    again, _ = kernel.run("x")
    assert again["execution_count"] == content["execution_count"] + 1


def test_traceback_cell_numbers_are_the_execution_counts(kernel):
    """A traceback's Cell In[N] is the cell's execution count, as in ipykernel, after a
    kernel magic (which counts) and after %undo moves the head back."""

    def failing(code):
        """(the execution count, the 'Cell In[...]' labels of the traceback)."""
        content, _ = kernel.run(code)
        assert content["status"] == "error", content
        labels = re.findall(r"Cell In\[\d+\]", "\n".join(content["traceback"]))
        return content["execution_count"], labels

    defined, _ = kernel.run("def inverse(a):\n    return 1 / a")
    count, labels = failing("inverse(0)")
    assert labels == [f"Cell In[{count}]", f"Cell In[{defined['execution_count']}]"]
    kernel.text("%states")
    count, labels = failing("1 / 0")
    assert labels == [f"Cell In[{count}]"]
    kernel.run("z = 1")
    kernel.text("%undo")
    count, labels = failing("z")  # z is gone with the undone cell
    assert labels == [f"Cell In[{count}]"]
    # The front end's count goes on as ipykernel's: one per cell, magics included.
    again, _ = kernel.run("1")
    assert again["execution_count"] == count + 1


def test_failing_cell_leaves_the_head(kernel):
    """A cell that raises shows its error and makes no state: the next cell runs on the head."""
    kernel.run("v = 1")
    content, outputs = kernel.run("v = 2\n1 / 0")
    assert content["status"] == "error" and content["ename"] == "ZeroDivisionError"
    assert [o["msg_type"] for o in outputs] == ["error"]
    assert any("1 / 0" in line for line in content["traceback"])
    assert kernel.value("v") == "1"


def test_crashing_cell_does_not_end_the_session(kernel):
    """A segfault or os._exit kills the cell's process, not the session."""
    kernel.run("kept = 'still here'")
    content, _ = kernel.run("import ctypes\nctypes.string_at(0)")
    assert content["status"] == "error" and content["ename"] == "WorkerDied"
    assert "SIGSEGV" in content["evalue"]
    content, _ = kernel.run("import os\nos._exit(3)")
    assert content["status"] == "error" and content["ename"] == "WorkerDied"
    assert kernel.value("kept") == "'still here'"


def test_undo_checkout_branch_session(kernel):
    """%undo brings back an overwritten value; %checkout, %branch and %session move the head."""
    first, _ = kernel.run("value = 'first'")
    kernel.run("value = 'second'")
    assert "head: cell" in kernel.text("%undo")
    assert kernel.value("value") == "'first'"
    states = kernel.text("%states")
    assert "value = 'first'" in states and "value = 'second'" not in states
    kernel.run("value = 'third'")
    kernel.text(f"%checkout {first['execution_count']}")
    assert kernel.value("value") == "'first'"
    kernel.run("value = 'on the branch'")
    original = kernel.text("%session").split("'")[1]
    assert "new session 'b1'" in kernel.text("%branch b1")
    kernel.run("only_here = 1")
    assert kernel.value("value") == "'on the branch'"
    kernel.text(f"%session {original}")
    content, _ = kernel.run("only_here")
    assert content["ename"] == "NameError"
    assert "new session 'scratch'" in kernel.text("%session scratch")
    assert kernel.run("value")[0]["ename"] == "NameError"
    kernel.text("%session b1")
    assert kernel.value("only_here") == "1"
    assert kernel.text("%undo 3").startswith("head: cell")
    # Errors of use: shown as UsageError, and nothing moves.
    for bad in ("%undo 1000", "%undo x", "%checkout 9999", "%checkout no-such-state",
                "%branch b1", "%undo\nvalue = 1"):
        content, _ = kernel.run(bad)
        assert content["status"] == "error" and content["ename"] == "UsageError", bad


def test_interrupt(kernel):
    """Output reaches the client while the cell runs; an interrupt message then stops the
    cell through /interrupt, and the session goes on from the head."""
    kernel.run("before = 1")
    # The cell sleeps an hour: only the interrupt can end it within the waits below.
    msg_id = kernel.client.execute("import time\nprint('sleeping', flush=True)\n"
                                   "time.sleep(3600)\nafter = 1")

    def iopub(msg_type):
        """The cell's next iopub message of `msg_type` (others are passed over)."""
        def next_one():
            msg = kernel.client.get_iopub_msg(timeout=60)  # queue.Empty: a failure
            ours = msg["parent_header"].get("msg_id") == msg_id
            return msg if ours and msg["msg_type"] == msg_type else None
        return wait_for(next_one, f"the cell's {msg_type} message")

    assert iopub("stream")["content"]["text"].startswith("sleeping")
    kernel.manager.interrupt_kernel()
    reply = kernel.client.get_shell_msg(timeout=60)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    # After an error reply ipykernel aborts the requests already queued, up to when it
    # says idle; a request sent between the two would be aborted, as in any ipykernel.
    # A front end waits for idle (execute_interactive does): so does this test.
    while iopub("status")["content"]["execution_state"] != "idle":
        pass
    assert kernel.value("before") == "1"
    assert kernel.run("after")[0]["ename"] == "NameError"


def test_completion_and_inspection(kernel):
    """Completion and inspection see the names of earlier cells, from a worker."""
    kernel.run("my_variable_xyz = 12\ndisplay = 'a notebook may shadow display'")
    reply = kernel.client.complete("my_vari", 7, reply=True)["content"]
    assert reply["status"] == "ok" and "my_variable_xyz" in reply["matches"]
    assert (reply["cursor_start"], reply["cursor_end"]) == (0, 7)
    code = "my_variable_xyz.bit_l"
    reply = kernel.client.complete(code, 21, reply=True)["content"]
    # IPython 8 answers whole tokens from column 0, IPython 9 the attribute from the dot:
    # what counts is the text a front end makes by applying a match.
    applied = {code[:reply["cursor_start"]] + m + code[reply["cursor_end"]:]
               for m in reply["matches"]}
    assert "my_variable_xyz.bit_length" in applied
    assert kernel.client.complete("_snapk", 6, reply=True)["content"]["matches"] == []
    reply = kernel.client.inspect("my_variable_xyz", 3, reply=True)["content"]
    assert reply["found"] and "int" in reply["data"]["text/plain"]
    assert not kernel.client.inspect("not_defined_here", 3, reply=True)["content"]["found"]
    kernel.client.is_complete("for i in range(3):")
    reply = kernel.client.get_shell_msg(timeout=30)["content"]
    assert reply["status"] == "incomplete"


def test_restart_and_server_crash_keep_variables(kernel, data_dir):
    """A kernel restart resumes the session; so does a server killed with SIGKILL."""
    kernel.run("import numpy as np\nkept = np.arange(5) * 2\nlabel = 'mine'")
    kernel.restart()
    assert kernel.value("label") == "'mine'"
    supervisor = psutil.Process(server_info(data_dir)["pid"])
    server = supervisor.children()[0]
    server.kill()
    wait_for(lambda: not supervisor.is_running(), what="the supervisor to end with its server")
    # The next cell finds no server, starts one on the same store, and runs there.
    assert kernel.value("int(kept.sum()), label") == "(20, 'mine')"
    assert server_info(data_dir)["pid"] != supervisor.pid


def test_attach_to_a_running_server(data_dir, server):
    """With SNAPSHOT_KERNEL_URL and SNAPSHOT_KERNEL_TOKEN the kernel uses that server."""
    k = Kernel(env={"SNAPSHOT_KERNEL_URL": server.url, "SNAPSHOT_KERNEL_TOKEN": server.token,
                    "JPY_SESSION_NAME": "attached/notebook.ipynb"})
    try:
        k.run("attached = 'yes'")
        assert "jupyter/attached/notebook.ipynb/1" in server.get("/states").json()["states"]
        assert server.value("jupyter/attached/notebook.ipynb/1", "attached") == "'yes'"
    finally:
        k.stop()


def test_notebooks_match_execute(data_dir, server):
    """nbclient through the kernelspec shows, cell by cell, what /execute answers."""
    runs = run_in_jupyter(NOTEBOOKS, kernel_name=SPEC)
    problems = []
    for path in NOTEBOOKS:
        diffs = compare_notebook(runs[path], run_on_server(server))
        if diffs:
            problems.append(f"{os.path.basename(path)}:\n" + "\n\n".join(diffs))
    assert not problems, "\n\n".join(problems)


def test_papermill_parameters(data_dir, tmp_path):
    """papermill runs a parameterized notebook on the kernel."""
    papermill = pytest.importorskip("papermill")
    nb = nbformat.v4.new_notebook()
    nb.metadata.kernelspec = {"name": SPEC, "display_name": "Python (snapshot)",
                              "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("n = 1", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("print('twice n is', 2 * n)")]
    nbformat.write(nb, tmp_path / "in.ipynb")
    papermill.execute_notebook(str(tmp_path / "in.ipynb"), str(tmp_path / "out.ipynb"),
                               parameters={"n": 21}, kernel_name=SPEC, cwd=str(tmp_path),
                               progress_bar=False)
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    texts = [o.get("text", "") for c in out.cells if c.cell_type == "code" for o in c.outputs]
    assert "twice n is 42\n" in texts


def test_jupyter_console_shows_no_debugger_warning(data_dir, tmp_path):
    """`jupyter console` in a terminal: no debugpy warning (the kernel does not import
    debugpy), and the tracebacks' In[N] are the prompts' after a kernel magic."""
    pexpect = pytest.importorskip("pexpect")
    pytest.importorskip("jupyter_console")
    console = pexpect.spawn(sys.executable, ["-m", "jupyter_console", "--simple-prompt",
                                             "--kernel", SPEC],
                            cwd=str(tmp_path), env=jupyter_env(), encoding="utf-8",
                            timeout=120, dimensions=(50, 200))
    console.logfile_read = io.StringIO()  # what the terminal shows
    try:
        for line in ("1 / 0", "%states", "1 / 0"):
            console.expect(r"In \[\d+\]: ")
            console.sendline(line)
        console.expect(r"In \[4\]: ")
        seen = console.logfile_read.getvalue()
        console.sendeof()
        console.expect(r"exit \(\[y\]/n\)\? ")
        console.sendline("y")
        console.expect(pexpect.EOF)
    finally:
        console.close(force=True)
    assert "Debugger warning" not in seen and "frozen" not in seen, seen
    assert re.findall(r"Cell In\[\d+\]", seen) == ["Cell In[1]", "Cell In[3]"], seen


def test_kernels_started_outside_jupyter_server(data_dir, tmp_path):
    """nbclient (as nbconvert and papermill start kernels) gives the kernel no notebook
    path: each run is a new session named after its connection file and starts from the
    empty state, as with ipykernel; JPY_SESSION_NAME in the kernel's environment names
    the session, and the next run resumes it."""
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print('seen' in globals())"),
                nbformat.v4.new_code_cell("seen = 1"), nbformat.v4.new_code_cell("%session")]

    def run(**kwargs):
        """(the first cell's output, the session's name) of one nbclient run."""
        out = nbclient.NotebookClient(nbformat.from_dict(nb), kernel_name=SPEC,
                                      resources={"metadata": {"path": str(tmp_path)}},
                                      ).execute(**kwargs)
        first, session = ("".join(o.get("text", "") for o in out.cells[i].outputs)
                          for i in (0, 2))
        return first, re.match(r"session '([^']*)'", session).group(1)

    runs = [run(), run()]
    assert [first for first, _ in runs] == ["False\n", "False\n"]
    assert runs[0][1] != runs[1][1]
    named = str(tmp_path / "report.ipynb")
    runs = [run(env=jupyter_env({"JPY_SESSION_NAME": named})) for _ in range(2)]
    assert runs == [("False\n", named), ("True\n", named)]


def test_server_stops_when_no_kernel_is_left(data_dir):
    """Once the last kernel is gone for server_idle_s, the supervisor stops the server."""
    k = Kernel()
    k.run("1")
    supervisor = psutil.Process(server_info(data_dir)["pid"])
    server = supervisor.children()[0]
    k.stop()
    psutil.wait_procs([supervisor, server], timeout=IDLE_S + 60)
    assert not supervisor.is_running() and not server.is_running()
    assert server_info(data_dir) is None


def test_jupyterlab_in_chromium(lab):
    """In JupyterLab in a real browser: run a cell, restart the kernel, read the variable back."""
    By = lab.By
    lab.open("restart.ipynb")
    lab.run_in_last_cell("answer = 41\nprint('before restart:', answer)")
    wait_for(lambda: "before restart: 41" in lab.outputs(), what="the first cell's output")
    before = lab.kernel_pids()
    lab.browser.find_element(By.CSS_SELECTOR,
                             'jp-button[data-command="notebook:restart-kernel"]').click()
    wait_for(lambda: lab.browser.find_elements(By.CSS_SELECTOR, ".jp-Dialog .jp-mod-accept"),
             what="the restart dialog")
    lab.browser.find_element(By.CSS_SELECTOR, ".jp-Dialog .jp-mod-accept").click()
    wait_for(lambda: lab.kernel_pids() and not lab.kernel_pids() & before,
             what="a new kernel process")
    wait_for(lab.idle, timeout=120, what="the restarted kernel to be idle")
    lab.run_in_last_cell("print('after restart:', answer + 1)")
    wait_for(lambda: "after restart: 42" in lab.outputs(), what="the second cell's output")


def test_a_notebook_runs_in_its_folder_through_the_kernel(data_dir, tmp_path):
    """nbclient starts the kernel in the notebook's folder: a helper module beside the
    notebook imports, relative paths open, whatever folder started the shared server."""
    from nbclient import NotebookClient
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "helpers.py").write_text("def greet():\n    return 'hello from helpers'\n")
    (folder / "numbers.txt").write_text("1 2 3")
    nb = nbformat.v4.new_notebook()
    nb.metadata.kernelspec = {"name": SPEC, "display_name": "Python (snapshot)",
                              "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("import helpers\nhelpers.greet()"),
                nbformat.v4.new_code_cell("sum(map(int, open('numbers.txt').read().split()))"),
                nbformat.v4.new_code_cell("import os\nos.getcwd()")]
    NotebookClient(nb, kernel_name=SPEC, timeout=120,
                   resources={"metadata": {"path": str(folder)}}).execute()
    shown = [c.outputs[0]["data"]["text/plain"] for c in nb.cells]
    assert shown == ["'hello from helpers'", "6", repr(str(folder))]


def test_a_notebooks_own_modules_named_like_ours_are_the_notebooks(data_dir, tmp_path):
    """A kernel started in a folder holding `storage.py`, `kernel/`, `main.py`, ...: a
    cell imports those, not the package's modules (the kernel, its server and its
    workers import only `snapkernel`)."""
    names = ("storage", "kernel", "api", "main", "config", "protocol", "server", "worker")
    for name in names:
        path = tmp_path / (f"{name}/__init__.py" if name == "kernel" else f"{name}.py")
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"WHO = 'notebook {name}'\n")
    k = Kernel(cwd=str(tmp_path))
    try:
        assert k.text("import importlib\n"
                      f"print([importlib.import_module(n).WHO for n in {names!r}])") == \
            f"{['notebook ' + n for n in names]}\n"
    finally:
        k.stop()
