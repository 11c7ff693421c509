"""Load: concurrent clients executing from shared and private states, with interrupts and deletes.

Run from a checkout with the package installed (`pip install -e .`):

    python scripts/load.py [--clients 8] [--per-client 100] [--seed 1]
                           [--write-benchmarks BENCHMARKS.md]

It starts a server on a fresh store with the default config.toml, makes a
`shared` state, and runs `--clients` threads of `--per-client` operations
each: 40 % cells from the shared state (auto-named new states), 40 % cells
continuing the client's own chain (new names, or rebinding one of five
names per client as Plainbook does), 10 % interrupts of a sleeping cell,
10 % deletes of one of the client's earlier states. Then it checks:

- no HTTP error and no unexpected cell error (an interrupted cell must
  answer KeyboardInterrupt; everything else must succeed);
- no lost state: every state a client still expects is listed and holds
  exactly its value; every deleted one answers 404;
- no leaked process: at most the two zygotes (cold and warm) plus a
  holder and its spares per live state remain below the server, and none after it stops.

It prints a JSON summary (latencies of successful executions in ms) and,
with --write-benchmarks, replaces the `## Load` section of that file.
Exit status 0 when every check passed.
"""

import argparse
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time

from harness import Server, ServerError, alive, machine, revision
from snapkernel.kernel import config


def settled(condition, timeout=60):
    """Whether condition() comes true within `timeout` seconds (polled): a generous
    deadline for what happens within moments, so a loaded machine is not a problem."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def percentile(values, q):
    """The q-th percentile (nearest rank) of `values`."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class Client:
    """One client: its operations, the states it expects, what went wrong."""

    def __init__(self, server, k, n, rng):
        """Client number `k` doing `n` operations."""
        self.server, self.k, self.n, self.rng = server, k, n, rng
        self.expected = {}   # state name -> text/plain of `val` there
        self.deleted = set()
        self.head = "shared"
        self.latencies = {"shared": [], "private": []}
        self.counts = {"shared": 0, "private": 0, "interrupt": 0, "delete": 0}
        self.problems = []

    def execute(self, kind, code, state, new=None, exec_id=None):
        """POST /execute, timing it; the answer or None (with a problem noted)."""
        body = {"code": code, "exec_id": exec_id or f"c{self.k}-{time.monotonic_ns()}",
                "state_name": state}
        if new is not None:
            body["new_state_name"] = new
        start = time.perf_counter()
        try:
            answer = self.server.call("POST", "/execute", body, timeout=120)
        except Exception as exc:  # any HTTP error is a failure of the run
            self.problems.append(f"{kind}: {type(exc).__name__}: {exc}")
            return None
        if kind in self.latencies:
            self.latencies[kind].append((time.perf_counter() - start) * 1000)
        return answer

    def run(self):
        """Do the operations."""
        for i in range(self.n):
            roll = self.rng.random()
            if roll < 0.4:
                self.shared(i)
            elif roll < 0.8:
                self.private(i)
            elif roll < 0.9:
                self.interrupt(i)
            else:
                self.delete()

    def shared(self, i):
        """A cell from the shared state into an auto-named state."""
        self.counts["shared"] += 1
        j = self.rng.randrange(1, 100_000)
        answer = self.execute("shared", f"val = int(base[:{j}].sum())\nval", "shared")
        if answer is None:
            return
        if answer["error"] is not None or not answer["state_name"]:
            self.problems.append(f"shared cell failed: {answer['error']}")
            return
        self.expected[answer["state_name"]] = str(j * (j - 1) // 2)

    def private(self, i):
        """The next cell of this client's own chain (new name, or a rebound one)."""
        self.counts["private"] += 1
        name = (f"c{self.k}-s{i}" if self.rng.random() < 0.5
                else f"c{self.k}-cell{self.rng.randrange(5)}")
        first = "val = 0\n" if self.head == "shared" else ""
        answer = self.execute("private", f"{first}val = val + {i}\nchain = [val] * 100",
                              self.head, new=name)
        if answer is None:
            return
        if answer["error"] is not None or answer["state_name"] != name:
            self.problems.append(f"private cell failed: {answer['error']}")
            return
        before = 0 if self.head == "shared" else int(self.expected[self.head])
        self.expected[name] = str(before + i)
        self.deleted.discard(name)
        self.head = name

    def interrupt(self, i):
        """A sleeping cell, interrupted once it runs: it must answer KeyboardInterrupt."""
        self.counts["interrupt"] += 1
        exec_id = f"c{self.k}-sleep{i}"
        box = []
        # An hour's sleep: only the interrupt ends it (a cell that ended on its own would
        # hide an interrupt that never came).
        thread = threading.Thread(target=lambda: box.append(self.execute(
            "interrupt", "import time\ntime.sleep(3600)", "shared", exec_id=exec_id)))
        thread.start()
        deadline = time.monotonic() + 60
        time.sleep(self.rng.uniform(0.02, 0.2))  # interrupts land at random moments
        while True:
            try:
                if self.server.call("POST", "/interrupt", {"exec_id": exec_id})["interrupted"]:
                    break
            except Exception as exc:
                self.problems.append(f"interrupt: {type(exc).__name__}: {exc}")
                break
            if time.monotonic() > deadline:
                self.problems.append(f"interrupt: {exec_id} never found running")
                break
            time.sleep(0.02)
        thread.join(120)
        if thread.is_alive():
            self.problems.append(f"interrupted cell {exec_id}: no answer")
        elif box[0] is not None and (box[0]["error"] or {}).get("ename") != "KeyboardInterrupt":
            # (None: self.execute noted the problem)
            self.problems.append(f"interrupted cell answered {box[0]['error']}")

    def delete(self):
        """Delete one of this client's states (not its chain's head)."""
        self.counts["delete"] += 1
        candidates = sorted(n for n in self.expected if n != self.head)
        if not candidates:
            return
        name = self.rng.choice(candidates)
        try:
            answer = self.server.call("DELETE", f"/states/{name}")
        except Exception as exc:
            self.problems.append(f"delete {name}: {type(exc).__name__}: {exc}")
            return
        if answer != {"deleted": name}:
            self.problems.append(f"delete {name} answered {answer}")
        del self.expected[name]
        self.deleted.add(name)


def verify(server, clients):
    """Problems with the states after the run: lost, wrong or undeleted."""
    problems = []
    listed = set(server.call("GET", "/states")["states"])
    for client in clients:
        for name, value in client.expected.items():
            if name not in listed:
                problems.append(f"{name}: lost")
                continue
            try:
                answer = server.call("POST", "/multistate_execute", {
                    "code": "val", "exec_id": f"verify-{name}", "state_mapping": {},
                    "default_state": name})
            except ServerError as exc:
                problems.append(f"{name}: no answer: {type(exc).__name__}: {exc}")
                continue
            got = answer["output"][-1]["data"]["text/plain"] if answer["output"] else None
            if answer["error"] is not None or got != value:
                problems.append(f"{name}: holds {got} ({answer['error']}), expected {value}")
        for name in client.deleted:
            if name in listed:
                problems.append(f"{name}: deleted but still listed")
    return problems


def write_section(path, text):
    """Replace (or append) the `## Load` section of a Markdown file, leaving the rest."""
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    section = re.compile(r"^## Load\n.*?(?=^## |\Z)", re.S | re.M)
    if section.search(old):
        new = section.sub(lambda _: text, old, count=1)
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w") as f:
        f.write(new)


def main(argv=None):
    """Run the load; exit status 0 if every check passed."""
    p = argparse.ArgumentParser(description="Concurrent clients against one server")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--per-client", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--alone", type=int, default=30,
                   help="operations of one client alone before the concurrent run")
    p.add_argument("--write-benchmarks", metavar="FILE",
                   help="replace the '## Load' section of FILE with the figures")
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    work = tempfile.mkdtemp(prefix="snapk-load-")
    server = Server(os.path.join(work, "store"), log_path=os.path.join(work, "server.log"))
    rng = random.Random(args.seed)
    problems, alone = [], None
    try:
        server.call("POST", "/execute", {"code": "import numpy as np\nbase = np.arange(100_000)",
                                         "exec_id": "setup", "state_name": "initial",
                                         "new_state_name": "shared"})
        # One client alone first: the latency without contention, for comparison.
        alone = Client(server, "alone", args.alone, random.Random(rng.random()))
        alone.run()
        clients = [Client(server, k, args.per_client, random.Random(rng.random()))
                   for k in range(args.clients)]
        threads = [threading.Thread(target=c.run) for c in clients]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - start
        for c in clients:
            problems += [f"client {c.k}: {p}" for p in c.problems]
        problems += [f"client alone: {p}" for p in alone.problems]
        problems += verify(server, clients + [alone])
        settings = config.load()
        live = settings["workers.max_live_states"]
        spares = int(settings["workers.spare_children"])
        bound = 2 + live * (1 + spares)  # the cold and the warm zygote, holders, spares
        # Spares replacing the ones just used, and stopped workers, settle within moments.
        if not settled(lambda: len(server.workers()) <= bound):
            problems.append(f"{len(server.workers())} worker processes for at most {live} "
                            f"live states with {spares} spare(s) each")
    finally:
        workers = server.workers()
        server.stop()
    if not settled(lambda: not [w for w in workers if alive(w)]):
        problems.append(f"processes left after SIGTERM: {[w for w in workers if alive(w)]}")
    lat = {k: [x for c in clients for x in c.latencies[k]] for k in ("shared", "private")}
    every = lat["shared"] + lat["private"]
    alone_lat = alone.latencies["shared"] + alone.latencies["private"]
    counts = {k: sum(c.counts[k] for c in clients) for k in clients[0].counts}
    summary = {
        "clients": args.clients, "per_client": args.per_client, "wall_s": round(wall, 1),
        "operations": counts, "executions_timed": len(every),
        "p50_ms": round(percentile(every, 50), 1), "p99_ms": round(percentile(every, 99), 1),
        "shared_p50_ms": round(percentile(lat["shared"], 50), 1),
        "shared_p99_ms": round(percentile(lat["shared"], 99), 1),
        "private_p50_ms": round(percentile(lat["private"], 50), 1),
        "private_p99_ms": round(percentile(lat["private"], 99), 1),
        "alone_p50_ms": round(percentile(alone_lat, 50), 1) if alone_lat else None,
        "alone_p99_ms": round(percentile(alone_lat, 99), 1) if alone_lat else None,
        "states_checked": sum(len(c.expected) for c in clients),
        "problems": len(problems),
    }
    for problem in problems[:30]:
        print("PROBLEM", problem)
    print(json.dumps(summary))
    rows = "\n".join(
        f"| {label} ({n}) | {summary[key + 'p50_ms']} ms | {summary[key + 'p99_ms']} ms |"
        for label, n, key in [("all", len(every), ""),
                              ("from the shared state", len(lat["shared"]), "shared_"),
                              ("private chains", len(lat["private"]), "private_"),
                              ("one client alone, before", len(alone_lat), "alone_")])
    if args.write_benchmarks and not problems:
        write_section(args.write_benchmarks, f"""## Load

`python scripts/load.py --clients {args.clients} --per-client {args.per_client}` on
{machine()}; commit {revision()}, {time.strftime("%Y-%m-%d %H:%M", time.gmtime())} UTC;
load average {load_before:.1f} when it started (the machine is shared with other jobs).

{args.clients} concurrent clients, {args.per_client} operations each, against one server with
the default config.toml: {counts['shared']} cells from a shared state (auto-named new
states), {counts['private']} cells continuing each client's own chain (new or rebound
names), {counts['interrupt']} interrupts of a sleeping cell, {counts['delete']} deletes.
Latency is that of a whole POST /execute answered with a stored state, seen by the
client, while the other clients run.

| executions | p50 | p99 |
|---|---|---|
{rows}

Wall time {summary['wall_s']} s. Errors answered: 0. States lost: 0 of
{summary['states_checked']} checked by value (deleted ones answer 404). Worker processes
left after the run: within the two zygotes plus a holder and its spares per live state;
after SIGTERM: none.

""")
    if problems:
        print(f"server log and store kept in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
