"""The scaling workload (s): how each cost of this server grows with the state.

For states of 0 B, 10 MB, 100 MB, 1 GB and 4 GB (`--quick`: up to 100 MB),
each a DataFrame of six float64 columns and an Arrow-backed string column
(pandas' "str" dtype with pyarrow), made by one cell from a state that
imported numpy and pandas:

- first save: the make cell's round trip minus the time its `make()` took,
  as the cell itself measured it (the same code in a plain interpreter, a
  subprocess of this Python, is shown beside it: on a shared machine it
  varies by 2x and more from run to run with how warm the memory it gets
  is, so the difference to it is no measure of the save);
- trivial cell: `x += 1` from the state, median, each new state deleted;
- store size: bytes the make cell added to the store (new blobs and its
  manifest);
- PSS: the summed PSS of the server's worker processes (zygotes, holders,
  spares) with the state live, after a restart and the state's full load;
- restart: the server is stopped and started again; first answer is its
  start to `x += 1` answered from the state; full load is its start to
  the moment the state's holder has every variable of the state in its
  memory, which the holder stamps (`loaded`, with the state's name) in the
  trace file (kernel/trace.py) this server runs with.

Only this server takes part. Run alone (`--only s`) it writes the section
"Results: scaling" of BENCHMARKS.md.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from bench.peers import Ours, added_bytes
from bench.report import fmt_ms, fmt_size, median
from kernel import trace

MB = 10 ** 6
SIZES = {"quick": [0, 10 * MB, 100 * MB], "full": [0, 10 * MB, 100 * MB, 1000 * MB, 4000 * MB]}
SETUP = "import numpy as np\nimport pandas as pd\nimport pyarrow as pa\nimport pyarrow.compute as pc"
# Bytes a row takes: six float64, a 9-digit string and its 8-byte offset.
ROW_BYTES = 65
TRIVIAL_RUNS = {"quick": 5, "full": 7}


def make_code(size):
    """Code that makes `df` of about `size` bytes (in memory) and `x`.

    The string column is cast from integers by Arrow (seconds for 60 million
    rows, where `astype(str)` takes a minute).
    """
    if size == 0:
        return "x = 0"
    rows = size // ROW_BYTES
    return (f"_r = np.random.default_rng(0)\n"
            f"df = pd.DataFrame(_r.random(({rows}, 6)), columns=list('abcdef'))\n"
            f"df['s'] = pd.array(pc.cast(pa.array(_r.integers(10**8, 10**9, {rows})), "
            f"pa.large_string()), dtype='str')\n"
            f"del _r\nx = 0")


def plain_make_seconds(size):
    """Seconds `make_code(size)` takes in a plain interpreter, its imports done before."""
    if size == 0:
        return 0.0
    script = (f"{SETUP}\nimport time\n_t = time.perf_counter()\n{make_code(size)}\n"
              f"assert str(df['s'].dtype) == 'str'\nprint(time.perf_counter() - _t)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    return float(done.stdout.split()[-1])


def wait_loaded(path, state, since, timeout=600):
    """CLOCK_MONOTONIC time of the first `loaded` stamp of `state`'s holder after `since`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            for s in trace.read(path):
                if s["phase"] == "loaded" and s["exec"] == state and s["t"] >= since:
                    return s["t"]
        time.sleep(0.02)
    raise RuntimeError(f"the holder of {state} stamped no 'loaded' in {timeout} s")


def timed_make(size):
    """The make cell, its last expression the seconds `make_code` took in it."""
    return (f"import time as _time\n_t0 = _time.perf_counter()\n{make_code(size)}\n"
            f"_time.perf_counter() - _t0")


def measure(peer, path, size, runs):
    """One row: every measure of a state of `size` bytes."""
    row = {"size": size, "plain make": plain_make_seconds(size)}
    peer.reset()
    base = peer.must(SETUP, new="s-setup")[1]["state_name"]
    time.sleep(1.0)  # the spare of the new state forked and warm, as for any next cell
    before = peer.store_usage()
    name = f"s-{size}"
    row["make cell"], answer = peer.must(timed_make(size), base, new=name)
    row["make in cell"] = float(answer["output"][-1]["data"]["text/plain"])
    row["first save"] = row["make cell"] - row["make in cell"]
    row["store"] = added_bytes(before, peer.store_usage())
    peer.delete(peer.must("x += 1", name)[1]["state_name"])  # warm-up, not counted
    times = []
    for _ in range(runs):
        elapsed, answer = peer.must("x += 1", name)
        times.append(elapsed)
        peer.delete(answer["state_name"])
    row["trivial"] = median(times)
    peer.stop()
    peer.start()
    started = peer.process.started  # time.perf_counter(): CLOCK_MONOTONIC, as the stamps
    answer = peer.must("x += 1", name)[1]
    row["restart first"] = time.perf_counter() - started
    # Its state's holder would load the whole state too: not what is measured here.
    peer.delete(answer["state_name"])
    row["restart loaded"] = wait_loaded(path, name, started) - started
    row["pss"] = peer.memory()[1]
    return row


TARGETS = {1000 * MB: {"first save": 2.0, "restart first": 1.0, "restart loaded": 3.0}}
COLUMNS = [("state", "size"), ("x += 1 (median)", "trivial"), ("make() in a plain interpreter",
           "plain make"), ("make() in the cell", "make in cell"),
           ("make cell answered", "make cell"),
           ("first save (answered − make() in the cell)", "first save"), ("store growth", "store"),
           ("restart: first answer", "restart first"), ("restart: fully loaded", "restart loaded"),
           ("workers' PSS, state loaded", "pss")]


def cell(key, value):
    """One value of the scaling table as text."""
    if key in ("size", "store", "pss"):
        return "0 B" if value == 0 else fmt_size(value)
    return fmt_ms(value)


def matrix(rows):
    """The scaling table: a row per state size, a column per measure."""
    lines = ["| " + " | ".join(title for title, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(cell(k, row[k]) for _, k in COLUMNS) + " |")
    return "\n".join(lines)


def wl_scaling(peers, p, table, details, keep):
    """(s) the costs of states of growing size, on a server of its own with a trace file."""
    mode = "quick" if p["mode"] == "quick" else "full"
    tmp = tempfile.mkdtemp(prefix="snapshot-bench-scaling-")
    path = os.path.join(tmp, "trace.jsonl")
    peer = Ours(tmp, config=f"[server]\ntrace_file = {json.dumps(path)}\n")
    peer.start()
    rows = []
    try:
        for size in SIZES[mode]:
            row = measure(peer, path, size, TRIVIAL_RUNS[mode])
            rows.append(row)
            print("    " + ", ".join(f"{k} {cell(k, v)}" for k, v in row.items()), flush=True)
    finally:
        peer.stop()
    for row in rows:
        label = "0 B" if row["size"] == 0 else fmt_size(row["size"])
        for key, limit in TARGETS.get(row["size"], {}).items():
            title = next(t for t, k in COLUMNS if k == key)
            table.add("s", f"{title}, {label} frame with a string column", {"ours": row[key]},
                      f"≤ {fmt_ms(limit)}", row[key] <= limit)
    details.append(("s: costs by state size (this server)", matrix(rows)))
