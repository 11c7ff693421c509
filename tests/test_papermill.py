"""`run` as a papermill and nbclient user expects it: parameters, output notebooks,
timeouts, checks before running, and the messages (issue 44), compared where possible
with what papermill and nbclient themselves write."""

import json
import os
import socket
import subprocess
import sys

import nbformat
import pytest

from support.notebook import code_cells, run_cli, text
from support.server import ROOT, TOKEN


def tagged_notebook(path, cells):
    """Write a Python notebook of (source, tags) code cells c0, c1, ... after a markdown
    cell."""
    nb = nbformat.v4.new_notebook()
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3",
                              "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell("# Parametrised")]
    for n, (source, tags) in enumerate(cells):
        cell = nbformat.v4.new_code_cell(source, id=f"c{n}")
        if tags:
            cell.metadata.tags = list(tags)
        nb.cells.append(cell)
    nbformat.write(nb, str(path))
    return path


PARAMETRISED = [("alpha = 0.1\nname = 'x'\nsizes = [1]", ["parameters"]),
                ("print(alpha * 2)", []),
                ("print(name, sizes)", []),
                ("z = 40 + 2\nz", [])]
# -p values as papermill reads them, a YAML text and a YAML file.
PARAMETERS = ["-p", "alpha", "0.5", "-p", "name", 'say "hi" é', "-p", "flag", "True",
              "-p", "n", "1e3", "-r", "raw", "7", "-y", "sizes: [1, 2.5, null]"]


def papermill_prepared(src, out, *args):
    """The notebook papermill writes for `src` with these parameters, not executed."""
    done = subprocess.run([sys.executable, "-m", "papermill", "--prepare-only", str(src),
                           str(out), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return nbformat.read(str(out), as_version=4)


def injected(nb):
    """(position, cell) of the notebook's injected-parameters cells."""
    return [(n, c) for n, c in enumerate(nb.cells)
            if "injected-parameters" in c.get("metadata", {}).get("tags", [])]


def test_parameters_are_injected_as_papermill_injects_them(tmp_path):
    src = tagged_notebook(tmp_path / "nb.ipynb", PARAMETRISED)
    params_file = tmp_path / "params.yaml"
    params_file.write_text("alpha: 0.25\nwhen: 2024-01-02\n")
    args = PARAMETERS + ["-f", params_file]
    theirs = papermill_prepared(src, tmp_path / "pm.ipynb", *map(str, args))
    out = tmp_path / "out.ipynb"
    done = run_cli(src, "-o", out, "--data-dir", tmp_path / "store", *args)
    assert done.returncode == 0, done.stderr
    ours = nbformat.read(str(out), as_version=4)
    [(at, cell)] = injected(ours)
    [(their_at, their_cell)] = injected(theirs)
    assert at == their_at == 2  # right after the cell tagged parameters
    assert cell.source == their_cell.source  # papermill without black: the same text
    assert cell.metadata.tags == their_cell.metadata.tags == ["injected-parameters"]
    assert ours.metadata.papermill.parameters == theirs.metadata.papermill.parameters
    assert ours.metadata.papermill.parameters["when"] == "2024-01-02"  # no dates, as papermill
    cells = code_cells(out)
    assert text(cells[2]) == "1.0\n"  # -p alpha 0.5 won over the file's 0.25
    assert text(cells[3]) == 'say "hi" é [1, 2.5, None]\n'
    assert "cell 3 (injected-parameters): ran" in done.stderr
    # Running papermill's own output again replaces its injected cell, not adds one.
    again = run_cli(tmp_path / "pm.ipynb", "--data-dir", tmp_path / "store", "-p", "alpha",
                    "2")
    assert again.returncode == 0, again.stderr
    rerun = nbformat.read(str(tmp_path / "pm.ipynb"), as_version=4)
    [(_, cell)] = injected(rerun)
    assert cell.source == "# Parameters\nalpha = 2\n"
    assert text(code_cells(tmp_path / "pm.ipynb")[2]) == "4\n"


def test_a_parameter_value_runs_again_what_depends_on_it(tmp_path):
    src = tagged_notebook(tmp_path / "nb.ipynb", PARAMETRISED)
    data = tmp_path / "store"
    first = run_cli(src, "-o", tmp_path / "a.ipynb", "--data-dir", data, "-p", "alpha", "1")
    assert first.returncode == 0, first.stderr
    same = run_cli(src, "-o", tmp_path / "b.ipynb", "--data-dir", data, "-p", "alpha", "1")
    assert same.stderr.count(": reused") == 5, same.stderr
    other = run_cli(src, "-o", tmp_path / "c.ipynb", "--data-dir", data, "-p", "alpha", "3")
    assert other.returncode == 0, other.stderr
    lines = other.stderr.splitlines()
    # The injected cell (it sets alpha only) and the cell reading alpha run; the parameters
    # cell, the one reading its other names and the one reading none are reused.
    assert [line.split(" in ")[0] for line in lines[:5]] == [
        "cell 2 (c0): reused", "cell 3 (injected-parameters): ran", "cell 4 (c1): ran",
        "cell 5 (c2): reused", "cell 6 (c3): reused"]
    assert text(code_cells(tmp_path / "c.ipynb")[2]) == "6\n"
    # No cell tagged parameters: the injected cell opens the notebook, as papermill puts it.
    untagged = tagged_notebook(tmp_path / "plain.ipynb", [("print(alpha)", [])])
    done = run_cli(untagged, "--data-dir", data, "-p", "alpha", "5")
    assert done.returncode == 0, done.stderr
    cells = code_cells(untagged)
    assert cells[0].metadata.tags == ["injected-parameters"] and text(cells[1]) == "5\n"
    refused = run_cli(untagged, "--data-dir", data, "-p", "not-a-name", "1")
    assert refused.returncode == 2 and "not-a-name" in refused.stderr
    assert "usage: main.py run" in refused.stderr


def test_parameters_through_the_route_and_in_a_fresh_receipt(server, tmp_path):
    cells = [{"id": "p", "source": "alpha = 1", "tags": ["parameters"]},
             {"id": "use", "source": "alpha * 10"}]
    r = server.post("/notebooks/run", {"notebook": "params-route", "cells": cells,
                                       "parameters": {"alpha": 4}})
    assert r.status_code == 200, r.text
    record = r.json()
    assert [c["id"] for c in record["cells"]] == ["p", "injected-parameters", "use"]
    assert record["cells"][2]["outputs"][0]["data"]["text/plain"] == "40"
    bad = server.post("/notebooks/run", {"notebook": "params-route", "cells": cells,
                                         "parameters": {"1x": 4}})
    assert bad.status_code == 400 and "1x" in bad.json()["error"]["message"]
    fresh = server.post("/notebooks/run", {"notebook": "params-fresh", "cells": cells,
                                           "parameters": {"alpha": 5}, "fresh": True})
    assert fresh.status_code == 200, fresh.text
    assert fresh.json()["receipt"]["parameters"] == {"alpha": 5}
    assert fresh.json()["cells"][2]["outputs"][0]["data"]["text/plain"] == "50"
    src = tagged_notebook(tmp_path / "nb.ipynb", [("alpha = 1", ["parameters"]),
                                                  ("print(alpha)", [])])
    receipt = tmp_path / "receipt.json"
    done = run_cli(src, "--fresh", "-o", tmp_path / "out.ipynb", "--receipt", receipt,
                   "-p", "alpha", "6")
    assert done.returncode == 0, done.stderr
    assert json.loads(receipt.read_text())["parameters"] == {"alpha": 6}
    assert text(code_cells(tmp_path / "out.ipynb")[2]) == "6\n"


def nbclient_executed(path):
    """The notebook as nbclient executes it (record_timing on, its default)."""
    from nbclient import NotebookClient
    nb = nbformat.read(str(path), as_version=4)
    NotebookClient(nb, kernel_name="python3", timeout=120).execute()
    return nb


def test_output_notebooks_carry_what_nbclient_writes(tmp_path):
    src = tagged_notebook(tmp_path / "nb.ipynb", [("x = 1", []), ("y = 2", []),
                                                  ("x + y", [])])
    theirs = nbclient_executed(src)
    data = tmp_path / "store"
    out = tmp_path / "out.ipynb"
    assert run_cli(src, "-o", out, "--data-dir", data).returncode == 0
    ours = nbformat.read(str(out), as_version=4)
    assert ours.metadata.language_info == theirs.metadata.language_info
    for mine, their in zip(code_cells(out), [c for c in theirs.cells
                                             if c.cell_type == "code"]):
        assert set(mine.metadata.execution) == set(their.metadata.execution)
        assert all(v.endswith("Z") for v in mine.metadata.execution.values())
        assert "snapkernel" not in mine.metadata
    first = [c.metadata.execution for c in code_cells(out)]
    # Another notebook of the same cells in another order: every result is reused, its
    # counts are 1..N in notebook order (they were 2, 1, 3: the runs that made them), and
    # each shows the timings of the run that made it and says it was reused.
    swapped = tagged_notebook(tmp_path / "swapped.ipynb", [("y = 2", []), ("x = 1", []),
                                                           ("x + y", [])])
    done = run_cli(swapped, "--data-dir", data)
    assert done.stderr.count(": reused") == 3, done.stderr
    cells = code_cells(swapped)
    assert [c.execution_count for c in cells] == [1, 2, 3]
    assert cells[2].outputs[0].execution_count == 3
    assert [c.metadata.execution for c in cells] == [first[1], first[0], first[2]]
    assert all(c.metadata.snapkernel == {"reused": True} for c in cells)


def sleepy_notebook(path):
    """x set, then a cell that sets y and sleeps, one reading x, one reading y."""
    return tagged_notebook(path, [("x = 1", []), ("import time\ny = 2\ntime.sleep(120)", []),
                                  ("print(x)", []), ("print(y)", [])])


def test_cell_and_run_timeouts_on_incremental_runs(make_server, tmp_path):
    src = sleepy_notebook(tmp_path / "nb.ipynb")
    data = tmp_path / "store"
    out = tmp_path / "out.ipynb"
    stopped = run_cli(src, "-o", out, "--data-dir", data, "--cell-timeout", "1")
    assert stopped.returncode == 1, stopped.stderr
    assert "cell 3 (c1): failed" in stopped.stderr and "Timeout" in stopped.stderr
    cells = code_cells(out)
    assert [o.ename for o in cells[1].outputs if o.output_type == "error"] == ["Timeout"]
    assert cells[2].execution_count is None and cells[3].execution_count is None
    # --allow-errors goes on: a cell that needs nothing of it runs, one that needs it
    # cannot (the timed-out cell kept no state).
    went_on = run_cli(src, "-o", out, "--data-dir", data, "--cell-timeout", "1",
                      "--allow-errors")
    assert "cell 4 (c2): ran" in went_on.stderr and "cell 5 (c3): blocked" in went_on.stderr
    assert text(code_cells(out)[2]) == "1\n"
    whole = run_cli(src, "-o", out, "--data-dir", data, "--timeout", "2", "--allow-errors")
    assert whole.returncode == 1
    assert "went past its timeout of 2 s" in whole.stderr and "cell 4 (c2): not_run" in \
        whole.stderr, whole.stderr
    srv = make_server(data)
    cells = [{"id": c.id, "source": c.source} for c in code_cells(src)]
    r = srv.post("/notebooks/run", {"notebook": "timeouts", "cells": cells,
                                    "cell_timeout": 1, "allow_errors": True})
    assert r.status_code == 200, r.text
    timed_out = r.json()["cells"][1]
    assert timed_out["status"] == "failed" and timed_out["error"]["ename"] == "Timeout"
    assert timed_out["state_name"] is None
    assert f"nb-{timed_out['key']}" not in srv.get("/states").json()["states"]
    assert srv.post("/notebooks/run", {"notebook": "timeouts", "cells": cells,
                                       "cell_timeout": -1}).status_code == 400


def test_checked_before_anything_runs(tmp_path):
    marker = tmp_path / "ran"
    src = tagged_notebook(tmp_path / "nb.ipynb", [(f"open({str(marker)!r}, 'w').close()",
                                                   [])])
    missing = run_cli(src, "-o", tmp_path / "no" / "out.ipynb", "--data-dir",
                      tmp_path / "store")
    assert missing.returncode == 2, missing.stderr
    assert "folder" in missing.stderr and "does not exist" in missing.stderr
    assert not marker.exists()  # refused before the cell ran
    cwd = run_cli(src, "--data-dir", tmp_path / "store", "--cwd", tmp_path / "nowhere")
    assert cwd.returncode == 2 and "is not a folder" in cwd.stderr
    assert "on the server" not in cwd.stderr
    before = src.read_bytes()
    fresh = run_cli(src, "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert "no notebook written" in fresh.stderr and src.read_bytes() == before


def serve(tmp_path, *args):
    """`main.py serve` that must fail to start; the CompletedProcess."""
    return subprocess.run([sys.executable, "main.py", "serve", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_a_server_that_cannot_start_says_why_in_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = serve(tmp_path, "--bind", f"127.0.0.1:{port}", "--no-auth", "--data-dir",
                      tmp_path / "a")
    # 192.0.2.0/24 is TEST-NET-1, never an address of this machine.
    foreign = serve(tmp_path, "--bind", "192.0.2.1:8080", "--token", TOKEN, "--data-dir",
                    tmp_path / "b")
    (tmp_path / "bad.pem").write_text("not a certificate\n")
    (tmp_path / "tls.toml").write_text(f'[server]\ncertfile = "{tmp_path}/bad.pem"\n'
                                       f'keyfile = "{tmp_path}/bad.pem"\n')
    cert = serve(tmp_path, "--bind", "127.0.0.1:0", "--no-auth", "--data-dir", tmp_path / "c",
                 "--config", tmp_path / "tls.toml")
    for done, words, store in [(taken, "Address already in use", "a"),
                               (foreign, "Cannot assign requested address", "b"),
                               (cert, "not a PEM certificate", "c")]:
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and words in done.stderr, \
            done.stderr
        assert not (tmp_path / store).exists()  # no store, no server.lock


def test_messages_name_the_program_and_say_each_thing_once(tmp_path):
    console = os.path.join(os.path.dirname(sys.executable), "snapshot-kernel")
    data_home = tmp_path / "xdg"
    env = dict(os.environ, XDG_DATA_HOME=str(data_home), COLUMNS="400")  # no wrapping
    helped = subprocess.run([console, "run", "--help"], capture_output=True, text=True,
                            timeout=60, env=env)
    assert helped.stdout.startswith("usage: snapshot-kernel run"), helped.stdout
    assert str(data_home / "snapshot-kernel" / "store") in helped.stdout
    assert "default: config.toml" not in helped.stdout
    assert run_cli("--help").stdout.startswith("usage: main.py run")
    src = tagged_notebook(tmp_path / "nb.ipynb", [("import ctypes\nctypes.string_at(0)",
                                                   [])])
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    unreachable = run_cli(src, "--server", f"http://127.0.0.1:{port}")
    assert unreachable.returncode == 2
    assert unreachable.stderr.count("cannot reach the server") == 1, unreachable.stderr
    crashed = run_cli(src, "--data-dir", tmp_path / "store")
    assert crashed.returncode == 1
    assert "was killed by signal SIGSEGV (a crash in native code" in crashed.stderr
    assert "cell 2 (c0): failed" in crashed.stderr
    out = code_cells(src)[0].outputs[0]
    assert "fix the cell, then run it again" in out.evalue
