"""scripts/bench.py: its report, its profile of a trace, its ipykernel peer, its notebook
workload, its command line."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from nbclient.exceptions import CellExecutionError

from bench import floors, notebook, peers, profile, report
from snapkernel.kernel import trace
from support.server import ROOT, Gate, asleep, in_thread, wait_for


def test_merge_keeps_other_sections():
    """Rewriting a results section keeps a section another engineer wrote."""
    text = ("# Benchmarks\n\nintro\n\n## Results: quick\n\nold\n\n"
            "## Load\n\nload table\n| a | b |\n\n## Results: full\n\nfull old\n")
    out = report.merge(text, {"Results: quick": "new", "How to run": "run it"})
    assert "## Load\n\nload table\n| a | b |\n" in out
    assert "new" in out and "old\n\n## Load" not in out
    assert "full old" in out
    assert out.count("## How to run") == 1
    assert out.index("## Results: quick") < out.index("## Load") < out.index("## Results: full")


def test_merge_on_empty_file():
    """A missing file gets a title and the owned sections."""
    out = report.merge("", {"Results: full": "table"})
    assert out.startswith("# Benchmarks")
    assert "## Results: full\n\ntable\n" in out


def test_ratio_and_formats():
    """Ratios say how many times better ours is; sizes and times read well."""
    assert report.Table.ratio(0.01, 0.1, "lower") == "10×"
    assert report.Table.ratio(2.0, 1.0, "higher") == "2×"
    assert report.Table.ratio(0.01, "n/a (no store)", "lower") == "n/a"
    assert report.fmt_size(1_500_000) == "1.5 MB"
    assert report.fmt_ms(0.0123) == "12.3 ms"


def test_table_has_a_value_and_a_ratio_column_per_other_peer():
    table = report.Table({"ours": "this server", "ref": "ref 0.2.1", "ipykernel": "ipykernel 7",
                          "dill": "dill"})
    table.add("a", "x += 1", {"ours": 0.002, "ref": 0.004, "ipykernel": 0.001,
                              "dill": "n/a (one namespace)"}, "≤ 3 ms", True)
    head, _, row = table.markdown().splitlines()
    assert head == ("| workload | metric | this server | ref 0.2.1 | ours vs ref | ipykernel 7 "
                    "| ours vs ipykernel | dill | ours vs dill | target | met |")
    assert row == ("| a | x += 1 | 2 ms | 4 ms | 2× | 1 ms | 0.5× | n/a (one namespace) | n/a "
                   "| ≤ 3 ms | yes |")


def test_added_bytes_counts_new_blobs_and_manifests():
    """Store growth: blobs not there before, plus manifest growth."""
    assert peers.added_bytes(({b"k1": 100}, 50), ({b"k1": 100, b"k2": 30}, 80)) == 60


def stamp(t, pid, role, phase, exec_id):
    """One line of a trace file, as kernel/trace.py writes it."""
    return json.dumps({"t": t, "pid": pid, "role": role, "phase": phase, "exec": exec_id})


def test_profile_of_a_trace_file(tmp_path):
    """Steps between consecutive stamps of each request, across processes, in their order."""
    lines = []
    for exec_id, base, run_s in (("e1", 100.0, 0.004), ("e2", 200.0, 0.002),
                                 ("e3", 300.0, 0.006), ("other", 400.0, 1.0)):
        # Written out of time order, as several processes append to one file.
        child = [(base + 0.002, "received"), (base + 0.0025, "compiled"),
                 (base + 0.0025 + run_s, "ran"), (base + 0.0035 + run_s, "answering")]
        server = [(base + 0.001, "request"), (base + 0.0015, "sent"),
                  (base + 0.004 + run_s, "answer"), (base + 0.0042 + run_s, "reply")]
        lines += [stamp(t, 7, "child", p, exec_id) for t, p in child]
        lines += [stamp(t, 5, "server", p, exec_id) for t, p in server]
    lines.append(stamp(150.0, 8, "holder", "forked", None))
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    stamps = trace.read(str(path))
    for exec_id, base, run_s in (("e1", 100.0, 0.004), ("e2", 200.0, 0.002)):
        stamps += profile.client_stamps(exec_id, base, base + 0.005 + run_s)
    rows = profile.summarise(stamps, {"fast": ["e1", "e2"], "slow": ["e3"]})
    assert [(name, prior) for name, prior, _ in rows] == [
        (profile.ROUND_TRIP, None), ("server request", "client send"),
        ("server sent", "server request"), ("child received", "server sent"),
        ("child compiled", "child received"), ("child ran", "child compiled"),
        ("child answering", "child ran"), ("server answer", "child answering"),
        ("server reply", "server answer"), ("client done", "server reply")]
    cells = {name: cells for name, _, cells in rows}
    assert cells[profile.ROUND_TRIP]["fast"] == pytest.approx((8.0, 2))
    assert "slow" not in cells[profile.ROUND_TRIP]  # e3 has no client stamps
    assert cells["child ran"]["fast"] == pytest.approx((3.0, 2))
    assert cells["child ran"]["slow"] == pytest.approx((6.0, 1))
    assert cells["child received"]["slow"] == pytest.approx((0.5, 1))
    assert "slow" not in cells["server request"]  # e3's first stamp: nothing before it
    assert cells["server request"]["fast"] == pytest.approx((1.0, 2))
    table = profile.markdown(rows, ["fast", "slow"])
    assert ("| child ran | child compiled | child: run the cell | 3.00 (n=2) | 6.00 (n=1) |"
            in table)
    assert ("| server request | client send | HTTP in: the request reaches its route | "
            "1.00 (n=2) | - |") in table
    assert profile.untagged(stamps) == "holder forked ×1"


def test_ipykernel_peer_runs_cells_interrupts_and_resets(tmp_path):
    """The new peer: a real kernel through jupyter_client, answers shaped as ours."""
    kernel = peers.Ipykernel(str(tmp_path))
    up, first = kernel.start("x = 41")
    try:
        assert 0 < up <= first
        seconds, answer = kernel.must("print('hi')\nx += 1\nx")
        assert seconds > 0 and answer["error"] is None and answer["state_name"]
        assert answer["output"] == [
            {"output_type": "stream", "name": "stdout", "text": "hi\n"},
            {"output_type": "execute_result", "data": {"text/plain": "42"}, "metadata": {}}]
        _, answer = kernel.execute("1 / 0")
        assert answer["error"]["ename"] == "ZeroDivisionError" and answer["state_name"] is None
        rss, children_pss, children = kernel.memory()
        assert rss > 10 * 2 ** 20 and children == 0
        # The cell sleeps an hour: only the interrupt, sent once it sleeps, ends it in time.
        here = Gate(tmp_path, "sleeping")
        sleeping = in_thread(kernel.execute, here.arrive_code + "import time\ntime.sleep(3600)")
        (pid,) = here.arrived()
        wait_for(lambda: asleep(pid), "the kernel's cell to sleep")
        kernel.interrupt("unused")
        assert sleeping.result(timeout=60)[1]["error"]["ename"] == "KeyboardInterrupt"
        kernel.reset()
        assert kernel.execute("x")[1]["error"]["ename"] == "NameError"
    finally:
        kernel.stop()


def test_command_line_refuses_bad_input():
    for args, message in ((["--only", "a,zz"], "unknown workload(s) zz"),
                          (["--profile", "--gaps", "0,x"], "not a list of seconds"),
                          (["--ours-config", "/nonexistent.toml"], "no such file")):
        run = subprocess.run([sys.executable, "scripts/bench.py", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 2, run.stderr
        assert message in run.stderr and "Traceback" not in run.stderr


def test_the_scaling_workload_leaves_no_store_behind():
    """bench.py --only s removes its stores when it ends, as the other workloads do (a
    full run left 3 GB in the temporary folder each time)."""
    # A short path of its own: the servers' sockets are made in it too.
    temp = tempfile.mkdtemp(prefix="bench-tmp-")
    try:
        run = subprocess.run([sys.executable, "scripts/bench.py", "--quick", "--only", "s",
                              "--no-write"], cwd=ROOT, capture_output=True, text=True,
                             timeout=600, env=dict(os.environ, TMPDIR=temp))
        assert run.returncode == 0, run.stderr
        assert "| s | " in run.stdout
        assert os.listdir(temp) == []
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_profile_of_a_real_server_covers_every_phase(tmp_path):
    """Our server with server.trace_file set stamps every phase of each request, in order."""
    path = tmp_path / "trace.jsonl"
    ours = peers.Ours(str(tmp_path), config=f"[server]\ntrace_file = {json.dumps(str(path))}\n")
    ours.start()
    ids, client, state = [], [], "initial"
    try:
        for i in range(3):
            exec_id = f"t{i}"
            answer = ours.execute("x = 0" if i == 0 else "x += 1", state, exec_id=exec_id)[1]
            assert answer["error"] is None, answer["error"]
            state = answer["state_name"]
            ids.append(exec_id)
            client += profile.client_stamps(exec_id, *ours.client.times())
    finally:
        ours.stop()
    stamps = trace.read(str(path)) + client
    requests = profile.by_request(stamps)
    path = ["send", "request", "sent", "received", "compiled", "ran", "saved", "answering",
            "answer", "bound", "reply", "done"]
    for exec_id in ids:
        phases = [s["phase"] for s in requests[exec_id]]
        assert [p for p in phases if p in path] == path
    # After its answer, the child that made a state forks the holder, then rehearses a
    # cell, before it takes the next cell, unless that cell came first (a chain step:
    # neither, see Pool.take_child).
    for exec_id, after in zip(ids, ids[1:]):
        phases = [s["phase"] for s in requests[exec_id]]
        if "forked" not in phases:
            assert "warmed" not in phases
            continue
        assert phases.index("forked") < phases.index("warmed")
        assert requests[exec_id][phases.index("warmed")]["t"] <= next(
            s["t"] for s in requests[after] if s["phase"] == "received")
    rows = profile.summarise(stamps, {"chain": ids})
    assert rows[0][0] == profile.ROUND_TRIP and rows[0][2]["chain"][1] == 3
    assert all(cells["chain"][0] >= 0 for _, _, cells in rows)
    assert all(profile.describe(name) for name, _, _ in rows)


def test_notebook_workload_edits_its_parameter_cell():
    """nb's one-cell edit changes THRESHOLD and nothing else of the 30 cells."""
    before = notebook.nb_sources("/tmp/sales.csv")
    after = notebook.nb_sources("/tmp/sales.csv", threshold=123)
    assert len(before) == len(after) == 30
    assert [n for n, (b, a) in enumerate(zip(before, after)) if b != a] == [notebook.NB_EDITED]
    assert after[notebook.NB_EDITED] == "THRESHOLD = 123"


def test_floors_measure_each_crossing(tmp_path):
    """The floors' servers answer their route, the hop and the commits happen, and the
    durable write leaves nothing behind (each a median of real round trips, in seconds)."""
    # Only that each measured something: how fast is BENCHMARKS.md's business.
    for script in (floors._RAW_SERVER, floors._BOTTLE_SERVER):
        # (_http_floor raises unless every answer is a 200)
        assert 0 < report.median(floors._http_floor(script, 0.0))
    assert 0 < report.median(floors._hop_floor(0.0))
    assert 0 < report.median(floors._fork_floor(0.0))
    assert 0 < report.median(floors._commit_floor(str(tmp_path), 0.0))
    assert list(tmp_path.glob("floor-lmdb-*/data.mdb"))
    assert 0 < report.median(floors._flush_floor(str(tmp_path), 0.0))
    assert list(tmp_path.glob("floor-flush-*/pages"))
    assert floors.durable_write_seconds(str(tmp_path), 8 << 20) > 0
    assert not (tmp_path / "floor-write").exists()


def test_one_nbclient_run_times_each_cell_and_refuses_a_failing_one():
    """The nbclient run an nb edit is paired with: a time per cell, the kernel's start
    included in the total; a failing cell is an error, not a time."""
    total, times = notebook.nb_jupyter_once(["x = 1", "print(x)"])
    assert len(times) == 2 and all(t >= 0 for t in times)
    assert total >= sum(times)
    with pytest.raises(CellExecutionError, match="ZeroDivisionError"):
        notebook.nb_jupyter_once(["1 / 0"])
