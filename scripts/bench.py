"""Benchmark this server against snapshot-kernel 0.2.1 and a dill checkpoint baseline.

The three peers run side by side on this machine, in one run, through the
same HTTP calls:

- ours: `python main.py` from this repository, on a temporary store;
- ref: snapshot-kernel 0.2.1 from PyPI, installed into a virtual
  environment of its own (in-memory only);
- dill: scripts/dill_baseline.py, one namespace dumped whole with dill after
  every cell, as session-pickling tools do.

Latencies are medians over at least 5 runs (peers interleaved run by run,
so load from other processes on the machine hits all of them alike). The
table, with the machine's description, replaces this mode's section of
BENCHMARKS.md; every other `## ` section of that file is kept.

    python scripts/bench.py --quick      # < 3 minutes, states up to 100 MB
    python scripts/bench.py              # < 30 minutes, states up to 1 GB
    python scripts/bench.py --only a,b3 --no-write   # a subset, print only
    python scripts/bench.py --profile    # where our server's time goes, phase by phase
    python scripts/bench.py --only nb    # notebook runs against nbclient + ipykernel

The notebook workload (nb) compares POST /notebooks/run with nbclient
running the same 30-cell notebook in ipykernel; it needs only this server
(not the reference or dill peers) and, run alone, writes its own section.
"""

import argparse
import contextlib
import datetime
import http.client
import itertools
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import lmdb
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS_ARGS = []  # extra command-line arguments of our server (--ours-config)
TOKEN = "bench-token"
REF_VERSION = "0.2.1"
PEERS = ("ours", "ref", "dill")
TITLES = {"ours": "this server", "ref": f"snapshot-kernel {REF_VERSION}",
          "dill": "dill checkpoint/cell"}
OWNED = ("How to run", "Results: quick", "Results: full", "Results: notebook")
MB = 10 ** 6
_ids = itertools.count()


# Sizes and repetitions ---------------------------------------------------------

def plan(quick):
    """What a run measures: state sizes and repetitions of each mode."""
    if quick:
        return {"mode": "quick", "runs": 5, "sizes": [0, 10 * MB, 100 * MB],
                "str_size": 10 * MB, "big": 100 * MB, "restarts": 3, "starts": 3,
                "hash_calls": 5, "parallel_cells": 4, "interrupt_wait": 3.0,
                "nb_rows": 100_000, "nb_first_runs": 1, "nb_runs": 3}
    return {"mode": "full", "runs": 7, "sizes": [0, 10 * MB, 100 * MB, 1000 * MB],
            "str_size": 100 * MB, "big": 1000 * MB, "restarts": 5, "starts": 5,
            "hash_calls": 7, "parallel_cells": 6, "interrupt_wait": 10.0,
            "nb_rows": 300_000, "nb_first_runs": 3, "nb_runs": 5}


def fmt_size(n):
    """A byte count as B, KB, MB or GB (decimal)."""
    if n is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_ms(seconds):
    """Seconds as milliseconds with sensible precision."""
    if seconds is None:
        return "n/a"
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if ms < 1000 else f"{ms / 1e3:.3g} s"


def median(values):
    """The median, or None for no values."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# Machine -------------------------------------------------------------------------

def revision():
    """The commit of this repository being measured (+ "dirty" with local changes)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head}{' + uncommitted changes' if dirty else ''}" if head else "unknown"


def machine():
    """One line describing the machine, the interpreter and the date."""
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    ram = psutil.virtual_memory().total / 2 ** 30
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"{cpu}, {os.cpu_count()} cores, {ram:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"{now}; commit {revision()}; shared with other jobs, so figures are noisy")


# HTTP ----------------------------------------------------------------------------

class Client:
    """Keep-alive JSON calls to one server (one connection per thread)."""

    def __init__(self, port):
        """Talk to 127.0.0.1:`port`."""
        self.port = port
        self.local = threading.local()

    def _conn(self):
        """This thread's connection."""
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                                                timeout=3600)
            conn.connect()
            # No Nagle delay on small requests: measure the servers, not TCP.
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def call(self, method, path, body=None):
        """One request; returns (seconds, status, decoded JSON answer)."""
        raw = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if raw is not None else {}
        sep = "&" if "?" in path else "?"
        for attempt in (0, 1):
            conn = self._conn()
            started = time.perf_counter()
            try:
                conn.request(method, f"{path}{sep}token={TOKEN}", raw, headers)
                resp = conn.getresponse()
                data = resp.read()
            except (ConnectionError, http.client.HTTPException, OSError):
                # A server closing an idle connection: reconnect once.
                conn.close()
                self.local.conn = None
                if attempt:
                    raise
                continue
            elapsed = time.perf_counter() - started
            try:
                answer = json.loads(data) if data else None
            except ValueError:
                answer = {"error": {"type": "NotJSON", "message": data[:200].decode(
                    errors="replace")}}
            return elapsed, resp.status, answer
        raise AssertionError("unreachable")

    def reset(self):
        """Drop this thread's connection (after a server restart)."""
        conn = getattr(self.local, "conn", None)
        if conn is not None:
            conn.close()
        self.local.conn = None


# Peers ---------------------------------------------------------------------------

def free_port():
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_reference(venv):
    """The Python of a virtual environment holding snapshot-kernel 0.2.1."""
    python = os.path.join(venv, "bin", "python")
    check = [python, "-c", "import importlib.metadata as m; "
             "print(m.version('snapshot-kernel'), m.version('pandas'))"]
    if os.path.exists(python):
        found = subprocess.run(check, capture_output=True, text=True)
        if found.returncode == 0 and found.stdout.split()[0] == REF_VERSION:
            return python
    print(f"installing snapshot-kernel=={REF_VERSION} into {venv} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", f"snapshot-kernel=={REF_VERSION}",
                    "numpy", "pandas"], check=True)
    return python


class Peer:
    """One server under test: its process, its client, its store."""

    def __init__(self, kind, workdir, ref_python):
        """Prepare (not start) a peer of `kind` with its files under `workdir`."""
        self.kind = kind
        self.dir = os.path.join(workdir, kind)
        os.makedirs(self.dir, exist_ok=True)
        self.ref_python = ref_python
        self.proc = None
        self.client = None
        self.log = None

    @property
    def data_dir(self):
        """Our LMDB store (ours only)."""
        return os.path.join(self.dir, "store")

    @property
    def checkpoint(self):
        """The dill baseline's checkpoint file."""
        return os.path.join(self.dir, "namespace.dill")

    def command(self, port):
        """The command line that starts this peer on `port`."""
        bind = f"127.0.0.1:{port}"
        if self.kind == "ours":
            return [sys.executable, os.path.join(ROOT, "main.py"), "--bind", bind,
                    "--token", TOKEN, "--data-dir", self.data_dir, *OURS_ARGS]
        if self.kind == "ref":
            return [self.ref_python, "-m", "snapshot_kernel.main", "--bind", bind,
                    "--token", TOKEN]
        return [sys.executable, os.path.join(ROOT, "scripts", "dill_baseline.py"),
                "--bind", bind, "--token", TOKEN, "--checkpoint", self.checkpoint]

    def start(self, first_cell=None, state="initial", timeout=120):
        """Start the server; return (seconds to /health, seconds to the first cell's answer)."""
        port = free_port()
        self.log = open(os.path.join(self.dir, "server.log"), "ab")
        started = time.perf_counter()
        # The reference wants its own cwd so it cannot import this repository's modules.
        self.proc = subprocess.Popen(self.command(port), cwd=self.dir, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=self.log)
        self.client = Client(port)
        up = None
        while time.perf_counter() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}; "
                                   f"see {self.log.name}")
            try:
                # Any HTTP answer will do: the reference has no /health route.
                self.client.call("GET", "/health")
                up = time.perf_counter() - started
                break
            except OSError:
                self.client.reset()
                time.sleep(0.005)
        if up is None:
            raise RuntimeError(f"{self.kind} did not come up in {timeout} s")
        if first_cell is None:
            return up, None
        answer = self.execute(first_cell, state)[1]
        first = time.perf_counter() - started
        if answer.get("error"):
            raise RuntimeError(f"{self.kind}: first cell failed: {answer['error']}")
        return up, first

    def stop(self):
        """SIGTERM the server (and so its workers) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()
        self.proc = None

    def execute(self, code, state="initial", new=None, exec_id=None):
        """POST /execute; returns (seconds, answer)."""
        body = {"code": code, "exec_id": exec_id or f"b{next(_ids)}", "state_name": state,
                "new_state_name": new or f"n{next(_ids)}"}
        # Earlier cells' writes (the dill peer's checkpoints above all) are flushed now,
        # not by the kernel while this cell waits on its own flush.
        os.sync()
        elapsed, status, answer = self.client.call("POST", "/execute", body)
        if status != 200:
            answer = {"error": answer.get("error") if answer else {"ename": str(status)}}
        return elapsed, answer

    def must(self, code, state="initial", new=None):
        """Execute and fail loudly if the cell raised; returns (seconds, answer)."""
        elapsed, answer = self.execute(code, state, new)
        if answer.get("error"):
            raise RuntimeError(f"{self.kind}: {code[:60]!r} failed: {answer['error']}")
        return elapsed, answer

    def delete(self, name):
        """Delete a state (frees the reference's memory; retires ours)."""
        self.client.call("DELETE", f"/states/{name}")

    def store_usage(self):
        """What the store holds now: ({blob key: stored bytes}, manifest bytes, file bytes).

        Read from a read-only LMDB handle without the lock file, between
        cells, when the server is not writing.
        """
        if self.kind == "dill":
            size = os.path.getsize(self.checkpoint) if os.path.exists(self.checkpoint) else 0
            return {}, size, size
        env = lmdb.open(self.data_dir, readonly=True, lock=False, max_dbs=4)
        try:
            blobs = env.open_db(b"blobs", create=False)
            states = env.open_db(b"states", create=False)
            with env.begin(buffers=True) as txn:
                sizes = {bytes(k): len(v) for k, v in txn.cursor(db=blobs)}
                manifests = sum(len(v) for _, v in txn.cursor(db=states))
            used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        finally:
            env.close()
        return sizes, manifests, used

    def memory(self):
        """(server RSS, sum of PSS of its descendants, number of descendants)."""
        proc = psutil.Process(self.proc.pid)
        children = proc.children(recursive=True)
        pss = 0
        for child in children:
            with contextlib.suppress(psutil.Error):
                pss += child.memory_full_info().pss
        return proc.memory_info().rss, pss, len(children)


def added_bytes(before, after):
    """Bytes a cell added to the store: new blobs plus manifest growth."""
    blobs_before, manifests_before, _ = before
    blobs_after, manifests_after, _ = after
    new = sum(size for key, size in blobs_after.items() if key not in blobs_before)
    return new + manifests_after - manifests_before


# Result table ----------------------------------------------------------------------

class Table:
    """Rows of the results table, with ratios to each peer and the target."""

    def __init__(self):
        """No rows yet."""
        self.rows = []
        self.details = []

    def add(self, workload, metric, values, target=None, met=None, better="lower",
            kind="time"):
        """A row: `values` {peer: number or text}; ratios are peer / ours."""
        self.rows.append({"workload": workload, "metric": metric, "values": values,
                          "target": target, "met": met, "better": better, "kind": kind})
        print(f"  {workload:10} {metric:44} " + "  ".join(
            f"{p}={self.cell(values.get(p), kind)}" for p in PEERS) +
            (f"  target {target}: {'met' if met else 'MISSED'}" if target else ""), flush=True)

    @staticmethod
    def cell(value, kind):
        """One value as text."""
        if value is None:
            return "n/a"
        if isinstance(value, str):
            return value
        return {"time": fmt_ms, "bytes": fmt_size}.get(kind, lambda v: f"{v:.3g}")(value)

    @staticmethod
    def ratio(ours, other, better):
        """How many times better ours is than `other` (>1 = ours better)."""
        if not isinstance(ours, (int, float)) or not isinstance(other, (int, float)):
            return "n/a"
        if better == "higher":
            ours, other = other, ours
        if ours <= 0:
            return "∞" if other > 0 else "1×"
        return f"{other / ours:.3g}×"

    def markdown(self):
        """The table as markdown."""
        head = ["workload", "metric", TITLES["ours"], TITLES["ref"], "ours vs ref",
                TITLES["dill"], "ours vs dill", "target", "met"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            v = r["values"]
            cells = [r["workload"], r["metric"], self.cell(v.get("ours"), r["kind"]),
                     self.cell(v.get("ref"), r["kind"]),
                     self.ratio(v.get("ours"), v.get("ref"), r["better"]),
                     self.cell(v.get("dill"), r["kind"]),
                     self.ratio(v.get("ours"), v.get("dill"), r["better"]),
                     r["target"] or "", "" if r["met"] is None else ("yes" if r["met"]
                                                                     else "**no**")]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


# Workloads -------------------------------------------------------------------------

SETUP = "import numpy as np\nimport pandas as pd\n"


def frame_cell(size, strings=False):
    """A cell making a DataFrame `df` of about `size` bytes, and `x`; shows the size."""
    if size == 0:
        return "x = 0"
    if strings:
        # object-dtype Python strings: ~66 bytes a value, plus a float column.
        rows = max(1, size // 74)
        make = (f"_r = np.random.default_rng(0)\n"
                f"df = pd.DataFrame({{'k': _r.integers(0, 10**9, {rows}).astype(str)"
                f".astype(object), 'v': _r.random({rows})}})\n"
                f"df['k'] = df['k'].astype(object)\ndel _r\n")
    else:
        rows = max(1, size // 64)
        make = (f"df = pd.DataFrame(np.random.default_rng(0).random(({rows}, 8)), "
                f"columns=list('abcdefgh'))\n")
    return SETUP + make + "x = 0\nint(df.memory_usage(deep=True).sum())"


def result_text(answer):
    """The text/plain of a cell's execute_result, or None."""
    for out in answer.get("output") or []:
        if out.get("output_type") == "execute_result":
            return out["data"].get("text/plain")
    return None


def wl_trivial(peers, p, table, keep):
    """(a) `x += 1` on states of growing size; keeps the largest numeric states in `keep`."""
    cases = [(s, False) for s in p["sizes"]] + [(p["str_size"], True)]
    for size, strings in cases:
        label = ("0 B" if size == 0 else fmt_size(size)) + (" str" if strings else "")
        base = f"a-{label}".replace(" ", "")
        for peer in peers.values():
            if peer.kind == "dill":
                # One namespace: start from an empty one, as the other peers do.
                peer.client.call("POST", "/reset", {})
            peer.must(frame_cell(size, strings), new=base)
            peer.delete(peer.must("x += 1", base)[1]["state_name"])  # warm-up, not counted
        times = {k: [] for k in peers}
        for _ in range(p["runs"]):
            for peer in peers.values():
                elapsed, answer = peer.must("x += 1", base)
                times[peer.kind].append(elapsed)
                peer.delete(answer["state_name"])
        med = {k: median(v) for k, v in times.items()}
        ok = med["ours"] <= 0.010
        target = "≤ 10 ms"
        if size == 0:
            ok = ok and med["ours"] <= 1.5 * med["ref"]
            target = "≤ 10 ms; ≤ 1.5× ref"
        elif size == 100 * MB and not strings:
            ok = ok and med["ref"] >= 10 * med["ours"]
            target = "≤ 10 ms; ≥ 10× faster than ref"
        table.add("a", f"x += 1, state {label} (median of {p['runs']})", med, target, ok)
        if size in (0, 100 * MB) and not strings:
            # The same with a pause before each cell, as between a person's cells: the
            # difference is what back-to-back cells wait for (e.g. a spare still warming).
            paused = {k: [] for k in peers}
            for _ in range(p["runs"]):
                for peer in peers.values():
                    time.sleep(0.2)
                    elapsed, answer = peer.must("x += 1", base)
                    paused[peer.kind].append(elapsed)
                    peer.delete(answer["state_name"])
            table.add("a", f"x += 1, state {label}, 0.2 s pause before each cell",
                      {k: median(v) for k, v in paused.items()})
        if size == p["big"] and not strings:
            keep["big"] = base
        else:
            for peer in peers.values():
                peer.delete(base)


def wl_metadata(peers, p, table, keep):
    """(e) /symbol_hashes and /alias_groups on the largest state."""
    base = keep["big"]
    for route, body in (("/symbol_hashes", {"state_name": base, "symbols": ["df", "x"]}),
                        ("/alias_groups", {"state_name": base})):
        times = {}
        for peer in peers.values():
            if peer.kind == "dill":
                times["dill"] = "n/a (no states)"
                continue
            samples = []
            for _ in range(p["hash_calls"]):
                elapsed, status, answer = peer.client.call("POST", route, body)
                if status != 200:
                    raise RuntimeError(f"{peer.kind} {route}: {status} {answer}")
                samples.append(elapsed)
            times[peer.kind] = median(samples)
        table.add("e", f"{route}, {fmt_size(p['big'])} state (median of {p['hash_calls']})",
                  times, "< 20 ms", times["ours"] < 0.020)


def wl_sequence(peers, name, setup, cells, table):
    """Run a notebook's cells in order on every peer: per-cell latency and store growth."""
    per = {}
    for peer in peers.values():
        if peer.kind == "dill":
            peer.client.call("POST", "/reset", {})
        state = peer.must(setup, new=f"{name}-0")[1]["state_name"]
        rows = []
        usage = peer.store_usage() if peer.kind != "ref" else None
        for i, code in enumerate(cells, 1):
            elapsed, answer = peer.must(code, state, new=f"{name}-{i}")
            state = answer["state_name"]
            row = {"latency": elapsed, "exec_ms": answer.get("exec_ms")}
            if peer.kind == "ours":
                now = peer.store_usage()
                row["added"] = added_bytes(usage, now)
                row["pages"] = now[2] - usage[2]
                usage = now
            elif peer.kind == "dill":
                row["added"] = answer["checkpoint_bytes"]
            rows.append(row)
        per[peer.kind] = rows
    return per


def wl_append(peers, p, table, details):
    """(b1) 30 cells, each adding a new 1 MiB array."""
    # Seeds used nowhere else: a shared prefix of another random array would dedupe.
    cells = [f"a{i} = np.random.default_rng({1000 + i}).random(131072)" for i in range(30)]
    per = wl_sequence(peers, "b1", SETUP, cells, table)
    details.append(("b1: store growth of each cell, KB (this server)",
                    " ".join(f"{r['added'] / 1e3:.0f}" for r in per["ours"])))
    lat = {k: median(r["latency"] for r in rows) for k, rows in per.items()}
    table.add("b1", "append 1 MiB array: latency/cell (median of 30)", lat)
    ours = [r["added"] for r in per["ours"]]
    added = {"ours": median(ours), "ref": "n/a (no store)",
             "dill": median(r["added"] for r in per["dill"])}
    ok = max(ours) <= 1.2 * 2 ** 20
    table.add("b1", "bytes written to the store/cell (median; dill: file size)", added,
              "~1 MB/cell, old arrays never again", ok, kind="bytes")
    table.add("b1", "largest growth of one cell; total for 30 cells",
              {"ours": f"{fmt_size(max(ours))}; {fmt_size(sum(ours))}",
               "ref": "n/a (no store)",
               "dill": f"{fmt_size(max(r['added'] for r in per['dill']))}; "
                       f"{fmt_size(sum(r['added'] for r in per['dill']))}"})


# (code, bytes of the columns it changes) on a 1M-row frame a, b, c, d.
UPDATES = [
    ("df['e'] = df['a'] * 2", 8 * MB),
    ("df.loc[df['a'] > 0.5, 'b'] = 0.0", 8 * MB),
    ("df.rename(columns={'c': 'c2'}, inplace=True)", 0),
    ("df.drop(columns=['d'], inplace=True)", 0),
    ("df['f'] = np.sqrt(df['a'])", 8 * MB),
    ("df.loc[df['c2'] % 7 == 0, 'e'] = -1.0", 8 * MB),
    ("df['g'] = df['c2'] * 3", 8 * MB),
    ("df.rename(columns={'g': 'g2'}, inplace=True)", 0),
    ("df['b'] *= 2", 8 * MB),
    ("df.drop(columns=['f'], inplace=True)", 0),
    ("df['h'] = df['a'] - df['b']", 8 * MB),
    # Sorting moves every column (a, b, c2, e, g2, h) and the index.
    ("df.sort_values('a', inplace=True)", 7 * 8 * MB),
]
UPDATE_SETUP = (SETUP + "_r = np.random.default_rng(0)\n"
                "df = pd.DataFrame({'a': _r.random(1_000_000), 'b': _r.random(1_000_000), "
                "'c': _r.integers(0, 1000, 1_000_000), 'd': _r.random(1_000_000)})\ndel _r")
SLACK = 64 * 1024  # a manifest and small pickles: allowed on top of 1.2x


def wl_update(peers, p, table, details):
    """(b2) 12 in-place updates of a 1M-row DataFrame."""
    per = wl_sequence(peers, "b2", UPDATE_SETUP, [c for c, _ in UPDATES], table)
    lines = ["| cell | changed columns | ours: latency | ours: store growth | growth / changed "
             "| ref: latency | dill: latency | dill: bytes written |", "|" + "---|" * 8]
    worst = 0.0
    ok = True
    for i, (code, changed) in enumerate(UPDATES):
        o, r, d = per["ours"][i], per["ref"][i], per["dill"][i]
        ok = ok and o["added"] <= 1.2 * changed + SLACK
        factor = o["added"] / changed if changed else None
        worst = max(worst, factor or 0)
        lines.append(f"| `{code}` | {fmt_size(changed)} | {fmt_ms(o['latency'])} | "
                     f"{fmt_size(o['added'])} | "
                     f"{'%.2f×' % factor if factor is not None else 'n/a (0 changed)'} | "
                     f"{fmt_ms(r['latency'])} | {fmt_ms(d['latency'])} | "
                     f"{fmt_size(d['added'])} |")
    details.append(("b2: per cell", "\n".join(lines)))
    lat = {k: median(r["latency"] for r in rows) for k, rows in per.items()}
    table.add("b2", "update 1M-row frame: latency/cell (median of 12)", lat)
    added = {"ours": median(r["added"] for r in per["ours"]), "ref": "n/a (no store)",
             "dill": median(r["added"] for r in per["dill"])}
    table.add("b2", "bytes written/cell (median; dill: file size)", added,
              "≤ 1.2× changed columns (+64 KB) every cell", ok, kind="bytes")
    table.add("b2", "worst growth / changed bytes (cells that change data)",
              {"ours": f"{worst:.2f}×", "ref": "n/a (no store)", "dill": "whole file"},
              "≤ 1.2×", worst <= 1.2)


READS = ["df.head()", "df.describe()", "df['c'].value_counts()", "df.shape", "len(df)",
         "df['a'].mean()", "df.dtypes", "df.tail(3)", "df.columns", "df['b'].max()"]


def wl_read(peers, p, table):
    """(b3) 20 cells that only look at a 1M-row DataFrame."""
    cells = (READS * 2)[:20]
    per = wl_sequence(peers, "b3", UPDATE_SETUP, cells, table)
    lat = {k: median(r["latency"] for r in rows) for k, rows in per.items()}
    table.add("b3", "read-only cell on 1M-row frame: latency (median of 20)", lat)
    # A cell's own time is what the plain exec of the dill baseline took for it.
    overhead = {k: median(r["latency"] - d["exec_ms"] / 1e3
                          for r, d in zip(rows, per["dill"]))
                for k, rows in per.items()}
    overhead["dill"] = median(r["latency"] - r["exec_ms"] / 1e3 for r in per["dill"])
    table.add("b3", "overhead/cell: latency - the cell's plain exec time", overhead,
              "< 15 ms", overhead["ours"] < 0.015)
    added = {"ours": median(r["added"] for r in per["ours"]), "ref": "n/a (no store)",
             "dill": median(r["added"] for r in per["dill"])}
    worst = max(r["added"] for r in per["ours"])
    table.add("b3", "bytes written/cell (median; dill: file size)", added,
              "< 1 KB every cell", worst < 1000, kind="bytes")
    table.add("b3", "largest store growth of one cell", {"ours": worst, "ref": "n/a (no store)",
                                                         "dill": max(r["added"] for r in
                                                                     per["dill"])},
              kind="bytes")


def wl_parallel(peers, p, table):
    """(f) two executions at once from one state against one after the other."""
    # The loop runs in a function so the reference's tracked globals do not dominate.
    code = ("def spin(n):\n    t = 0\n    for i in range(n):\n        t += i\n    return t\n"
            "spin(3_000_000)")
    n = p["parallel_cells"]
    gains = {}
    for peer in peers.values():
        if peer.kind == "dill":
            gains["dill"] = "n/a (one namespace)"
            continue
        base = peer.must(SETUP + "w = np.ones(1000)", new="f-base")[1]["state_name"]
        peer.delete(peer.must(code, base)[1]["state_name"])  # warm-up
        made = []

        def run(count):
            """Run `count` cells from the base state, one after the other."""
            for _ in range(count):
                made.append(peer.must(code, base)[1]["state_name"])

        started = time.perf_counter()
        run(n)
        serial = time.perf_counter() - started
        threads = [threading.Thread(target=run, args=(n // 2,)) for _ in range(2)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        parallel = time.perf_counter() - started
        gains[peer.kind] = serial / parallel
        for name in made:
            peer.delete(name)
        peer.delete(base)
        print(f"    {peer.kind}: {n} cells serial {serial:.2f} s, 2 at once {parallel:.2f} s",
              flush=True)
    table.add("f", f"throughput, 2 at once / one after the other ({n} cells)", gains,
              "≥ 1.7×", gains["ours"] >= 1.7, better="higher", kind="x")


def wl_interrupt(peers, p, table):
    """(c) interrupt a time.sleep(60) cell: seconds from /interrupt to the cell's answer."""
    results = {}
    for peer in peers.values():
        if peer.kind == "dill":
            results["dill"] = "n/a (no interrupt)"
            continue
        runs = p["runs"] if peer.kind == "ours" else 1
        samples = []
        for _ in range(runs):
            exec_id = f"int{next(_ids)}"
            box = {}

            def run():
                """The long cell, answered when it is interrupted."""
                with contextlib.suppress(OSError):
                    # The reference's cell may outlive the run; its server is stopped under it.
                    box["answer"] = peer.execute("import time\ntime.sleep(60)",
                                                 exec_id=exec_id)[1]
                    box["at"] = time.perf_counter()

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            time.sleep(0.5)
            sent = time.perf_counter()
            peer.client.call("POST", "/interrupt", {"exec_id": exec_id})
            thread.join(p["interrupt_wait"])
            if thread.is_alive():
                samples.append(None)
                results[peer.kind] = f"not stopped after {p['interrupt_wait']:.0f} s"
                break
            samples.append(box["at"] - sent)
        else:
            results[peer.kind] = median(samples)
    table.add("c", "interrupt time.sleep(60): /interrupt to answer", results, "< 0.5 s",
              isinstance(results["ours"], float) and results["ours"] < 0.5)


def wl_restart(peers, p, table, keep):
    """(d) restart on a store holding the big state, then run 1 + 1 from it."""
    times = {"ref": "n/a (in memory: a restart loses every state)"}
    dill = peers["dill"]
    dill.client.call("POST", "/reset", {})
    dill.must(frame_cell(p["big"]))
    for kind in ("ours", "dill"):
        peer = peers[kind]
        samples = []
        for _ in range(p["restarts"]):
            peer.stop()
            samples.append(peer.start("1 + 1", keep["big"])[1])
        times[kind] = median(samples)
    table.add("d", f"restart on a {fmt_size(p['big'])} state: start to 1 + 1 answered "
              f"(median of {p['restarts']})", times, "< 1 s", times["ours"] < 1.0)


def wl_start_memory(peers, p, table):
    """(g) server start to first answer; memory with 8 live states."""
    starts = {k: [] for k in peers}
    ups = {k: [] for k in peers}
    for _ in range(p["starts"]):
        for peer in peers.values():
            peer.stop()
            if peer.kind == "ours":
                shutil.rmtree(peer.data_dir, ignore_errors=True)
            up, first = peer.start("1 + 1")
            ups[peer.kind].append(up)
            starts[peer.kind].append(first)
    table.add("g", f"start to first HTTP answer (median of {p['starts']})",
              {k: median(v) for k, v in ups.items()})
    med = {k: median(v) for k, v in starts.items()}
    table.add("g", f"start to first answer of 1 + 1 (median of {p['starts']})", med,
              "< 300 ms", med["ours"] < 0.300)
    # Eight states of a notebook, each adding an 8 MB array to the one before.
    rss, pss = {}, {}
    for peer in peers.values():
        state = peer.must(SETUP, new="g-0")[1]["state_name"]
        for i in range(1, 8):
            state = peer.must(f"m{i} = np.random.default_rng({i}).random(1_000_000)", state,
                              new=f"g-{i}")[1]["state_name"]
        if peer.kind == "ours":
            live = sum(bool(peer.client.call("GET", f"/states/g-{i}")[2].get("live"))
                       for i in range(8))
            print(f"    ours: {live} of 8 states live", flush=True)
        server_rss, children_pss, count = peer.memory()
        rss[peer.kind] = server_rss
        pss[peer.kind] = children_pss if count else "no child processes"
        for i in range(8):
            peer.delete(f"g-{i}")
    table.add("g", "server RSS with 8 live states (8 x 8 MB arrays)", rss, kind="bytes")
    table.add("g", "children's PSS (sum) with 8 live states", pss, kind="bytes")


# The notebook workload: a data notebook of 30 cells (load, clean, plots, a model fit),
# written so that it means the same in both orders (no cell rebinds another's names).
# Cell 14 is the parameter edited in the middle.
NB_EDITED = 14


def nb_sources(csv_path, threshold=100):
    """The 30 cells of the notebook workload."""
    return [
        "import numpy as np\nimport pandas as pd\nimport matplotlib.pyplot as plt",
        f"PATH = {csv_path!r}\nSEED = 7",
        "raw = pd.read_csv(PATH, parse_dates=['date'])\nraw.shape",
        "raw.head()",
        "clean = raw.dropna(subset=['price', 'qty'])\nclean = clean[clean['qty'] > 0]\n"
        "len(clean)",
        "df = clean.assign(region=clean['region'].astype('category'),\n"
        "                  product=clean['product'].astype('category'),\n"
        "                  revenue=clean['price'] * clean['qty'],\n"
        "                  month=clean['date'].dt.to_period('M').dt.to_timestamp())\ndf.dtypes",
        "df.describe()",
        "df['price'].plot.hist(bins=50, figsize=(6, 3), title='price')\nplt.show()",
        "df['qty'].plot.hist(bins=30, figsize=(6, 3), title='quantity')\nplt.show()",
        "monthly = df.groupby('month')['revenue'].sum()\nmonthly.tail()",
        "monthly.plot(figsize=(6, 3), title='revenue by month')\nplt.show()",
        "by_region = df.groupby('region', observed=True)['revenue'].agg(['sum', 'mean', "
        "'count'])\nby_region",
        "by_region['sum'].plot.bar(figsize=(6, 3), title='revenue by region')\nplt.show()",
        "by_product = df.groupby('product', observed=True)['qty'].sum()\nby_product",
        f"THRESHOLD = {threshold}",
        "big = df[df['revenue'] > THRESHOLD]\nprint(len(big), 'orders over', THRESHOLD)",
        "share = big.groupby('product', observed=True)['revenue'].sum() / "
        "df['revenue'].sum()\nshare.round(3)",
        "share.plot.barh(figsize=(6, 3), title='share of big orders')\nplt.show()",
        "pivot = df.pivot_table(index='region', columns='product', values='qty', "
        "aggfunc='sum', observed=True)\npivot",
        "corr = df[['price', 'qty', 'revenue', 'discount']].corr()\ncorr.round(2)",
        "plt.figure(figsize=(4, 4))\nplt.imshow(corr, cmap='viridis')\nplt.colorbar()\n"
        "plt.show()",
        "rng = np.random.default_rng(SEED)\nmask = rng.random(len(df)) < 0.8\n"
        "train = df[mask]\ntest = df[~mask]\nlen(train), len(test)",
        "def design(frame):\n    return np.column_stack([np.ones(len(frame)), frame['price'], "
        "frame['discount'], frame['qty']])",
        "coef = np.linalg.lstsq(design(train), train['revenue'].to_numpy(), rcond=None)[0]\n"
        "coef.round(3)",
        "pred = design(test) @ coef\n"
        "rmse = float(np.sqrt(np.mean((pred - test['revenue'].to_numpy()) ** 2)))\nrmse",
        "plt.figure(figsize=(4, 4))\nplt.scatter(test['revenue'].to_numpy()[:2000], "
        "pred[:2000], s=2)\nplt.show()",
        "resid = test['revenue'].to_numpy() - pred\nplt.figure(figsize=(6, 3))\n"
        "plt.hist(resid, bins=50)\nplt.show()",
        "top = df.nlargest(10, 'revenue')[['date', 'region', 'product', 'revenue']]\ntop",
        "weekday = df.groupby(df['date'].dt.day_name())['revenue'].mean().round(1)\nweekday",
        "print(f\"{len(df)} orders, revenue {df['revenue'].sum():,.0f}, rmse {rmse:.2f}\")",
    ]


def nb_data(path, rows):
    """Write the workload's sales CSV (dates, categories, prices with gaps)."""
    import numpy as np
    import pandas as pd
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({
        "date": pd.Timestamp("2023-01-01") + pd.to_timedelta(rng.integers(0, 730, rows),
                                                             unit="D"),
        "region": rng.choice(["north", "south", "east", "west"], rows),
        "product": rng.choice(list("ABCDEFGH"), rows),
        "price": rng.gamma(2.0, 20.0, rows).round(2),
        "qty": rng.integers(0, 10, rows),
        "discount": rng.random(rows).round(2)})
    frame.loc[rng.random(rows) < 0.01, "price"] = np.nan
    frame.to_csv(path, index=False)


def nb_jupyter(sources, runs):
    """nbclient + ipykernel on the whole notebook: (median seconds with the kernel's
    start, median seconds of the cells alone, [median seconds of each cell])."""
    import nbformat
    from nbclient import NotebookClient
    totals, cells_only, per_cell = [], [], []
    for _ in range(runs):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
        started = time.perf_counter()
        NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=True).execute()
        totals.append(time.perf_counter() - started)
        times = []
        for cell in nb.cells:
            ex = cell.metadata["execution"]
            times.append((datetime.datetime.fromisoformat(ex["shell.execute_reply"].rstrip("Z"))
                          - datetime.datetime.fromisoformat(
                              ex["iopub.execute_input"].rstrip("Z"))).total_seconds())
            if any(o.get("output_type") == "error" for o in cell.outputs):
                raise RuntimeError(f"nbclient: a cell failed: {cell.source[:80]!r}")
        per_cell.append(times)
        cells_only.append(sum(times))
    return median(totals), median(cells_only), [median(c) for c in zip(*per_cell)]


def nb_run(peer, name, sources, order):
    """POST /notebooks/run; (seconds, answer), failing loudly on a failed cell."""
    cells = [{"id": f"c{n:02d}", "source": src} for n, src in enumerate(sources)]
    elapsed, status, answer = peer.client.call("POST", "/notebooks/run", {
        "notebook": name, "cells": cells, "order": order})
    if status != 200:
        raise RuntimeError(f"/notebooks/run answered {status}: {answer}")
    bad = [c for c in answer["cells"] if c["status"] not in ("ran", "reused")]
    if bad:
        raise RuntimeError(f"notebook run: {bad[0]['id']} {bad[0]['status']}: {bad[0]['error']}")
    return elapsed, answer


def wl_notebook(workdir, p, table, details):
    """(nb) the 30-cell data notebook: first run, run with nothing changed, one-cell edit,
    in both orders, against nbclient running the whole notebook in ipykernel."""
    folder = os.path.join(workdir, "nb")
    os.makedirs(folder, exist_ok=True)
    csv_path = os.path.join(folder, "sales.csv")
    nb_data(csv_path, p["nb_rows"])
    sources = nb_sources(csv_path)
    print("    nbclient + ipykernel ...", flush=True)
    jupyter_total, jupyter_cells, per_cell = nb_jupyter(sources, p["nb_first_runs"])
    peer = Peer("ours", folder, None)
    peer.start("1 + 1")
    time.sleep(3)  # the warm zygote (numpy, pandas, matplotlib imported) is up by then
    lines = ["| order | run | this server | cells that ran | their time in ipykernel | "
             "their time in this kernel | beyond their ipykernel time | beyond their time "
             "in this kernel |", "|" + "---|" * 8]
    try:
        for order in ("notebook", "dataflow"):
            first = []
            for _ in range(p["nb_first_runs"]):
                peer.client.call("POST", "/reset", {})
                elapsed, answer = nb_run(peer, f"nb-{order}", sources, order)
                first.append((elapsed, sum(c["took_s"] for c in answer["cells"])))
            unchanged = [nb_run(peer, f"nb-{order}", sources, order)
                         for _ in range(p["nb_runs"])]
            assert all(set(c["status"] for c in a["cells"]) == {"reused"}
                       for _, a in unchanged), "a run with nothing changed ran cells"
            edits = []
            for k in range(p["nb_runs"]):
                # A new value each time: an earlier value's results would be reused.
                value = 101 + k + (50 if order == "dataflow" else 0)
                elapsed, answer = nb_run(peer, f"nb-{order}",
                                         nb_sources(csv_path, threshold=value), order)
                ran = [n for n, c in enumerate(answer["cells"]) if c["status"] == "ran"]
                edits.append((elapsed, ran, sum(per_cell[n] for n in ran),
                              sum(answer["cells"][n]["took_s"] for n in ran)))
            rows = [("first run", [e for e, _ in first], "all 30", jupyter_cells,
                     median(t for _, t in first)),
                    ("nothing changed", [e for e, _ in unchanged], "none", 0.0, 0.0),
                    (f"cell {NB_EDITED} edited", [e for e, _, _, _ in edits],
                     f"{len(edits[0][1])}: {', '.join(str(n) for n in edits[0][1])}",
                     median(t for _, _, t, _ in edits), median(t for _, _, _, t in edits))]
            for label, walls, cells_ran, ipy, ours in rows:
                wall = median(walls)
                lines.append(f"| {order} | {label} | {fmt_ms(wall)} | {cells_ran} | "
                             f"{fmt_ms(ipy)} | {fmt_ms(ours)} | {fmt_ms(wall - ipy)} | "
                             f"{fmt_ms(wall - ours)} |")
            still = median(e for e, _ in unchanged)
            beyond = median(e - t for e, _, t, _ in edits)
            runner = median(e - t for e, _, _, t in edits)
            table.add("nb", f"{order} order: first run (median of {p['nb_first_runs']}; "
                      f"nbclient {fmt_ms(jupyter_total)})",
                      {"ours": median(e for e, _ in first), "ref": "n/a", "dill": "n/a"})
            table.add("nb", f"{order} order: run with nothing changed (median of {p['nb_runs']})",
                      {"ours": still, "ref": "n/a", "dill": "n/a"}, "< 100 ms", still < 0.100)
            table.add("nb", f"{order} order: one-cell edit ({len(edits[0][1])} cells run), "
                      f"time beyond their time in ipykernel (median of {p['nb_runs']})",
                      {"ours": beyond, "ref": "n/a", "dill": "n/a"}, "< 100 ms",
                      beyond < 0.100)
            table.add("nb", f"{order} order: one-cell edit, time beyond their time in this "
                      f"kernel (the notebook runner's own)", {"ours": runner, "ref": "n/a",
                                                              "dill": "n/a"})
    finally:
        peer.stop()
    details.append(("nb: a 30-cell data notebook "
                    f"({p['nb_rows']:,} rows; load, clean, 9 plots, a least-squares fit); "
                    f"nbclient runs it whole in ipykernel in {fmt_ms(jupyter_total)} (kernel "
                    f"start included; its cells alone {fmt_ms(jupyter_cells)}). A cell's time "
                    "in ipykernel is nbclient's timing of it; its time in this kernel is "
                    "`took_s` (composing its input state, running it, storing its state). In "
                    "notebook order the edited parameter's reader also reads `df`, and a read "
                    "may mutate, so every later reader of `df` runs again", "\n".join(lines)))


WORKLOADS = ("g", "a", "e", "b1", "b2", "b3", "f", "c", "d", "nb")


def run(p, only, venv, keep_dir):
    """Start the peers, run the workloads; return (table, details, seconds)."""
    started = time.perf_counter()
    wanted = [w for w in WORKLOADS if only is None or w in only]
    # The notebook workload starts a server of its own; the others need the three peers.
    peered = [w for w in wanted if w != "nb"]
    ref_python = ensure_reference(venv) if peered else None
    workdir = tempfile.mkdtemp(prefix="snapshot-bench-")
    peers = {k: Peer(k, workdir, ref_python) for k in PEERS} if peered else {}
    table, details, keep = Table(), [], {}
    try:
        for peer in peers.values():
            peer.start()
        if ("e" in wanted or "d" in wanted) and "a" not in wanted:
            # e and d use the big state made by a.
            for peer in peers.values():
                peer.must(frame_cell(p["big"]), new="big")
            keep["big"] = "big"
        for name in wanted:
            print(f"[{time.perf_counter() - started:6.1f} s] workload {name}", flush=True)
            if name == "g":
                wl_start_memory(peers, p, table)
            elif name == "a":
                wl_trivial(peers, p, table, keep)
            elif name == "e":
                wl_metadata(peers, p, table, keep)
            elif name == "b1":
                wl_append(peers, p, table, details)
            elif name == "b2":
                wl_update(peers, p, table, details)
            elif name == "b3":
                wl_read(peers, p, table)
            elif name == "f":
                wl_parallel(peers, p, table)
            elif name == "c":
                wl_interrupt(peers, p, table)
            elif name == "d":
                wl_restart(peers, p, table, keep)
            elif name == "nb":
                wl_notebook(workdir, p, table, details)
    finally:
        for peer in peers.values():
            peer.stop()
        if keep_dir:
            print(f"logs and stores kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return table, details, time.perf_counter() - started


# Profile of our hot path -------------------------------------------------------------

# Installed as sitecustomize.py into our server and its workers by --profile: it
# wraps kernel and store methods to log their durations (and with --cprofile a
# cProfile of each cell's child) as JSON lines. Nothing in kernel/ is changed.
PROFILE_HOOKS = """
\"\"\"bench.py --profile: phase timings of the snapshot kernel's processes.\"\"\"
import json
import os
import time

OUT = os.environ.get("SNAPBENCH_PROFILE_DIR")


def log(rec):
    \"\"\"Append one record of this process.\"\"\"
    with open(os.path.join(OUT, "records.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\\n")


def wrap(owner, name, key, per_cell=False):
    \"\"\"Time owner.name: into the running cell's record, or as a record of its own.\"\"\"
    orig = getattr(owner, name)

    def timed(*args, **kwargs):
        \"\"\"The wrapped call.\"\"\"
        started = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            ms = (time.perf_counter() - started) * 1e3
            if CELL is not None:
                CELL[key] = CELL.get(key, 0.0) + ms
            elif not per_cell:
                log({key: ms})
    setattr(owner, name, timed)


CELL = None


def install():
    \"\"\"Wrap the methods on the hot path.\"\"\"
    global CELL
    from kernel.server import pool, registry
    from kernel.worker import holder as worker
    from storage import snapshot, store
    holder = worker.Holder
    execute = holder.execute

    def execute_timed(self, msg):
        \"\"\"One cell in a child, from its request to its answer: a record (and profile).\"\"\"
        global CELL
        CELL = {"t0": time.perf_counter()}
        if os.environ.get("SNAPBENCH_CPROFILE"):
            import cProfile
            CELL["prof"] = cProfile.Profile()
            CELL["prof"].enable()
        try:
            return execute(self, msg)
        finally:
            rec, CELL = CELL, None
            prof = rec.pop("prof", None)
            if prof is not None:
                prof.disable()
                prof.dump_stats(os.path.join(OUT, f"cell-{os.getpid()}-{time.time_ns()}.prof"))
            rec["child_total"] = (time.perf_counter() - rec.pop("t0")) * 1e3
            log(rec)

    holder.execute = execute_timed
    for name in ("prepare", "run_cell", "save"):
        wrap(holder, name, "child_" + name, per_cell=True)
    wrap(holder, "warm", "spare_warm")
    wrap(snapshot, "save_groups", "child_save_groups", per_cell=True)
    wrap(store.Store, "put_state", "child_put_state", per_cell=True)
    wrap(store.Store, "missing", "child_store_missing", per_cell=True)
    wrap(registry.Kernel, "execute", "server_execute")
    wrap(pool.Pool, "take_child", "server_take_child")


if OUT:
    try:
        install()
    except Exception as exc:
        log({"install_error": repr(exc)})
"""

PHASES = [("client round trip", "client"), ("server: Kernel.execute", "server_execute"),
          ("server: wait for a child (take_child)", "server_take_child"),
          ("child: whole request", "child_total"), ("child: prepare (read analysis)",
                                                     "child_prepare"),
          ("child: run_cell", "child_run_cell"), ("child: save", "child_save"),
          ("child: save_groups (pickle, hash)", "child_save_groups"),
          ("child: Store.missing", "child_store_missing"),
          ("child: put_state (LMDB commit)", "child_put_state"),
          ("spare: warm (after its fork)", "spare_warm")]


def profile(gaps, cprofile):
    """Phase timings of our server on a (0 B, 100 MB) and b3, per pause between cells."""
    tmp = tempfile.mkdtemp(prefix="snapshot-bench-profile-")
    site = os.path.join(tmp, "site")
    os.makedirs(site)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(PROFILE_HOOKS)
    records = os.path.join(tmp, "records")
    os.makedirs(records)
    os.environ["SNAPBENCH_PROFILE_DIR"] = records
    if cprofile:
        os.environ["SNAPBENCH_CPROFILE"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [site, ROOT] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])
    peer = Peer("ours", tmp, None)
    peer.start()
    results = {}
    try:
        peer.must(frame_cell(0), new="p0")
        peer.must(frame_cell(100 * MB), new="p100")
        peer.must(UPDATE_SETUP, new="p-b3")
        for gap in gaps:
            for name, base, cells, chain in (
                    ("a: x += 1, 0 B", "p0", ["x += 1"] * 30, False),
                    ("a: x += 1, 100 MB", "p100", ["x += 1"] * 20, False),
                    ("b3: read-only cells, 1M rows", "p-b3", (READS * 2)[:20], True)):
                for f in os.listdir(records):
                    os.unlink(os.path.join(records, f))
                clients, state = [], base
                for code in cells:
                    time.sleep(gap)
                    elapsed, answer = peer.must(code, state)
                    clients.append(elapsed * 1e3)
                    if chain:
                        state = answer["state_name"]
                    else:
                        peer.delete(answer["state_name"])
                time.sleep(0.3)
                merged = {"client": clients}
                path = os.path.join(records, "records.jsonl")
                for line in open(path) if os.path.exists(path) else ():
                    for key, ms in json.loads(line).items():
                        merged.setdefault(key, []).append(ms)
                if cprofile:
                    dest = os.path.join(tmp, f"cprofile-{len(results)}")
                    os.makedirs(dest)
                    for f in os.listdir(records):
                        if f.endswith(".prof"):
                            shutil.move(os.path.join(records, f), dest)
                    print(f"cProfile of '{name}' (gap {gap} s): {dest}/*.prof")
                results[(name, gap)] = merged
    finally:
        peer.stop()
    head = ["phase (median ms)"] + [f"{n}, {g} s pause" for n, g in results]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key in PHASES:
        cells = [label]
        for merged in results.values():
            values = merged.get(key)
            cells.append(f"{median(values):.2f} (n={len(values)})" if values else "-")
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if not cprofile:
        shutil.rmtree(tmp, ignore_errors=True)
    return "\n".join(lines)


# BENCHMARKS.md -------------------------------------------------------------------

def split_sections(text):
    """[(heading or None for the preamble, body)] split at `## ` headings."""
    sections, heading, lines = [], None, []
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            sections.append((heading, "".join(lines)))
            heading, lines = line[3:].strip(), []
        else:
            lines.append(line)
    sections.append((heading, "".join(lines)))
    return sections


def merge(text, updates):
    """`text` with the sections in `updates` {heading: body} replaced or appended.

    Sections this script does not own (any other `## ` heading) are kept
    as they are, in place.
    """
    sections = split_sections(text) if text.strip() else [(None, "")]
    pre = "# Benchmarks\n\nWritten by `scripts/bench.py`; other sections are kept as written.\n\n"
    out, done = [], set()
    for heading, body in sections:
        if heading is None:
            out.append(pre if not body.strip() else body)
        elif heading in updates:
            out.append(f"## {heading}\n\n{updates[heading].strip(chr(10))}\n\n")
            done.add(heading)
        else:
            out.append(f"## {heading}\n{body}")
    for heading in OWNED:
        if heading in updates and heading not in done:
            out.append(f"## {heading}\n\n{updates[heading].strip(chr(10))}\n\n")
    return "".join(out).rstrip() + "\n"


HOW_TO_RUN = """\
```
python scripts/bench.py --quick    # under 3 minutes: states up to 100 MB, 5 runs
python scripts/bench.py            # under 30 minutes: states up to 1 GB, 7 runs
python scripts/bench.py --only a,b3 --no-write    # some workloads, print only
python scripts/bench.py --profile  # this server only: median ms of each phase of a cell
python scripts/bench.py --only nb  # notebook runs against nbclient + ipykernel
```

The script installs snapshot-kernel 0.2.1 with numpy and pandas into a
virtual environment of its own (`--venv`, default
`~/.cache/snapshot-bench/ref`) and runs three servers side by side, through
the same HTTP calls: this server (`main.py` on a temporary store), the
reference (in memory only), and `scripts/dill_baseline.py`, which runs
cells in one namespace and dumps all of it with dill after every cell.
Latencies are client round trips, medians, with peers interleaved run by
run. Before every cell the bench calls `os.sync()`, so the dirty pages of
earlier cells (the dill peer writes its whole namespace each time) are
not flushed by the kernel during the next cell, which would charge one
peer's writes to another's disk flush. Store growth of this server is exact: bytes of new blobs plus growth
of the manifests, read from the LMDB file between cells; for dill it is
the size of the checkpoint written after the cell. "ours vs X" is how
many times better this server is (> 1× = better). A cell's own time in b3
is the plain `exec` time the dill baseline measured for it (display
included). `--profile` installs a `sitecustomize` into this server's
processes that times the phases of each cell (server, child, store; with
`--cprofile` also a cProfile of each cell's child), without changing the
code under test. The notebook workload (nb) starts this server alone and
compares POST /notebooks/run on a 30-cell data notebook with nbclient
running the same notebook in ipykernel; run alone (`--only nb`) it writes
the section "Results: notebook"."""


def write_markdown(path, p, table, details, seconds, mach):
    """Rewrite this mode's section of BENCHMARKS.md, keeping every other section."""
    body = [f"Machine: {mach}.", "",
            f"Run time {seconds / 60:.1f} min; {p['runs']} runs per latency unless stated.",
            "", table.markdown()]
    for title, text in details:
        body += ["", f"**{title}**", "", text]
    text = open(path).read() if os.path.exists(path) else ""
    updated = merge(text, {"How to run": HOW_TO_RUN,
                           f"Results: {p['mode']}": "\n".join(body)})
    with open(path, "w") as f:
        f.write(updated)


def main(argv=None):
    """Parse the command line, run, print and write the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller states, fewer runs (< 3 min)")
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/snapshot-bench/ref"),
                    help="virtual environment of the reference (made if missing)")
    ap.add_argument("--only", help=f"comma-separated workloads among {','.join(WORKLOADS)}")
    ap.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    ap.add_argument("--keep", action="store_true", help="keep the stores and server logs")
    ap.add_argument("--profile", action="store_true",
                    help="instead: phase timings of this server on a (0 B, 100 MB) and b3")
    ap.add_argument("--gaps", default="0,0.2",
                    help="with --profile: pauses before each cell, in seconds")
    ap.add_argument("--cprofile", action="store_true",
                    help="with --profile: also keep a cProfile of every cell's child")
    ap.add_argument("--ours-config", help="a TOML file passed to this server as --config "
                    "(e.g. to compare store.durability settings)")
    args = ap.parse_args(argv)
    if args.ours_config:
        OURS_ARGS[:] = ["--config", os.path.abspath(args.ours_config)]
        args.no_write = True  # results of a non-default configuration are not the table
    if args.profile:
        profile([float(g) for g in args.gaps.split(",")], args.cprofile)
        return
    p = plan(args.quick)
    only = set(args.only.split(",")) if args.only else None
    mach = machine()
    print(f"{p['mode']} run on {mach}", flush=True)
    table, details, seconds = run(p, only, args.venv, args.keep)
    print()
    print(table.markdown())
    for title, text in details:
        print(f"\n{title}\n{text}")
    print(f"\n{p['mode']} run took {seconds / 60:.1f} min")
    if not args.no_write and only in (None, {"nb"}):
        mode = "notebook" if only == {"nb"} else p["mode"]
        write_markdown(args.out, dict(p, mode=mode), table, details, seconds, mach)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
