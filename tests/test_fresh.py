"""Fresh runs through the real command (`main.py run --fresh`) and the real route.

Each test checks the exit status, the receipt (against the README's
schema), the files left behind and, where processes are involved, the
process table. The other categories, through the same code in this
process: tests/test_fresh_run.py.
"""

import hashlib
import json
import os
import re
import subprocess
import sys

import jsonschema
import nbformat
import psutil
import pytest

from snapkernel.kernel import __version__
from snapkernel.kernel.notebook import receipt as receipt_mod
from support.server import ROOT

OK = "assert 2 + 2 == 4"


def readme_schema():
    """The receipt's JSON Schema as docs/fresh-runs.md prints it."""
    with open(os.path.join(ROOT, "docs", "fresh-runs.md"), encoding="utf-8") as f:
        text = f.read()
    block = re.search(r"<!-- receipt schema -->\s*```json\n(.*?)```", text, re.S)
    return json.loads(block.group(1))


def cell(source, tags=(), outputs=(), count=None):
    """A code cell (tags, stale outputs and execution count as given)."""
    c = nbformat.v4.new_code_cell(source, execution_count=count)
    if tags:
        c.metadata["tags"] = list(tags)
    c.outputs = [nbformat.from_dict(o) for o in outputs]
    return c


class Run:
    """One `main.py run --fresh` in a folder of its own: its status, stderr, receipt."""

    def __init__(self, folder, cells, *args, env=None, output=True):
        """Write the notebook of `cells`, run the command, read the receipt."""
        self.folder = folder
        self.nb = folder / "nb.ipynb"
        self.out = folder / "out.ipynb"
        self.receipt_path = folder / "receipt.json"
        notebook = nbformat.v4.new_notebook()
        notebook.cells = [c if isinstance(c, dict) else cell(c) for c in cells]
        nbformat.write(notebook, str(self.nb))
        self.source_bytes = self.nb.read_bytes()
        self.out_before = self.out.read_bytes() if self.out.exists() else None
        command = [sys.executable, "main.py", "run", str(self.nb), "--fresh",
                   "--receipt", str(self.receipt_path), *args]
        if output:
            command += ["-o", str(self.out)]
        # A run whose limits failed would go on for its cells' 10 minutes and more:
        # past this timeout, a failure.
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              env=dict(os.environ, **(env or {})), timeout=300)
        self.status, self.stderr = done.returncode, done.stderr
        assert "Traceback" not in self.stderr, self.stderr
        self.receipt = None
        if self.receipt_path.exists():
            self.receipt = json.loads(self.receipt_path.read_text())
            jsonschema.validate(self.receipt, readme_schema())

    def failed(self, category, status=1):
        """Assert the run failed with `category`, promoted nothing, left no temporary file."""
        assert self.status == status, self.stderr
        assert self.receipt["success"] is False
        assert self.receipt["category"] == category, self.receipt["message"]
        assert self.receipt["output"] is None or self.receipt["output"]["written"] is False
        assert (self.out.read_bytes() if self.out.exists() else None) == self.out_before
        assert not [p for p in os.listdir(self.folder) if p.endswith(".tmp")]
        assert self.receipt["cleanup"]["status"] == "ok"
        return self.receipt

    def cells(self, status=None):
        """The receipt's cells (those with `status`)."""
        return [c for c in self.receipt["cells"] if status is None or c["status"] == status]


def test_readme_prints_the_receipt_schema():
    assert readme_schema() == json.loads(json.dumps(receipt_mod.SCHEMA))


def test_success_writes_the_executed_notebook_and_a_receipt(tmp_path):
    source = f"print('PRINTED-7f3a')\n{OK}\n'SOURCE-91bc'"
    (tmp_path / "requirements.lock").write_text("numpy==1.26.4\n")
    run = Run(tmp_path, ["# a comment only", source, "x = 1"], "--lock",
              str(tmp_path / "requirements.lock"))
    assert run.status == 0, run.stderr
    r = run.receipt
    assert r["success"] is True and r["category"] is None
    assert r["counts"] == {"code_cells": 3, "attempted": 2, "completed": 2, "failed": 0,
                           "skipped": 0, "empty": 1, "not_run": 0}
    assert [c["status"] for c in r["cells"]] == ["empty", "ran", "ran"]
    assert [c["execution_count"] for c in r["cells"]] == [None, 1, 2]
    # The source is untouched; the executed notebook is a separate, valid file.
    assert run.nb.read_bytes() == run.source_bytes
    executed = nbformat.read(str(run.out), as_version=4)
    nbformat.validate(executed)
    assert executed.cells[1].outputs[0]["text"] == "PRINTED-7f3a\n"
    assert executed.cells[1].outputs[1]["data"]["text/plain"] == "'SOURCE-91bc'"
    assert executed.cells[1].execution_count == 1
    assert r["source"]["sha256"] == hashlib.sha256(run.source_bytes).hexdigest()
    assert r["output"] == {"path": os.path.relpath(run.out, ROOT), "written": True,
                           "sha256": hashlib.sha256(run.out.read_bytes()).hexdigest()}
    assert r["lock"]["sha256"] == hashlib.sha256(b"numpy==1.26.4\n").hexdigest()
    assert r["lock"]["path"] == os.path.relpath(tmp_path / "requirements.lock", ROOT)
    kernel = r["kernel"]
    assert kernel["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert kernel["distributions"] > 10
    assert r["output_bytes"] > 0 and r["limits"]["max_output_bytes"] == 10485760
    assert r["scope"]["network_isolation"] == "UNAVAILABLE"
    assert r["package"] == {"name": "snapshot-kernel-server", "version": __version__}
    # The zygote and the process that ran the cells live until the cleanup, so a poll
    # sees them; holders come and go between polls (a run this short may see none).
    assert r["cleanup"]["processes_observed"] >= 2
    # Neither the source nor the output text is in the receipt.
    text = run.receipt_path.read_text()
    assert "PRINTED-7f3a" not in text and "SOURCE-91bc" not in text
    # No temporary file beside the output, and the run's temporary folders are gone.
    assert sorted(os.listdir(tmp_path)) == ["nb.ipynb", "out.ipynb", "receipt.json",
                                           "requirements.lock"]


def test_failed_assertion_promotes_nothing(tmp_path):
    run = Run(tmp_path, ["open('ran-1', 'w').close()", "assert 2 + 2 == 5", "x = 1"])
    r = run.failed("CELL_ERROR")
    assert not run.out.exists()
    assert [c["status"] for c in r["cells"]] == ["ran", "failed", "not_run"]
    assert r["cells"][1]["ename"] == "AssertionError"
    assert r["counts"]["attempted"] == 2 and r["counts"]["failed"] == 1
    assert (tmp_path / "ran-1").exists()  # cells run in the notebook's folder


def test_cell_timeout(tmp_path):
    # The run's deadline (2 minutes) is the backstop: a cell timeout that fails shows as
    # RUN_TIMEOUT.
    run = Run(tmp_path, ["import time\ntime.sleep(3600)"], "--cell-timeout", "1",
              "--timeout", "120")
    r = run.failed("CELL_TIMEOUT")
    assert r["cells"][0]["category"] == "CELL_TIMEOUT"
    assert r["limits"]["cell_timeout_s"] == 1


def test_run_deadline_stops_a_cell_that_ignores_interrupts(tmp_path):
    sleeper = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n" \
              "time.sleep(3600)"
    run = Run(tmp_path, [OK, sleeper, "x = 1"], "--timeout", "12", "--cell-timeout", "0")
    r = run.failed("RUN_TIMEOUT")
    assert [c["status"] for c in r["cells"]] == ["ran", "failed", "not_run"]
    assert r["limits"]["timeout_s"] == 12 and r["limits"]["cell_timeout_s"] == 0


LEAVES_PROCESSES = """\
import os, subprocess, time
os.system("sleep 1000 & echo $! > bg.pid")
p = subprocess.Popen(["sleep", "1000"])
open("popen.pid", "w").write(str(p.pid))
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        time.sleep(1000)
    os._exit(0)
os.close(w)
open("daemon.pid", "w").write(os.read(r, 100).decode())
"""


@pytest.mark.parametrize("ending", ["success", "timeout"])
def test_every_process_the_run_started_is_gone(tmp_path, ending):
    cells = [LEAVES_PROCESSES]
    args = ()
    if ending == "timeout":
        cells.append("import time\ntime.sleep(3600)")
        args = ("--timeout", "15")
    run = Run(tmp_path, cells, *args)
    pids = {name: int((tmp_path / f"{name}.pid").read_text())
            for name in ("bg", "popen", "daemon")}
    if ending == "success":
        assert run.status == 0, run.stderr
    else:
        run.failed("RUN_TIMEOUT")
    alive = {name: pid for name, pid in pids.items() if psutil.pid_exists(pid)}
    assert not alive, [psutil.Process(p).as_dict(["name", "status", "ppid"])
                       for p in alive.values()]
    assert run.receipt["cleanup"]["status"] == "ok"
    assert run.receipt["cleanup"]["processes_left"] == 0
    # The three the cell left run until cleanup, so they are observed at the latest then;
    # the run's own workers count only when a poll happened to see them.
    assert run.receipt["cleanup"]["processes_observed"] >= 3


def test_callers_variables_never_reach_the_notebook(tmp_path):
    check = ("import os\nassert 'MY_API_TOKEN' not in os.environ\n"
             "assert 'SNAPSHOT_KERNEL_TOKEN' not in os.environ\n"
             "assert 'UNLISTED' not in os.environ\n"
             "assert os.environ['MY_SETTING'] == '42'\n"
             f"assert os.environ['HOME'] != {os.path.expanduser('~')!r}\n"
             "assert os.environ['IPYTHONDIR'].startswith(os.environ['HOME'])\n"
             f"assert os.getcwd() == {str(tmp_path)!r}")
    env = {"MY_API_TOKEN": "secret-1", "SNAPSHOT_KERNEL_TOKEN": "secret-2",
           "UNLISTED": "x", "MY_SETTING": "42"}
    run = Run(tmp_path, [check], "--env", "MY_SETTING", env=env)
    assert run.status == 0, run.receipt["message"]
    assert "MY_SETTING" in run.receipt["environment"]["variables"]
    assert "secret" not in run.receipt_path.read_text()
    # Asking for it by name is refused before anything runs.
    (tmp_path / "receipt.json").unlink()
    run = Run(tmp_path, ["open('ran', 'w').close()"], "--env", "MY_API_TOKEN", env=env,
              output=False)
    r = run.failed("BAD_INPUT", status=2)
    assert "MY_API_TOKEN" in r["message"] and "TOKEN" in run.stderr
    assert not (tmp_path / "ran").exists()


def test_stale_outputs_are_cleared(tmp_path):
    stale = [{"output_type": "stream", "name": "stdout", "text": "stale\n"}]
    cells = [cell("print('new')", outputs=stale, count=41),
             cell("print('never')", tags=["no-execute"], outputs=stale, count=42)]
    cells[0].metadata["execution"] = {"iopub.execute_input": "2020-01-01T00:00:00Z"}
    run = Run(tmp_path, cells)
    assert run.status == 0, run.stderr
    executed = nbformat.read(str(run.out), as_version=4)
    assert executed.cells[0].outputs == [{"output_type": "stream", "name": "stdout",
                                          "text": "new\n"}]
    assert executed.cells[0].execution_count == 1
    # The stale timing is replaced by this run's, nbclient's four keys.
    timing = executed.cells[0].metadata["execution"]
    assert len(timing) == 4 and "2020" not in timing["iopub.execute_input"]
    assert "execution" not in executed.cells[1].metadata
    assert executed.cells[1].outputs == [] and executed.cells[1].execution_count is None
    assert run.nb.read_bytes() == run.source_bytes  # the source keeps its own


def test_tagged_cells_are_skipped_and_counted(tmp_path):
    run = Run(tmp_path, [OK, cell("raise SystemExit('no')", tags=["no-execute"]),
                         cell("1 / 0", tags=["skip-execution"]), "y = 2"])
    assert run.status == 0, run.stderr
    assert [c["status"] for c in run.receipt["cells"]] == ["ran", "skipped", "skipped", "ran"]
    assert run.receipt["counts"]["skipped"] == 2 and run.receipt["counts"]["completed"] == 2


def test_all_skipped_fails(tmp_path):
    run = Run(tmp_path, [cell(OK, tags=["no-execute"]), "", cell("1", tags=["skip-execution"])])
    r = run.failed("ALL_SKIPPED")
    assert r["counts"]["skipped"] == 2 and r["counts"]["attempted"] == 0
    assert r["cleanup"]["processes_observed"] == 0  # no kernel was started


def test_no_code_fails(tmp_path):
    run = Run(tmp_path, [nbformat.v4.new_markdown_cell("# Title"), "", "  \n# nothing\n"])
    r = run.failed("NO_CODE")
    assert r["counts"]["empty"] == 2


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    (tmp_path / "out.ipynb").write_text("old")
    run = Run(tmp_path, ["open('ran', 'w').close()"])
    run.failed("OUTPUT_EXISTS", status=2)
    assert (tmp_path / "out.ipynb").read_text() == "old"
    assert not (tmp_path / "ran").exists()
    run = Run(tmp_path, [OK], "--overwrite")
    assert run.status == 0, run.stderr
    nbformat.validate(nbformat.read(str(run.out), as_version=4))


def test_source_edited_during_the_run(tmp_path):
    run = Run(tmp_path, ["with open('nb.ipynb', 'a') as f:\n    f.write(' ')"])
    r = run.failed("SOURCE_CHANGED")
    assert r["counts"]["completed"] == 1
    assert not run.out.exists()


def test_environment_mismatch_refuses_before_any_cell(tmp_path):
    run = Run(tmp_path, ["open('ran', 'w').close()"], "--expected-environment", "0" * 64)
    r = run.failed("ENVIRONMENT_MISMATCH")
    assert not (tmp_path / "ran").exists()
    measured = r["kernel"]["environment_sha256"]
    run = Run(tmp_path, [OK], "--expected-environment", measured)
    assert run.status == 0 and run.receipt["kernel"]["environment_sha256"] == measured


def config_file(tmp_path, text):
    """A --config file with `text`."""
    path = tmp_path.parent / f"{tmp_path.name}-config.toml"
    path.write_text(text)
    return str(path)


def test_output_limit(tmp_path):
    conf = config_file(tmp_path, "[fresh]\nmax_output_bytes = 100000\n")
    run = Run(tmp_path, ["print('x' * 60000)", "print('y' * 60000)", "z = 1"],
              "--config", conf)
    r = run.failed("OUTPUT_LIMIT")
    assert 60000 < r["output_bytes"] <= 100000
    assert [c["status"] for c in r["cells"]] == ["ran", "failed", "not_run"]


def test_bad_command_lines(tmp_path):
    def command(*args):
        done = subprocess.run([sys.executable, "main.py", "run", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        return done.stderr

    nb = tmp_path / "nb.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[cell(OK)]), str(nb))
    assert "only with --fresh" in command(str(nb), "--receipt", str(tmp_path / "r.json"))
    assert "not with --fresh" in command(str(nb), "--fresh", "--rerun", "a")
    assert "differ" in command(str(nb), "--fresh", "-o", str(nb))
    assert "would overwrite" in command(str(nb), "--fresh", "--receipt", str(nb))
    assert nbformat.read(str(nb), as_version=4).cells[0].source == OK
    (tmp_path / "bad.ipynb").write_text("{not json")
    assert "is not a Jupyter notebook" in command(str(tmp_path / "bad.ipynb"), "--fresh")
    assert "cannot read" in command(str(tmp_path / "missing.ipynb"), "--fresh")


def test_fresh_run_over_http(server, tmp_path):
    cells = [{"id": "a", "source": "x = 2 + 2\nprint(x)"},
             {"id": "b", "source": "1 / 0", "tags": ["no-execute"]},
             {"id": "c", "source": "assert x == 4\nx"}]
    r = server.post("/notebooks/run", {"notebook": "nb", "cells": cells, "fresh": True,
                                       "cwd": str(tmp_path)})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [c["status"] for c in answer["cells"]] == ["ran", "skipped", "ran"]
    assert answer["cells"][0]["outputs"] == [{"output_type": "stream", "name": "stdout",
                                              "text": "4\n"}]
    assert answer["order"] == ["a", "c"] and answer["state_name"] is None
    receipt = answer["receipt"]
    jsonschema.validate(receipt, readme_schema())
    assert receipt["success"] is True and receipt["output"] is None
    r = server.post("/notebooks/run", {"notebook": "nb", "cells": cells, "fresh": True,
                                       "env": ["AWS_SECRET_ACCESS_KEY"]})
    assert r.status_code == 400 and "SECRET" in r.json()["error"]["message"]
    r = server.post("/notebooks/run", {"notebook": "nb", "cells": [cells[0], cells[0]],
                                       "fresh": True})
    assert r.status_code == 400, r.text
    assert "cell id 'a' appears more than once" in r.json()["error"]["message"]
    # The options of each kind of run are refused on the other.
    # (timeout and cell_timeout are for both: docs/papermill.md.)
    r = server.post("/notebooks/run", {"notebook": "nb", "cells": cells, "env": ["HOME"]})
    assert r.status_code == 400 and "fresh" in r.json()["error"]["message"]
    r = server.post("/notebooks/run", {"notebook": "nb", "cells": cells, "fresh": True,
                                       "order": "dataflow"})
    assert r.status_code == 400 and "order" in r.json()["error"]["message"]


def test_a_cell_printing_past_the_output_limit_fails_the_run(tmp_path):
    """The run's limit counts what the cell produced, not what a per-cell cut kept: 20 MB
    printed against the default 10 MiB fails, and nothing is promoted."""
    run = Run(tmp_path, ["print('x' * 20_000_000)", "z = 1"])
    r = run.failed("OUTPUT_LIMIT")
    assert [c["status"] for c in r["cells"]] == ["failed", "not_run"]
    assert r["output"]["written"] is False and not os.path.exists(run.out)
