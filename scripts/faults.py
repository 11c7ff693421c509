"""SIGKILL the server at random moments during a stream of executions, round after round.

Run from the repository root:

    python scripts/faults.py [--rounds 50] [--clients 3] [--seed 1] [--work-dir DIR]

Each round starts the server on one store (the same for every round),
runs `--clients` threads that each execute a chain of cells (small and
1.6 MB states, new names), and SIGKILLs the server a random delay (0 to
2 s) after the first answer of the round (one round in ten: during
start-up, before any answer). Then it checks, and the round survives only
if all hold:

- every worker process of the killed server is gone within 60 s (a generous
  deadline for a loaded machine: they go within milliseconds);
- `scripts/check_store.py` passes (every manifest's blobs present and intact);
- on the restarted server, every state whose execution was answered, in
  any round so far, is listed; every state of this round (answered or not:
  an execution whose answer was lost may still have stored its state) runs
  and holds exactly the values its chain put there, as do a sample of
  older states; no state is listed that no execution asked for.

It prints one line per round and `survived N/M rounds`; exit status 0 when
every round survived. The suite runs 5 rounds with `--max-delay 1`
(tests/test_faults.py).
"""

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from harness import ROOT, Server, ServerError, alive

SIZES = (10, 1000, 200_000)  # floats per state: a few bytes to 1.6 MB (a slower write)


def cell(i, size):
    """The code of step i of a chain: a running total and an array of `size` floats."""
    first = "import numpy as np\ntotal = 0\n" if i == 0 else ""
    return f"{first}total = total + {i}\nblob = np.full({size}, {float(i)})\nstep = {i}"


def expected(i, size):
    """What the check expression answers in the state made by step i."""
    return repr((sum(range(i + 1)), float(i), size, i))


CHECK = "total, float(blob[0]), len(blob), step"


def stream(server, prefix, rng, answered, asked, stop):
    """Execute a chain of cells until the server dies, remembering what was answered."""
    state, i = "initial", 0
    while not stop.is_set():
        size = rng.choice(SIZES)
        name = f"{prefix}-{i}"
        asked[name] = expected(i, size)
        try:
            answer = server.call("POST", "/execute", {
                "code": cell(i, size), "exec_id": name, "state_name": state,
                "new_state_name": name})
        except ServerError:
            return  # the server died mid-answer
        if answer.get("error") is not None or answer.get("state_name") != name:
            answered[name] = f"error answer: {answer.get('error')}"
            return
        answered[name] = asked[name]
        state, i = name, i + 1


def check_round(server, rnd, answered_all, asked_all, this_round, rng):
    """Problems found on the restarted server (an empty list if the round survived)."""
    problems = []
    listed = set(server.call("GET", "/states")["states"])
    for name, value in answered_all.items():
        if value.startswith("error answer"):
            problems.append(f"{name}: {value}")
        elif name not in listed:
            problems.append(f"{name}: answered but missing after the restart")
    strays = listed - set(asked_all) - {"initial"}
    if strays:
        problems.append(f"states no execution asked for: {sorted(strays)[:5]}")
    older = sorted(set(answered_all) - set(this_round))
    sample = rng.sample(older, min(5, len(older)))
    for name in sorted(set(this_round) & listed) + sample:
        try:
            server.call("GET", f"/states/{name}")
            answer = server.call("POST", "/multistate_execute", {
                "code": CHECK, "exec_id": f"check-{rnd}-{name}", "state_mapping": {},
                "default_state": name})
        except ServerError as exc:
            problems.append(f"{name}: {exc}")
            continue
        if answer["error"] is not None:
            problems.append(f"{name}: does not run: {answer['error']['ename']}: "
                            f"{answer['error']['evalue']}")
            continue
        got = answer["output"][-1]["data"]["text/plain"] if answer["output"] else None
        if got != asked_all[name]:
            problems.append(f"{name}: holds {got}, expected {asked_all[name]}")
    return problems


def check_store(data_dir):
    """(ok, output) of scripts/check_store.py on the store."""
    run = subprocess.run([sys.executable, "scripts/check_store.py", "--data-dir", data_dir],
                         cwd=ROOT, capture_output=True, text=True)
    return run.returncode == 0, run.stdout + run.stderr


def main(argv=None):
    """Run the rounds; exit status 0 if every round survived."""
    p = argparse.ArgumentParser(description="SIGKILL the server during executions, N rounds")
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--clients", type=int, default=3, help="concurrent execution streams")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-delay", type=float, default=2.0,
                   help="largest delay in s before the SIGKILL of a round")
    p.add_argument("--work-dir", help="folder for the store and logs (default: a temp dir)")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    work = args.work_dir or tempfile.mkdtemp(prefix="snapk-faults-")
    own_work = args.work_dir is None
    os.makedirs(work, exist_ok=True)
    data_dir = os.path.join(work, "store")
    log = os.path.join(work, "server.log")
    answered_all, asked_all, survived = {}, {}, 0
    start = time.monotonic()
    server = Server(data_dir, log_path=log)
    for rnd in range(1, args.rounds + 1):
        answered, asked, stop = {}, {}, threading.Event()
        threads = [threading.Thread(target=stream, args=(
            server, f"r{rnd}c{c}", random.Random(rng.random()), answered, asked, stop))
            for c in range(args.clients)]
        for t in threads:
            t.start()
        # Most kills land mid-stream (after a first answer); one in ten during start-up.
        if rng.random() >= 0.1:
            deadline = time.monotonic() + 60
            while not answered and time.monotonic() < deadline:
                time.sleep(0.01)
        delay = rng.uniform(0, args.max_delay)
        time.sleep(delay)
        workers = server.workers()
        server.stop(signal.SIGKILL)
        stop.set()
        for t in threads:
            t.join(60)
        answered_all.update(answered)
        asked_all.update(asked)
        problems = []
        deadline = time.monotonic() + 60
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        leaked = [w for w in workers if alive(w)]
        if leaked:
            problems.append(f"worker processes outlived the server: {leaked}")
        ok, out = check_store(data_dir)
        if not ok:
            problems.append("check_store.py failed:\n" + out)
        try:
            server = Server(data_dir, log_path=log)
            problems += check_round(server, rnd, answered_all, asked_all, asked, rng)
        except (OSError, RuntimeError, ValueError) as exc:
            problems.append(f"restart failed: {exc}")
        survived += not problems
        print(f"round {rnd}: killed {delay:.2f} s in, {len(answered)} answered, "
              f"{len(asked) - len(answered)} in flight, {len(workers)} workers: "
              + ("ok" if not problems else "FAILED\n  " + "\n  ".join(problems)), flush=True)
        for w in leaked:
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if server.proc.poll() is not None:
            break
    server.stop()
    print(f"survived {survived}/{args.rounds} rounds; {len(answered_all)} answered "
          f"executions, {len(asked_all)} asked, in {time.monotonic() - start:.0f} s")
    if own_work and survived == args.rounds:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if survived == args.rounds else 1


if __name__ == "__main__":
    sys.exit(main())
