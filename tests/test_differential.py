"""The differential tester (issue 41 item 5): generated sequences of what users do to a
notebook, each step checked against a clean Run All.

A hypothesis state machine holds a small notebook (cells drawn from a grammar of
ordinary notebook code, below), the folder it lives in (a helper module it imports, data
files it reads, files its cells write) and the stores of the servers it runs on. Its
rules are what a user does: edit, insert, delete and move cells; edit the helper module
or a data file; restart the server; run under eviction (a server that keeps one live
holder); run a copy of the notebook from another folder on the same store; run through
a second server on the same S3 bucket (moto's server); run serverless; run again with
nothing changed. After every step the notebook runs through the path under test
(`main.py run --server URL --allow-errors`, or serverless `run`), and every cell's
outputs and error are compared with a clean Run All of the same notebook: nbclient with
ipykernel in a copy of the folder as it was just before the run (`Reference`), and the
folder's files afterwards with that copy's. The comparison is test_fidelity's
(stream text and every text MIME normalised the same way; images by their PNG size, so a
figure drawn at the wrong size shows). A run again with nothing changed must also run
no cell that succeeded before (item 6).

Every defect it found is a plain test in tests/test_regressions_trust.py.

Determinism: the default-suite test is derandomized (the same few examples on every
run: a failure in CI is always the code's, and reproduces), so it is a fixed sample;
the marked long run (`-m differential`, DIFFTEST_SECONDS bounds it) draws new examples
every time and keeps what it finds in hypothesis' example database (.hypothesis/), so
a failing sequence replays first next time.
"""

import glob
import hashlib
import json
import os
import shutil
import tempfile
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, precondition, rule,
                                 run_state_machine_as_test)

from support.fidelity import compare_cell, run_in_jupyter
from support.notebook import png_sizes, run_command, write_notebook
from support.server import TOKEN, Server


HELPER = "VALUE = {n}\n\n\ndef scale(x):\n    return x * {n} + 1\n"
DATA = {
    "data.csv": lambda n: "x,y\n" + "".join(f"{i},{i * n}\n" for i in range(4)),
    "data.txt": lambda n: f"value {n}\n" * 2,
    "data.json": lambda n: json.dumps({"n": n, "items": list(range(n % 4))}),
}

# The grammar: (idiom, source with {n}). Names a cell reads may not exist (an earlier
# cell deleted or moved): the NameError is compared like any output.
TEMPLATES = [
    ("plain", "a = {n}"),
    ("plain", "b = a * {n} + 1\nb"),
    ("plain", "c = [a, b, {n}]"),
    ("plain", "print(a + b, a * {n})"),
    ("plain", "c.append({n})\nc"),
    ("plain", "import numpy as np\narr = np.arange({n} + 3)"),
    ("plain", "arr *= {n}\narr.sum()"),
    ("plain", "arr[0] = {n}\narr"),
    ("plain", "def g(x):\n    return x * {n} + a"),
    ("plain", "g({n})"),
    ("plain", "class K:\n    def __init__(self):\n        self.v = a + {n}\n"
              "    def m(self):\n        return self.v * 2"),
    ("plain", "k = K()\nk.m()"),
    ("plain", "del b"),
    ("plain", "%precision {n}"),
    ("plain", "22 / 7"),
    ("plain", "import helper\nhelper.VALUE + {n}"),
    ("plain", "from helper import scale\nscale(a)"),
    ("seeded", "import random\nrandom.seed({n})"),
    ("seeded", "random.random()"),
    ("seeded", "import numpy as np\nnp.random.seed({n})"),
    ("seeded", "np.random.rand(3)"),
    ("data_read", "print(open('data.txt').read())"),
    ("data_read", "import pandas as pd\ndf = pd.read_csv('data.csv')\ndf.y.sum() + {n}"),
    ("data_read", "import json\nwith open('data.json') as fj:\n    cfg = json.load(fj)\ncfg"),
    ("file_write", "with open('out.txt', 'w') as f:\n    f.write('line {n}\\n' * 3)"),
    ("file_write", "print(open('out.txt').read())"),
    ("classic_style", "import matplotlib.pyplot as plt\nplt.style.use('classic')"),
    ("plain", "%matplotlib inline\nimport matplotlib.pyplot as plt\n"
              "plt.plot([1, {n}, 2]);"),
]


def templates():
    """The grammar's templates."""
    return [t for _, t in TEMPLATES]


cell_sources = st.builds(lambda t, n: t.format(n=n), st.sampled_from(templates()),
                         st.integers(1, 9))


def unstable_cells(sources):
    """Positions of the cells whose output a Run All does not fix: a draw from a global
    generator no earlier cell seeded (the grammar's only source of chance)."""
    seeded, unstable = set(), set()
    for i, source in enumerate(sources):
        if "random.seed(" in source:
            seeded.add("np" if "np.random" in source else "random")
        elif "random.random()" in source and "random" not in seeded:
            unstable.add(i)
        elif "np.random.rand(" in source and "np" not in seeded:
            unstable.add(i)
    return unstable


def folder_files(folder, skip=()):
    """{relative path: bytes} of the files in `folder`, bytecode caches and `skip` left
    out."""
    found = {}
    for path in glob.glob(os.path.join(folder, "**", "*"), recursive=True):
        rel = os.path.relpath(path, folder)
        if os.path.isfile(path) and "__pycache__" not in rel and rel not in skip:
            with open(path, "rb") as f:
                found[rel] = f.read()
    return found


class Reference:
    """Clean Run Alls (nbclient, ipykernel) of notebooks, cached by the notebook's
    sources and the content of its folder (a step that changes neither, like a restart,
    costs no kernel)."""

    def __init__(self, root):
        """Runs go in folders under `root`."""
        self.root = root
        self.cache = {}
        self.runs = 0

    def of(self, folder, notebook):
        """[(source, outputs)] of a clean Run All of `notebook` in a copy of `folder` as it
        is now, and {file: bytes} of that copy afterwards."""
        before = folder_files(folder)
        key = hashlib.sha256(json.dumps(sorted((k, hashlib.sha256(v).hexdigest())
                                               for k, v in before.items())).encode())
        if key.hexdigest() not in self.cache:
            self.runs += 1
            copy = os.path.join(self.root, f"ref-{self.runs}")
            shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("__pycache__"))
            path = os.path.join(copy, notebook)
            cells = run_in_jupyter([path], slots=1, in_own_folder=True, timeout=60)[path]
            self.cache[key.hexdigest()] = (cells, folder_files(copy, skip={notebook}))
        return self.cache[key.hexdigest()]


def split_error(outputs):
    """(outputs without the error, the error as /execute reports it or None)."""
    rest = [o for o in outputs if o["output_type"] != "error"]
    errors = [{k: o[k] for k in ("ename", "evalue", "traceback")}
              for o in outputs if o["output_type"] == "error"]
    return rest, (errors[0] if errors else None)


class World:
    """What a machine's example runs on: its temporary folder, reference runs, servers
    (stopped by `close`) and the S3 server of the test, if any."""

    def __init__(self, s3=None):
        """Set up an empty world."""
        self.root = tempfile.mkdtemp(prefix="difftest-")
        self.s3 = s3
        self.bucket = s3.bucket() if s3 else None
        self.servers = {}
        self.runs = 0

    def config(self, extra=""):
        """A server config: on the world's bucket when there is one."""
        return self.s3.config(self.bucket, extra=extra) if self.s3 else (extra or None)

    def server(self, name, evicting=False, restart=False):
        """The server `name` (its own store), started or restarted as asked; one that
        evicts keeps a single live holder, so every cell of a run restores the state
        before it from the store."""
        srv = self.servers.get(name)
        if srv is not None and (restart or srv.evicting != evicting):
            srv.stop()
            srv = None
        if srv is None:
            extra = "[workers]\nmax_live_states = 1\n" if evicting else ""
            srv = Server(os.path.join(self.root, f"store-{name}"), config=self.config(extra))
            srv.evicting = evicting
            self.servers[name] = srv
        return srv

    def close(self):
        """Stop the servers, remove the folder."""
        for srv in self.servers.values():
            srv.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class Notebook(RuleBasedStateMachine):
    """A small generated notebook and the user's actions on it; every step ends with a
    run compared with a clean Run All."""

    s3 = None          # set by the test: moto's S3 server (another server on the bucket)
    reference = None   # a Reference shared by the examples of a test
    steps = 0          # steps checked, over the test's examples
    sequences = 0

    def __init__(self):
        """A new world for this example."""
        super().__init__()
        self.world = World(self.s3)
        self.folder = os.path.join(self.world.root, "nb")
        os.makedirs(self.folder)
        self.cells = []  # [(id, source)]
        self.ids = 0
        self.last = None  # (what ran the last check, the folder's files before it)
        type(self).sequences += 1

    def teardown(self):
        """Stop this example's servers."""
        self.world.close()

    # The notebook and its folder.

    def new_id(self):
        """A fresh cell id."""
        self.ids += 1
        return f"c{self.ids}"

    def write(self, folder=None):
        """Write the notebook into `folder` (default: its own)."""
        write_notebook(os.path.join(folder or self.folder, "notebook.ipynb"), self.cells)

    def write_helper(self, n):
        """The helper module the notebook imports, with its bytecode cache gone (a
        rewrite within a second of the same size would otherwise be imported stale by
        every interpreter, ipykernel's too)."""
        with open(os.path.join(self.folder, "helper.py"), "w") as f:
            f.write(HELPER.format(n=n))
        shutil.rmtree(os.path.join(self.folder, "__pycache__"), ignore_errors=True)

    def write_data(self, name, n):
        """Write the data file `name` from its generator."""
        with open(os.path.join(self.folder, name), "w") as f:
            f.write(DATA[name](n))

    # The check after every step.

    def check(self, how, folder=None, again=False):
        """Run the notebook in `folder` (default: its own) by `how` ("server", "evicting",
        "other", "serverless") and compare it with a clean Run All. With `again` (nothing
        changed since the last run by the same path), no cell that succeeded may run."""
        folder = folder or self.folder
        self.write(folder)
        expected, files = self.reference.of(folder, "notebook.ipynb")
        self.world.runs += 1
        output = os.path.join(self.world.root, f"out-{self.world.runs}.ipynb")
        notebook = os.path.join(folder, "notebook.ipynb")
        if how == "serverless":
            extra = ["--data-dir", os.path.join(self.world.root, "store-serverless")]
            if self.world.s3:  # the serverless run reads the same bucket
                path = os.path.join(self.world.root, "serverless-config.toml")
                with open(path, "w") as f:
                    f.write(self.world.config())
                extra += ["--config", path]
        else:
            srv = self.world.server("other" if how == "other" else "main",
                                    evicting=how == "evicting")
            extra = ["--server", srv.url, "--token", TOKEN]
        statuses, outputs = run_command(notebook, output, *extra)
        unstable = unstable_cells([s for _, s in self.cells])
        problems = []
        for i, ((source, want), got) in enumerate(zip(expected, outputs)):
            if i in unstable:
                continue
            diff = compare_cell(i, source, want, *split_error(got))
            if diff is None and png_sizes(want) != png_sizes(got):
                diff = f"cell {i}:\n{source}\nfigure sizes: jupyter {png_sizes(want)}, " \
                       f"here {png_sizes(got)}"
            if diff:
                problems.append(diff)
        here = folder_files(folder, skip={"notebook.ipynb"})
        if here != files:
            problems.append("files: "
                            + "; ".join(f"{k}: jupyter {files.get(k)!r}, here {here.get(k)!r}"
                                        for k in sorted(set(here) | set(files))
                                        if here.get(k) != files.get(k)))
        if again:
            ran = [cell_id for cell_id, status in statuses.items() if status == "ran"]
            if ran:
                problems.append(f"a run with nothing changed ran {ran}")
        assert not problems, f"{how} run:\n" + "\n\n".join(problems)
        type(self).steps += 1

    # The rules.

    @initialize(sources=st.lists(cell_sources, min_size=2, max_size=5),
                helper=st.integers(1, 9), data=st.integers(1, 9))
    def start(self, sources, helper, data):
        """A notebook of a few cells, its helper module and data files; its first run."""
        self.cells = [(self.new_id(), s) for s in sources]
        self.write_helper(helper)
        for name in DATA:
            self.write_data(name, data)
        self.check("server")

    @rule(data=st.data(), source=cell_sources)
    def edit_cell(self, data, source):
        """Replace a cell's source."""
        i = data.draw(st.integers(0, len(self.cells) - 1))
        self.cells[i] = (self.cells[i][0], source)
        self.check("server")

    @rule(data=st.data())
    def comment_cell(self, data):
        """Add a comment to a cell (its key changes, its meaning does not)."""
        i = data.draw(st.integers(0, len(self.cells) - 1))
        cell_id, source = self.cells[i]
        self.cells[i] = (cell_id, source + "\n# edited")
        self.check("server")

    @rule(data=st.data(), source=cell_sources)
    def insert_cell(self, data, source):
        """Insert a new cell anywhere."""
        i = data.draw(st.integers(0, len(self.cells)))
        self.cells.insert(i, (self.new_id(), source))
        self.check("server")

    @precondition(lambda self: len(self.cells) > 1)
    @rule(data=st.data())
    def delete_cell(self, data):
        """Delete a cell."""
        del self.cells[data.draw(st.integers(0, len(self.cells) - 1))]
        self.check("server")

    @precondition(lambda self: len(self.cells) > 1)
    @rule(data=st.data())
    def move_cell(self, data):
        """Move a cell to another place."""
        cell = self.cells.pop(data.draw(st.integers(0, len(self.cells) - 1)))
        self.cells.insert(data.draw(st.integers(0, len(self.cells))), cell)
        self.check("server")

    @rule(n=st.integers(1, 9))
    def edit_helper(self, n):
        """Edit the helper module the notebook imports."""
        self.write_helper(n)
        self.check("server")

    @rule(name=st.sampled_from(sorted(DATA)), n=st.integers(1, 9))
    def edit_data(self, name, n):
        """Edit a data file."""
        self.write_data(name, n)
        self.check("server")

    @rule()
    def restart_server(self):
        """Restart the server: every state comes back from the store."""
        self.world.server("main", restart=True)
        self.check("server", again=True)

    @rule()
    def run_evicting(self):
        """Run on the same store through a server that keeps one live holder."""
        self.check("evicting")

    @rule()
    def run_again(self):
        """Run again with nothing changed: nothing runs."""
        self.check("server")
        self.check("server", again=True)

    @rule()
    def run_copy_elsewhere(self):
        """Run a copy of the notebook (and its files) in another folder on the same
        store, then the notebook itself."""
        copy = os.path.join(self.world.root, f"copy-{self.world.runs}")
        shutil.copytree(self.folder, copy, ignore=shutil.ignore_patterns("__pycache__"))
        self.check("server", folder=copy)
        self.check("server")

    @precondition(lambda self: self.s3 is not None)
    @rule()
    def run_on_other_server(self):
        """Run through a second server on the same bucket."""
        self.check("other")

    @rule()
    def run_serverless(self):
        """Run serverless (its own store; on the bucket too when there is one)."""
        self.check("serverless")


def run_machine(s3, tmp_path, **options):
    """Run the machine with hypothesis `options`; print the sequences and steps run."""
    Notebook.s3 = s3
    if Notebook.reference is None or Notebook.reference.root != str(tmp_path):
        Notebook.reference = Reference(str(tmp_path))
    Notebook.steps = Notebook.sequences = 0
    started = time.monotonic()
    try:
        run_state_machine_as_test(Notebook, settings=settings(
            deadline=None, suppress_health_check=list(HealthCheck), **options))
    finally:
        print(f"\n[differential] {Notebook.sequences} sequences, {Notebook.steps} steps "
              f"checked ({Notebook.reference.runs} reference runs) in "
              f"{time.monotonic() - started:.0f} s")


def test_differential(s3, tmp_path, capsys):
    """A few derandomized sequences (the same on every run), in about two minutes."""
    with capsys.disabled():
        run_machine(s3, tmp_path, max_examples=3, stateful_step_count=5,
                    derandomize=True, database=None)


@pytest.mark.differential
def test_differential_long(s3, tmp_path, capsys):
    """New sequences, batch after batch, until DIFFTEST_SECONDS (default 600) have
    passed; a failing sequence is kept in hypothesis' example database and replays
    first in the next run."""
    deadline = time.monotonic() + float(os.environ.get("DIFFTEST_SECONDS", "600"))
    with capsys.disabled():
        while time.monotonic() < deadline:
            run_machine(s3, tmp_path, max_examples=5, stateful_step_count=12)
