"""Fresh runs in this process (kernel/notebook/ on its own, no command line): the
failure categories and refusals that tests/test_fresh.py does not run through
`main.py run`, the explicit environment, and kept states.

These runs spawn real kernels; they do not adopt orphans (that would make
pytest a subreaper that kills its own children), so the process table is
checked through the command in tests/test_fresh.py.
"""

import json

import nbformat
import pytest

from snapkernel.frontends import run as command
from snapkernel.kernel import config
from snapkernel.kernel.notebook import environment, fresh_file, receipt
from snapkernel.kernel.notebook.model import FreshOptions
from snapkernel.storage.store import Store

OK = "assert 2 + 2 == 4"


def run(tmp_path, sources, overrides=None, **options):
    """Run a notebook of `sources` with run_file and FreshOptions(**options); (exit
    status, receipt read back)."""
    nb = tmp_path / "nb.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s)
                                                   for s in sources]), str(nb))
    settings = config.load(None, overrides or {})
    done, built = fresh_file.run_file(
        str(nb), str(tmp_path / "out.ipynb"),
        FreshOptions(receipt=str(tmp_path / "receipt.json"), **options), settings)
    status = command.fresh_exit_status(done)
    written = json.loads((tmp_path / "receipt.json").read_text())
    assert written == built
    receipt.check(written)
    if written["category"] is not None:
        assert written["output"]["written"] is False
        assert written["cleanup"]["status"] == "ok"
    return status, written


def test_syntax_error_runs_nothing(tmp_path):
    status, r = run(tmp_path, ["open('ran', 'w').close()", "def f(:\n    pass"])
    assert status == 1 and r["category"] == "SYNTAX_ERROR"
    assert [c["status"] for c in r["cells"]] == ["not_run", "failed"]
    assert r["cells"][1]["ename"] == "SyntaxError"
    assert not (tmp_path / "ran").exists()


def test_memory_fuse(tmp_path):
    # The cell would hold its memory for an hour: without the fuse, the run's deadline
    # (2 minutes here) would end it as RUN_TIMEOUT instead.
    status, r = run(tmp_path, ["import time\nb = b'x' * (600 * 2 ** 20)\ntime.sleep(3600)"],
                    {"fresh.memory_fuse_mb": 300, "fresh.poll_s": 0.1,
                     "fresh.timeout_s": 120.0})
    assert status == 1 and r["category"] == "MEMORY_FUSE"
    assert r["peak_memory_mb"] >= 300
    assert r["cells"][0]["status"] == "failed"


def test_too_many_cells(tmp_path):
    status, r = run(tmp_path, ["open('ran', 'w').close()", "x = 1", "y = 2"],
                    {"fresh.max_code_cells": 2})
    assert status == 1 and r["category"] == "TOO_MANY_CELLS"
    assert not (tmp_path / "ran").exists()


def test_dying_worker(tmp_path):
    status, r = run(tmp_path, ["import os\nos._exit(3)", "x = 1"])
    assert status == 1 and r["category"] == "WORKER_DIED"
    assert [c["status"] for c in r["cells"]] == ["failed", "not_run"]
    assert r["cells"][0]["ename"] == "WorkerDied"


@pytest.mark.parametrize("options, message", [
    ({"cwd": "/nonexistent-folder"}, "not a folder"),
    ({"env": ["SNAPK_UNSET_VARIABLE"]}, "not set"),
    ({"env": ["aws_Secret_access"]}, "SECRET"),
    ({"timeout": 0}, "more than 0"),
    ({"cell_timeout": -1}, "0 (none) or more"),
    ({"expected_environment": "abc"}, "SHA-256"),
])
def test_bad_input_is_refused_before_anything_runs(tmp_path, options, message):
    status, r = run(tmp_path, ["open('ran', 'w').close()"], **options)
    assert status == 2 and r["category"] == "BAD_INPUT" and message in r["message"]
    assert r["kernel"] is None and r["cleanup"]["processes_observed"] == 0
    assert not (tmp_path / "ran").exists()


def test_cleanup_allowance_is_at_most_30_seconds(tmp_path):
    status, r = run(tmp_path, [OK], {"fresh.cleanup_s": 31.0})
    assert status == 2 and "at most 30" in r["message"] and r["limits"] is None


def test_refused_names():
    for name in ("MY_API_TOKEN", "aws_secret_access_key", "DB_Password", "SSH_KEY",
                 "GOOGLE_APPLICATION_CREDENTIALS", "https_proxy", "KEYRING"):
        with pytest.raises(environment.EnvironmentRefused):
            environment.check_name(name)
    for name in ("LANG", "MY_SETTING", "TZ"):
        environment.check_name(name)
    with pytest.raises(environment.EnvironmentRefused):
        environment.check_name("A=B")


def test_explicit_environment(tmp_path):
    home, tmp = str(tmp_path / "home"), str(tmp_path / "tmp")
    source = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "MY_SETTING": "1", "OTHER": "x"}
    env = environment.explicit(home, tmp, ["LANG", "TZ"], ["MY_SETTING"], source)
    assert env["PATH"] == "/usr/bin" and env["HOME"] == home and env["TMPDIR"] == tmp
    assert env["LANG"] == "C.UTF-8" and env["MY_SETTING"] == "1"
    assert "TZ" not in env and "OTHER" not in env
    for name in environment.HOME_FOLDERS:
        assert env[name].startswith(home + "/") and (tmp_path / env[name]).is_dir()
    with pytest.raises(environment.EnvironmentRefused, match="not set"):
        environment.explicit(home, tmp, [], ["MISSING"], source)


def test_states_are_kept_only_when_asked(tmp_path):
    kept = tmp_path / "states"
    nb_folder = tmp_path / "nb"
    nb_folder.mkdir()
    status, r = run(nb_folder, ["x = 41", "x += 1"], keep_states=str(kept))
    assert status == 0, r["message"]
    names = Store(str(kept)).manifests()
    ids = [c["id"] for c in r["cells"]]
    assert set(ids) <= set(names)
    assert names[ids[1]]["variables"]["x"]["repr"] == "42"
    status, r = run(nb_folder, [OK], keep_states=str(kept), overwrite=True)
    assert status == 2 and "new or empty folder" in r["message"]
