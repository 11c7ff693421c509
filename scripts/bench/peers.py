"""The servers under test, each behind the same calls: execute, delete, reset, interrupt.

- ours: `python main.py` from this repository, on a temporary store;
- ref: snapshot-kernel 0.2.1 from PyPI, in a virtual environment of its own
  (in memory only);
- ipykernel: a Jupyter kernel of this interpreter, driven through
  jupyter_client as a notebook front end does (one namespace, in memory);
- dill: scripts/dill_baseline.py, one namespace dumped whole with dill after
  every cell, as session-pickling tools do.

What a peer can do is said by its attributes (`states`, `persists`,
`interrupts`); a workload reads them rather than the peer's name.
"""

import contextlib
import itertools
import json
import os
import subprocess
import sys
import threading
import time

import ipykernel
import jupyter_client
import lmdb
import psutil

from harness import ROOT, TOKEN, Client, ServerProcess, Server, free_port

REF_VERSION = "0.2.1"
_ids = itertools.count()


class Timed:
    """Timed JSON calls to one server, through the server's own client (api/client.py;
    one keep-alive connection per thread)."""

    def __init__(self, port):
        """Talk to 127.0.0.1:`port` (the token in the query: the reference reads it there)."""
        self.client = Client(f"http://127.0.0.1:{port}", TOKEN, timeout=3600,
                             token_in_query=True)
        self.local = threading.local()

    def call(self, method, path, body=None):
        """One request; returns (seconds, status, decoded JSON answer), whatever the status.

        This thread's last request was sent and its answer read at the
        CLOCK_MONOTONIC times `self.times()` (the clock of kernel/trace.py).
        """
        response = self.client.send(method, path, body, timeout=0)
        data = response.read()
        done = time.monotonic()
        sent = self.client.times()[0]
        self.local.times = (sent, done)
        try:
            answer = json.loads(data) if data else None
        except ValueError:
            answer = {"error": {"type": "NotJSON", "message": data[:200].decode(
                errors="replace")}}
        return done - sent, response.status, answer

    def times(self):
        """(sent, answered): CLOCK_MONOTONIC times of this thread's last request."""
        return self.local.times

    def reset(self):
        """Drop this thread's connection (after a server restart)."""
        self.client.close()


class Peer:
    """One server under test, with its files under `workdir/<kind>`."""

    kind = title = None
    states = True       # named states a cell runs from (else one namespace)
    persists = False    # what it holds survives a restart
    interrupts = True   # a running cell can be interrupted

    def __init__(self, workdir):
        """Prepare (not start) the peer."""
        self.dir = os.path.join(workdir, self.kind)
        os.makedirs(self.dir, exist_ok=True)

    def must(self, code, state="initial", new=None, flush=True):
        """Execute and fail loudly if the cell raised; returns (seconds, answer).
        `flush` False: no os.sync() first (see execute)."""
        elapsed, answer = self.execute(code, state, new, flush=flush)
        if answer.get("error"):
            raise RuntimeError(f"{self.kind}: {code[:60]!r} failed: {answer['error']}")
        return elapsed, answer

    def memory(self):
        """(server RSS, sum of PSS of its descendants, number of descendants)."""
        proc = psutil.Process(self.pid)
        children = proc.children(recursive=True)
        pss = 0
        for child in children:
            with contextlib.suppress(psutil.Error):
                pss += child.memory_full_info().pss
        return proc.memory_info().rss, pss, len(children)


class HttpPeer(Peer):
    """A peer that is an HTTP server speaking the snapshot kernel's JSON."""

    def __init__(self, workdir):
        """Prepare (not start) the peer."""
        super().__init__(workdir)
        self.process = None
        self.client = None

    def launch(self, timeout):
        """Start the server process and wait until it answers HTTP (a ServerProcess)."""
        raise NotImplementedError

    def start(self, first_cell=None, state="initial", timeout=120):
        """Start the server; return (seconds to its first HTTP answer, to the first cell's)."""
        self.process = self.launch(timeout)
        self.client = Timed(self.process.port)
        if first_cell is None:
            return self.process.up_s, None
        answer = self.execute(first_cell, state)[1]
        first = time.perf_counter() - self.process.started
        if answer.get("error"):
            raise RuntimeError(f"{self.kind}: first cell failed: {answer['error']}")
        return self.process.up_s, first

    def stop(self):
        """SIGTERM the server (and so its workers) and wait for it."""
        if self.process is not None:
            self.process.stop()
        self.process = None

    @property
    def pid(self):
        """The server's process id."""
        return self.process.proc.pid

    def call(self, method, path, body=None):
        """One request; (seconds, status, answer)."""
        return self.client.call(method, path, body)

    def execute(self, code, state="initial", new=None, exec_id=None, flush=True):
        """POST /execute; returns (seconds, answer). `flush` False: no os.sync() first
        (a cell sent as soon as the answer before it came: the sync would be a pause)."""
        body = {"code": code, "exec_id": exec_id or f"b{next(_ids)}", "state_name": state,
                "new_state_name": new or f"n{next(_ids)}"}
        # Earlier cells' writes (the dill peer's checkpoints above all) are flushed now,
        # not by the kernel while this cell waits on its own flush.
        if flush:
            os.sync()
        elapsed, status, answer = self.client.call("POST", "/execute", body)
        if status != 200:
            answer = {"error": answer.get("error") if answer else {"ename": str(status)}}
        return elapsed, answer

    def delete(self, name):
        """Delete a state (frees the reference's memory; retires ours)."""
        self.client.call("DELETE", f"/states/{name}")

    def reset(self):
        """Forget every state (or the namespace)."""
        self.client.call("POST", "/reset", {})

    def interrupt(self, exec_id):
        """Interrupt the execution `exec_id`."""
        self.client.call("POST", "/interrupt", {"exec_id": exec_id})

    def log_path(self):
        """The server's log file."""
        return os.path.join(self.dir, "server.log")


class Ours(HttpPeer):
    """This repository's server on a store of its own."""

    kind, title, persists = "ours", "this server", True

    def __init__(self, workdir, config=None, extra_args=()):
        """`config`: the text of a --config file; `extra_args`: more command-line flags."""
        super().__init__(workdir)
        self.config = config
        self.extra_args = list(extra_args)

    @property
    def data_dir(self):
        """The LMDB store."""
        return os.path.join(self.dir, "store")

    def launch(self, timeout):
        """`python main.py` on a free port."""
        return Server(self.data_dir, config=self.config, extra_args=self.extra_args,
                      log_path=self.log_path(), poll_s=0.005, timeout=timeout)

    def store_usage(self):
        """What the store holds now: ({blob key: stored bytes}, bytes of the manifests).

        Read from a read-only LMDB handle without the lock file, between
        cells, when the server is not writing.
        """
        env = lmdb.open(self.data_dir, readonly=True, lock=False, max_dbs=4)
        try:
            blobs = env.open_db(b"blobs", create=False)
            states = env.open_db(b"states", create=False)
            with env.begin(buffers=True) as txn:
                sizes = {bytes(k): len(v) for k, v in txn.cursor(db=blobs)}
                manifests = sum(len(v) for _, v in txn.cursor(db=states))
        finally:
            env.close()
        return sizes, manifests


class Reference(HttpPeer):
    """snapshot-kernel 0.2.1, in the virtual environment `venv` (made if missing)."""

    kind, title = "ref", f"snapshot-kernel {REF_VERSION}"

    def __init__(self, workdir, venv):
        """Install the reference into `venv` unless it is there."""
        super().__init__(workdir)
        self.python = ensure_reference(venv)

    def launch(self, timeout):
        """`python -m snapshot_kernel.main` on a free port."""
        port = free_port()
        # Its own cwd, so that it cannot import this repository's modules.
        return ServerProcess([self.python, "-m", "snapshot_kernel.main", "--bind",
                              f"127.0.0.1:{port}", "--token", TOKEN], port, self.log_path(),
                             cwd=self.dir, poll_s=0.005, timeout=timeout)


class Dill(HttpPeer):
    """scripts/dill_baseline.py: one namespace, checkpointed whole after every cell."""

    kind, title = "dill", "dill checkpoint/cell"
    states, persists, interrupts = False, True, False

    @property
    def checkpoint(self):
        """The checkpoint file."""
        return os.path.join(self.dir, "namespace.dill")

    def launch(self, timeout):
        """The baseline server on a free port."""
        port = free_port()
        return ServerProcess([sys.executable, os.path.join(ROOT, "scripts", "dill_baseline.py"),
                              "--bind", f"127.0.0.1:{port}", "--token", TOKEN,
                              "--checkpoint", self.checkpoint], port, self.log_path(),
                             cwd=self.dir, poll_s=0.005, timeout=timeout)


class Ipykernel(Peer):
    """A Jupyter kernel (ipykernel) of this interpreter, through jupyter_client.

    A cell's round trip is a front end's: from sending the execute_request
    to having both its execute_reply and the kernel's return to idle (after
    every output of the cell) on the iopub channel.
    """

    kind, states = "ipykernel", False
    title = f"ipykernel {ipykernel.__version__}"

    def __init__(self, workdir):
        """Prepare (not start) the kernel."""
        super().__init__(workdir)
        self.manager = self.client = self.log = None
        self.count = 0

    def start(self, first_cell=None, state="initial", timeout=120):
        """Start the kernel; return (seconds until it answers kernel_info, to the first cell)."""
        started = time.perf_counter()
        self.log = open(os.path.join(self.dir, "kernel.log"), "ab")
        self.manager = jupyter_client.KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=self.dir, stdout=self.log, stderr=self.log)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=timeout)
        up = time.perf_counter() - started
        if first_cell is None:
            return up, None
        self.must(first_cell, state)
        return up, time.perf_counter() - started

    def stop(self):
        """Stop the kernel."""
        if self.manager is not None:
            self.client.stop_channels()
            self.manager.shutdown_kernel(now=True)
            self.log.close()
        self.manager = self.client = None

    @property
    def pid(self):
        """The kernel's process id."""
        return self.manager.provisioner.pid

    def execute(self, code, state="initial", new=None, exec_id=None, flush=True):
        """Run `code` in the kernel; (seconds, answer shaped as ours: output, error, state_name)."""
        if flush:
            os.sync()  # as for the HTTP peers
        started = time.perf_counter()
        msg_id = self.client.execute(code, store_history=True, allow_stdin=False)
        outputs = []
        while True:
            msg = self.client.get_iopub_msg(timeout=3600)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                break
            if kind == "stream":
                outputs.append({"output_type": "stream", "name": content["name"],
                                "text": content["text"]})
            elif kind in ("execute_result", "display_data"):
                outputs.append({"output_type": kind, "data": content["data"],
                                "metadata": content["metadata"]})
        while True:
            reply = self.client.get_shell_msg(timeout=3600)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        elapsed = time.perf_counter() - started
        content = reply["content"]
        self.count += 1
        error = None
        if content["status"] != "ok":
            error = {k: content.get(k) for k in ("ename", "evalue", "traceback")}
        return elapsed, {"output": outputs, "error": error,
                         "state_name": None if error else new or f"s{self.count}"}

    def delete(self, name):
        """Nothing is kept per state."""

    def reset(self):
        """Empty the namespace."""
        self.must("%reset -f")

    def interrupt(self, exec_id):
        """SIGINT the kernel, as a front end's interrupt button does."""
        self.manager.interrupt_kernel()


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


def added_bytes(before, after):
    """Bytes a cell added to our store: new blobs plus manifest growth."""
    blobs_before, manifests_before = before
    blobs_after, manifests_after = after
    new = sum(size for key, size in blobs_after.items() if key not in blobs_before)
    return new + manifests_after - manifests_before
