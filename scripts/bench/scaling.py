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

For the largest state of the run but 4 GB (1 GB; `--quick`: 100 MB), issue
27's targets, each beside its floor measured in the same run:

- first save against writing the frame's bytes to a new file beside the
  store and `fdatasync` (the faster of such a write just before the make
  cell and one right after the save);
- restore in one process: a new interpreter that opens the store (the
  server still running) loads every group of the state, as a holder does,
  against copying the same bytes into new memory (as the restore
  allocates it) and taking their XXH3-64; turn about, median of 3 each;
- after another restart, the first cell that reads every column: its round
  trip minus the same cell's time in a plain interpreter, on the frame that
  interpreter just made (issue 27's "the cell's own time"; its time in the
  server, measured in the cell, is shown beside: it grows when other work
  shares the cores with it); then the same cell from a second state made
  from the first (`y = 1`: the same blobs, not live).

Only this server takes part. Run alone (`--only s`) it writes the section
"Results: scaling" of BENCHMARKS.md.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from bench.floors import durable_write_seconds
from bench.peers import Ours, added_bytes
from bench.report import fmt_ms, fmt_size, median
from harness import ROOT
from snapkernel.kernel import trace

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


def plain_seconds(size):
    """(seconds `make_code(size)` takes, then seconds READ_ALL takes on what it made) in
    a plain interpreter, the imports done before; (0, 0) for 0 B (no frame)."""
    if size == 0:
        return 0.0, 0.0
    read = READ_ALL.rpartition("\n")[0]  # without its last expression: printed instead
    script = (f"{SETUP}\nimport time\n_t = time.perf_counter()\n{make_code(size)}\n"
              f"assert str(df['s'].dtype) == 'str'\nprint(time.perf_counter() - _t)\n"
              f"{read}\nprint(_time.perf_counter() - _t0)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    make, read = done.stdout.split()[-2:]
    return float(make), float(read)


# A cell that reads every column of `df` (issue 27); its last expression is its own time.
READ_ALL = ("import time as _time\n_t0 = _time.perf_counter()\n"
            "_total = float(df[list('abcdef')].sum().sum()) + int(df['s'].str.len().sum())\n"
            "_time.perf_counter() - _t0")
RESTORE_ROUNDS = 3

# In a new interpreter: restore every group of a state as a holder does (the store opened
# beside the running server), then, turn about, the floor: the same bytes copied into
# new memory as a restore allocates it, with their XXH3-64. Prints both, in seconds.
_RESTORE = r"""
import json, sys, time
import numpy, pandas, pyarrow, xxhash
from snapkernel.kernel import config
from snapkernel.storage import pages, serializer, snapshot
from snapkernel.storage.store import Store
path, name, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
settings = config.load()
store = Store(path, settings)
manifest = store.manifest(name)

def floor(views):
    start = time.perf_counter()
    for view in views:
        copy = memoryview(pages.allocate(view.nbytes))
        for at in range(0, view.nbytes, 2 ** 20):
            copy[at:at + 2 ** 20] = view[at:at + 2 ** 20]
            xxhash.xxh3_64_digest(copy[at:at + 2 ** 20])
        del copy
    return time.perf_counter() - start

times, floors = [], []
for _ in range(rounds):
    start = time.perf_counter()
    namespace = {}
    for group in manifest["groups"]:
        snapshot.load_group(store, group, namespace, name)
    times.append(time.perf_counter() - start)
    # The state's large buffers, as a save finds them: the restored bytes.
    views = [v.cast("B") for v in serializer.dumps(
        list(namespace.values()), namespace, "", settings["store.buffer_blob_min_bytes"]).buffers]
    size = sum(v.nbytes for v in views)
    floors.append(floor(views))
    del namespace, views
    pages.keep_only(set())
print(json.dumps({"restore": times, "floor": floors, "bytes": size}))
"""


def restore_in_process(data_dir, name):
    """{restore, floor: seconds (medians), bytes}: the restore of state `name` in a new
    interpreter against copying and checksumming the same bytes (see _RESTORE)."""
    done = subprocess.run([sys.executable, "-c", _RESTORE, data_dir, name,
                           str(RESTORE_ROUNDS)], capture_output=True, text=True, check=True,
                          cwd=ROOT)
    found = json.loads(done.stdout)
    return {"restore": median(found["restore"]), "floor": median(found["floor"]),
            "bytes": found["bytes"]}


def timed_cell(peer, code, state):
    """(round trip, the cell's own time as its last expression gave it) of one cell."""
    elapsed, answer = peer.must(code, state)
    peer.delete(answer["state_name"])
    return elapsed, float(answer["output"][-1]["data"]["text/plain"])


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


def measure(peer, path, size, runs, floors=False):
    """One row: every measure of a state of `size` bytes; with `floors`, issue 27's
    measures and their floors too."""
    row = {"size": size}
    row["plain make"], row["plain read"] = plain_seconds(size)
    peer.reset()
    base = peer.must(SETUP, new="s-setup")[1]["state_name"]
    time.sleep(1.0)  # the spare of the new state forked and warm, as for any next cell
    if floors:
        # The same write takes 0.8 s or 3.4 s on the VMs measured, by how recently the
        # memory it gets was used (right after a 1 GB save, mostly the slow way): the
        # floor is the faster of one just before the make cell and one right after.
        floor_before = durable_write_seconds(os.path.dirname(peer.data_dir), size)
        time.sleep(1.0)
    before = peer.store_usage()
    name = f"s-{size}"
    row["make cell"], answer = peer.must(timed_make(size), base, new=name)
    row["make in cell"] = float(answer["output"][-1]["data"]["text/plain"])
    row["first save"] = row["make cell"] - row["make in cell"]
    if floors:
        row["save floor"] = min(floor_before, durable_write_seconds(
            os.path.dirname(peer.data_dir), size))
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
    if floors:
        measure_restores(peer, name, row)
    return row


def measure_restores(peer, name, row):
    """Issue 27's restores of state `name` (see the module doc) into `row`."""
    second = peer.must("y = 1", name, new=f"{name}-second")[1]["state_name"]
    found = restore_in_process(peer.data_dir, name)
    row["restore"], row["restore floor"] = found["restore"], found["floor"]
    row["restored bytes"] = found["bytes"]
    peer.stop()
    peer.start()
    for key, state in (("read", name), ("read second", second)):
        elapsed, own = timed_cell(peer, READ_ALL, state)
        row[key], row[key + " own"] = elapsed - row["plain read"], own


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
    # In the run's folder, which goes when the run ends (unless --keep): a full run leaves
    # about 3 GB in its store.
    tmp = tempfile.mkdtemp(dir=os.path.dirname(peers["ours"].dir), prefix="scaling-")
    path = os.path.join(tmp, "trace.jsonl")
    peer = Ours(tmp, config=f"[server]\ntrace_file = {json.dumps(path)}\n")
    peer.start()
    rows = []
    issue27 = max(size for size in SIZES[mode] if size <= 1000 * MB)
    try:
        for size in SIZES[mode]:
            row = measure(peer, path, size, TRIVIAL_RUNS[mode], floors=size == issue27)
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
    for row in rows:
        if "save floor" in row:
            issue_27_rows(table, row)
    details.append(("s: costs by state size (this server)", matrix(rows)))


def issue_27_rows(table, row):
    """Issue 27's targets, each beside its floor measured in the same run."""
    label = fmt_size(row["size"])
    floor = row["save floor"]
    table.add("s", f"first save, {label} frame with a string column (floor: {label} written "
              f"and fdatasync'd beside the store, the faster of before and after, "
              f"{fmt_ms(floor)})", {"ours": row["first save"]},
              f"≤ 1.2× floor ({fmt_ms(1.2 * floor)})", row["first save"] <= 1.2 * floor)
    floor = row["restore floor"]
    table.add("s", f"restore of its buffers in one process, median of {RESTORE_ROUNDS} (floor: "
              f"the same {row['restored bytes'] / 1e6:.0f} MB copied into new memory with "
              f"their XXH3-64, {fmt_ms(floor)})", {"ours": row["restore"]},
              f"≤ 2× floor ({fmt_ms(2 * floor)})", row["restore"] <= 2 * floor)
    for key, source in (("read", "after a restart"),
                        ("read second", "then from a second state sharing its blobs")):
        table.add("s", f"first cell reading every column {source}: answered − the cell's "
                  f"own time in a plain interpreter ({fmt_ms(row['plain read'])}; in the "
                  f"server, {fmt_ms(row[key + ' own'])})", {"ours": row[key]}, "≤ 1 s",
                  row[key] <= 1.0)
