"""A second run with nothing changed runs nothing, failures let pass included; a cell
that runs says why, and a reused cell whose result its code does not determine (the
clock, an unseeded generator) says so (issue 41 item 6).

Real runs of `python main.py run` (serverless and through a server) and of POST
/notebooks/run, compared with nbclient's Run All with allow_errors.
"""

import os
import re
import subprocess
import sys

import pytest

from support.fidelity import run_in_jupyter
from support.notebook import cell, code_cells, notebook, run, statuses, text
from support.server import ROOT, TOKEN

# Deliberate and accidental failures of everyday code, with cells after them that see
# what the failing cells did before they raised.
FAILING = [
    "x = 1\ntup = (1, 2)",
    "tup[1] = 5",                                  # fails; "writes" tup for the parse
    "y = x + len(tup)\nprint(y)",
    "z = 10\nq = 1 / 0\nnever = 1",                # fails after binding z
    "print(z + y, 'never' in dir())",
    "import numpy as np\nnp.array([1, 2]).reshape(3)",
    "print(np.arange(3).sum())",
]


def run_cli(path, *args):
    """`main.py run PATH ARGS`: ({cell id: status}, stderr)."""
    done = subprocess.run([sys.executable, "main.py", "run", str(path), *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return dict(re.findall(r"^cell \d+ \((c\d+)\): (\w+)", done.stderr, re.M)), done.stderr


def shown(path):
    """[(text, error name and value or None)] of each code cell of a notebook file."""
    found = []
    for c in code_cells(path):
        errors = [(o.ename, o.evalue) for o in c.outputs if o.output_type == "error"]
        found.append((text(c), errors[0] if errors else None))
    return found


@pytest.fixture(params=["here", "server"])
def how(request, make_server, tmp_path):
    """The command's arguments for a run serverless on a store, or through a server."""
    if request.param == "here":
        return ["--data-dir", tmp_path / "store"]
    srv = make_server(tmp_path / "store")
    return ["--server", srv.url, "--token", TOKEN]


def test_failures_let_pass_are_reused_when_nothing_changed(tmp_path, how):
    """Run twice with --allow-errors: the second run runs nothing and shows what the
    first showed, which is what nbclient's Run All with allow_errors shows; a run
    without --allow-errors then stops at the first failure, as Jupyter does."""
    src = notebook(tmp_path / "nb.ipynb", *FAILING)
    first, _ = run_cli(src, "-o", tmp_path / "one.ipynb", "--allow-errors", *how)
    assert [first[f"c{n}"] for n in (1, 3, 5)] == ["failed"] * 3, first
    second, err = run_cli(src, "-o", tmp_path / "two.ipynb", "--allow-errors", *how)
    assert set(second.values()) == {"reused"}, err
    assert shown(tmp_path / "one.ipynb") == shown(tmp_path / "two.ipynb")
    jupyter = tmp_path / "jupyter" / "nb.ipynb"
    os.makedirs(jupyter.parent)
    notebook(jupyter, *FAILING)
    expected = run_in_jupyter([str(jupyter)], slots=1, in_own_folder=True)[str(jupyter)]
    ours = shown(tmp_path / "two.ipynb")
    for n, (_, outputs) in enumerate(expected):
        errors = [(o.ename, o.evalue) for o in outputs if o.output_type == "error"]
        printed = "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                          for o in outputs if o.output_type != "error")
        assert ours[n] == (printed, errors[0] if errors else None), n
    strict = subprocess.run([sys.executable, "main.py", "run", str(src), "-o",
                             tmp_path / "three.ipynb", *map(str, how)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert strict.returncode == 1, strict.stderr
    found = dict(re.findall(r"^cell \d+ \((c\d+)\): (\w+)", strict.stderr, re.M))
    assert found == {"c0": "reused", "c1": "failed", **{f"c{n}": "not_run" for n in
                                                        range(2, 7)}}, strict.stderr


def test_a_failure_from_outside_the_key_is_tried_again_and_says_so(server):
    """A network error (any OSError) is not kept: the next run tries the cell again,
    with the reason, and the cells after it run because it ran."""
    nb = [{"id": "c0", "source": "x = 1\nraise ConnectionError('the network is down')"},
          {"id": "c1", "source": "print(x + 1)"},
          {"id": "c2", "source": "w = 3"}]
    first = run(server, "outside", nb, allow_errors=True)
    assert statuses(first) == {"c0": "failed", "c1": "ran", "c2": "ran"}
    assert {c["reason"]["kind"] for c in first["cells"]} == {"new"}
    again = run(server, "outside", nb, allow_errors=True)
    assert statuses(again) == {"c0": "failed", "c1": "ran", "c2": "reused"}
    assert cell(again, "c0")["reason"]["kind"] == "failed_before"
    assert "ConnectionError" in cell(again, "c0")["reason"]["message"]
    assert cell(again, "c1")["reason"] == {"kind": "input_ran", "message":
                                           "cell 'c0', which it depends on, ran"}
    assert cell(again, "c2")["reason"] is None


def test_each_reason_a_cell_runs_is_given(server, tmp_path):
    """source changed, an input changed, rerun asked, a volatile value needed, a file
    read changed, a file written gone, a local module changed: each is the reason."""
    folder = tmp_path / "nb"
    folder.mkdir()
    (folder / "data.txt").write_text("1\n")
    (folder / "helpers.py").write_text("K = 1\n")
    nb = [{"id": "c0", "source": "x = int(open('data.txt').read())"},
          {"id": "c1", "source": "y = x + 1"},
          {"id": "c2", "source": "gen = (i for i in range(10))"},
          {"id": "c3", "source": "first = next(gen)"},
          {"id": "c4", "source": "with open('out.txt', 'w') as f:\n    f.write('hi')"},
          {"id": "c5", "source": "import helpers\nk = helpers.K"}]

    def again(**fields):
        """Run the notebook; {cell id: reason kind} of the cells that ran."""
        answer = run(server, "why", nb, cwd=str(folder), **fields)
        return {c["id"]: c["reason"]["kind"] for c in answer["cells"]
                if c["status"] == "ran"}, answer

    assert set(again()[0].values()) == {"new"}
    assert again()[0] == {}
    nb[1]["source"] = "y = x + 2"
    assert again()[0] == {"c1": "source_changed"}
    reasons, answer = again(rerun=["c0"])
    assert reasons == {"c0": "rerun", "c1": "rerun"}
    assert cell(answer, "c1")["reason"]["message"] == \
        "rerun asked for cell 'c0', which it depends on"
    (folder / "data.txt").write_text("2\n")
    reasons, answer = again()
    assert reasons == {"c0": "file_changed", "c1": "input_ran"}
    assert "data.txt" in cell(answer, "c0")["reason"]["message"]
    nb[3]["source"] = "first = next(gen) + 100"
    assert again()[0] == {"c2": "volatile", "c3": "source_changed"}
    os.remove(folder / "out.txt")
    assert again()[0] == {"c4": "wrote_file"}
    (folder / "helpers.py").write_text("K = 2\n")
    reasons, answer = again()
    assert reasons == {"c5": "module_changed"}
    assert "helpers" in cell(answer, "c5")["reason"]["message"]
    # Another notebook stores x = 5; edited to it here, c0 is reused and c1 runs for its
    # input, which changed without running.
    run(server, "other", [{"id": "c0", "source": "x = 5"}], cwd=str(folder))
    nb[0]["source"] = "x = 5"
    reasons, answer = again()
    assert statuses(answer)["c0"] == "reused"
    assert reasons == {"c1": "input_changed"}


def test_clock_and_unseeded_generators_are_reported_when_reused(tmp_path):
    """A reused cell that reads the clock or draws from an unseeded global generator
    says so, in its progress line and the run's diagnostics; a seeded one does not."""
    src = notebook(tmp_path / "nb.ipynb",
                   "import numpy as np\ntoday = np.datetime64('today')\nprint(today)",
                   "import datetime\nstamp = datetime.datetime.now()",
                   "import random\nr = random.random()",
                   "np.random.seed(0)\nprint(np.random.rand(2))",
                   "import uuid\nu = uuid.uuid4()",
                   "print(1 + 1)")
    store = tmp_path / "store"
    first, err = run_cli(src, "--data-dir", store)
    assert "reads the clock" not in err
    second, err = run_cli(src, "--data-dir", store)
    assert set(second.values()) == {"reused"}, err
    lines = {m[0]: m[1] for m in re.findall(r"^cell \d+ \((c\d+)\): reused(.*)$", err, re.M)}
    assert "reads the clock (np.datetime64('today'))" in lines["c0"]
    assert "rerun it for the time now" in lines["c0"]
    assert "reads the clock (datetime.datetime.now())" in lines["c1"]
    assert "unseeded generator (random.random())" in lines["c2"]
    assert lines["c3"] == "" and lines["c5"] == ""
    assert "unseeded generator (uuid.uuid4())" in lines["c4"]
    assert re.search(r"^cell 'c0': it reads the clock .* its stored result is from "
                     r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", err, re.M), err
