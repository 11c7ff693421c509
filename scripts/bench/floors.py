"""(fl) The floors: what this machine allows under a trivial cell and a large save.

A trivial cell's round trip crosses, at the least, one HTTP exchange with a
Python server of the design's stack (bottle on cheroot), one message to a
worker process and back, and one synced LMDB commit. Each is measured
here alone, with nothing of this server in it: a route that parses the
request's JSON and answers a fixed one; a byte to a forked process and
back over a Unix socket; a one-key write transaction committed with
LMDB's default syncs, in the directory the bench's stores are in. Like
workload a, back to back and with a person's pause before each, since a
pause lets the machine go cold. Their sum is the least a trivial cell
can take here, whatever this server does; the raw HTTP row (a thread per
connection, no framework) shows what the stack itself costs. Back to
back, a cell also waits for the fork of the state's holder before it
(the design forks it after the answer, and no cell may run before it):
the fork of a process that imported what a holder has is the last row of
each kind.

A large first save must at the least write its bytes to disk durably:
the last row writes 1 GB (--quick: 256 MB) of incompressible bytes into
that directory and syncs them, as `dd conv=fdatasync` would.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from bench import PAUSE_S
from bench.report import fmt_ms, median
from harness import Client

_CALLS = 20  # round trips per floor, pause and round (the first 5 not counted: warm-up)
_ROUNDS = 2  # the floors take turns, so that a disturbance of the machine is not one's alone

# An HTTP/1.1 keep-alive server with a thread per connection and no framework.
_RAW_SERVER = r"""
import socket, sys, threading
REPLY = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{"state": "s1"}'
def serve(conn):
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
        head, buf = buf.split(b"\r\n\r\n", 1)
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(buf) < length:
            buf += conn.recv(65536)
        buf = buf[length:]
        conn.sendall(REPLY)
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
while True:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""

# bottle on cheroot, as this server runs them, with one route that reads the JSON body.
_BOTTLE_SERVER = r"""
import bottle
from cheroot import wsgi
app = bottle.Bottle()
@app.post("/execute")
def execute():
    return {"state_name": bottle.request.json["new_state_name"]}
server = wsgi.Server(("127.0.0.1", 0), app, numthreads=4)
server.prepare()
print(server.bind_addr[1], flush=True)
server.serve()
"""

# Small synced commits, as a trivial cell's save ends.
_COMMITS = r"""
import json, sys, time, lmdb
env = lmdb.open(sys.argv[1], map_size=2 ** 30, max_dbs=2, sync=True, metasync=True)
db = env.open_db(b"states")
times = []
for i in range(int(sys.argv[2])):
    time.sleep(float(sys.argv[3]))
    value = json.dumps({"name": f"s{i}", "parent": f"s{i - 1}", "x": i}).encode() * 4
    start = time.perf_counter()
    with env.begin(write=True, db=db) as txn:
        txn.put(f"s{i}".encode(), value)
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


# One page written in place and flushed: what each of a synced commit's two flushes (its
# pages, then its meta page) costs at the least.
_FLUSHES = r"""
import json, os, sys, time
fd = os.open(os.path.join(sys.argv[1], "pages"), os.O_RDWR | os.O_CREAT)
os.write(fd, bytes(2 ** 20))
os.fsync(fd)
times = []
for i in range(int(sys.argv[2])):
    time.sleep(float(sys.argv[3]))
    start = time.perf_counter()
    os.pwrite(fd, os.urandom(4096), 4096 * (i % 256))
    os.fdatasync(fd)
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


# fork() of a process that imported what every holder has (the warm zygote's imports).
_FORKS = r"""
import json, os, sys, time
import numpy, pandas, matplotlib.pyplot, IPython
times = []
for i in range(int(sys.argv[1])):
    time.sleep(float(sys.argv[2]))
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    times.append(time.perf_counter() - start)
    os.waitpid(pid, 0)
print(json.dumps(times))
"""


def _server(script):
    """A server subprocess running `script`, and the port it printed."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def _http_round_trips(port, pause):
    """Seconds of each POST round trip to 127.0.0.1:port on one kept-alive connection of
    the client the workloads use (api/client.py)."""
    client = Client(f"http://127.0.0.1:{port}")
    times = []
    for i in range(_CALLS):
        time.sleep(pause)
        body = {"code": "x += 1", "state_name": f"s{i}", "new_state_name": f"s{i + 1}"}
        start = time.perf_counter()
        reply = client.send("POST", "/execute", body)
        reply.read()
        times.append(time.perf_counter() - start)
        if reply.status != 200:
            raise RuntimeError(f"the floor's HTTP server answered {reply.status}")
    client.close()
    return times[5:]


def _http_floor(script, pause):
    """Seconds of the round trips to a server running `script`."""
    proc, port = _server(script)
    try:
        return _http_round_trips(port, pause)
    finally:
        proc.kill()
        proc.wait()


def _hop_floor(pause):
    """Seconds of round trips of one byte to a forked process and back (a Unix socket)."""
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        here.close()
        while there.recv(1):
            there.sendall(b"a")
        os._exit(0)
    there.close()
    times = []
    try:
        for _ in range(_CALLS):
            time.sleep(pause)
            start = time.perf_counter()
            here.sendall(b"r")
            here.recv(1)
            times.append(time.perf_counter() - start)
    finally:
        here.close()
        os.waitpid(pid, 0)
    return times[5:]


def _commit_floor(folder, pause):
    """Seconds of synced LMDB commits of one small record, in a process of its own."""
    path = tempfile.mkdtemp(dir=folder, prefix="floor-lmdb-")
    done = subprocess.run([sys.executable, "-c", _COMMITS, path, str(_CALLS), str(pause)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)[5:]


def _flush_floor(folder, pause):
    """Seconds of a 4 KiB write in place and its fdatasync, in a process of its own."""
    path = tempfile.mkdtemp(dir=folder, prefix="floor-flush-")
    done = subprocess.run([sys.executable, "-c", _FLUSHES, path, str(_CALLS), str(pause)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)[5:]


def _fork_floor(pause):
    """Seconds of fork() calls of a process holding a holder's imports."""
    done = subprocess.run([sys.executable, "-c", _FORKS, str(_CALLS), str(pause)],
                          capture_output=True, text=True, check=True,
                          env=dict(os.environ, MPLBACKEND="Agg"))
    return json.loads(done.stdout)[5:]


def durable_write_seconds(folder, size):
    """Seconds to write `size` incompressible bytes to a new file in `folder` and sync it."""
    block = os.urandom(1 << 20)
    path = os.path.join(folder, "floor-write")
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(size >> 20):
            os.write(fd, block)
        os.fdatasync(fd)
    finally:
        os.close(fd)
        os.unlink(path)
    return time.perf_counter() - start


# A worker's process context captured after a cell (kernel/worker/context.py), in a
# process with what a warm worker imports: nothing changed, then one item changed.
_CONTEXT_CAPTURE = r"""
import json, random, sys, time
import numpy, pandas, matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot
from snapkernel.kernel import config
from snapkernel.kernel.worker import context
from snapkernel.kernel.worker.capture import shell
shell.get_shell()
settings = config.load()
context.remember_base()
state, _ = context.capture({}, settings)

def per_call(change, n=300):
    # CPU time: on a shared machine the wall clock also counts the waits for a core.
    best = []
    for _ in range(7):
        start = time.process_time()
        for _ in range(n):
            change()
            context.capture(state, settings)
        best.append((time.process_time() - start) / n)
    return sorted(best)[len(best) // 2]

print(json.dumps({"unchanged": per_call(lambda: None),
                  "random": per_call(random.random),
                  "rcParams": per_call(lambda: matplotlib.rcParams.__setitem__(
                      "lines.linewidth", random.random()))}))
"""


def _context_capture():
    """Seconds a context capture takes: {unchanged, random, rcParams} (medians)."""
    done = subprocess.run([sys.executable, "-c", _CONTEXT_CAPTURE], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


def wl_floors(peers, p, table, details, keep):
    """(fl) The floors under a trivial cell's round trip and under a large first save, and
    what capturing a state's process context costs a cell."""
    folder = peers["ours"].dir  # beside its store
    for pause in (0.0, PAUSE_S):
        when = "back to back" if pause == 0 else f"{PAUSE_S} s pause before each"
        measures = {"raw HTTP": lambda: _http_floor(_RAW_SERVER, pause),
                    "bottle on cheroot": lambda: _http_floor(_BOTTLE_SERVER, pause),
                    "process hop": lambda: _hop_floor(pause),
                    "synced commit": lambda: _commit_floor(folder, pause),
                    "fork": lambda: _fork_floor(pause),
                    "flush": lambda: _flush_floor(folder, pause)}
        samples = {name: [] for name in measures}
        for _ in range(_ROUNDS):
            for name, measure in measures.items():
                samples[name] += measure()
        floors = {name: median(times) for name, times in samples.items()}
        table.add("fl", f"HTTP round trip, a thread per connection, no framework ({when})",
                  {"ours": floors.pop("raw HTTP")})
        fork = floors.pop("fork")
        flush = floors.pop("flush")
        table.add("fl", f"HTTP round trip, bottle on cheroot, JSON in and out ({when})",
                  {"ours": floors["bottle on cheroot"]})
        table.add("fl", f"a byte to a forked process and back ({when})",
                  {"ours": floors["process hop"]})
        table.add("fl", f"synced LMDB commit of one small record ({when})",
                  {"ours": floors["synced commit"]})
        table.add("fl", f"a 4 KiB write in place and fdatasync ({when}); a synced commit "
                  f"flushes twice (its pages, then its meta page)", {"ours": flush})
        table.add("fl", f"sum of the three above: the least a trivial cell can take here "
                  f"({when}; a's target: ≤ 3 ms)", {"ours": sum(floors.values())})
        table.add("fl", f"fork() of a process with a holder's imports ({when}); a cell run "
                  "back to back waits for one", {"ours": fork})
    capture = _context_capture()
    table.add("fl", "process context captured after a cell, nothing in it changed (CPU "
              "time; issue 25's target: < 0.2 ms)", {"ours": capture["unchanged"]})
    table.add("fl", "process context captured after a cell that drew a random number / "
              "changed an rcParam (CPU time; < 1 ms)",
              {"ours": max(capture["random"], capture["rcParams"])})
    size = 2 ** 30 if p["mode"] == "full" else 2 ** 28
    seconds = durable_write_seconds(folder, size)
    label = "1 GiB" if size == 2 ** 30 else "256 MiB"
    per_gib = fmt_ms(seconds * 2 ** 30 / size)
    table.add("fl", f"write {label} to disk and fdatasync ({per_gib} a GiB; the 1 GB "
              f"first save's target: ≤ 2 s)", {"ours": seconds})
