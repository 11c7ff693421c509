"""Measure a fleet on this machine (BENCHMARKS.md, "A fleet"): HAProxy's share of a
trivial chained cell, the first cell after a failover by state size, and a mixed load's
requests per second and p99 with 1, 2 and 3 servers.

    python scripts/bench_fleet.py [--sizes-mb 1 100] [--load-s 10] [--runs 3]

Needs HAProxy and the test extra (moto's S3 server).
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import harness  # noqa: E402  (scripts/ is this script's own folder)
from support.fleet import TOKEN, Fleet  # noqa: E402

from snapkernel.api.client import Client  # noqa: E402


def chained(client, n):
    """Seconds of each of `n` trivial chained cells."""
    state = client.execute("i = 0", uuid.uuid4().hex, "initial")["state_name"]
    times = []
    for _ in range(n):
        t = time.perf_counter()
        state = client.execute("i += 1", uuid.uuid4().hex, state)["state_name"]
        times.append(time.perf_counter() - t)
    return times


def failover(fleet, mb):
    """Seconds of the first cell after the session's server was SIGKILLed, a state of `mb`."""
    client = fleet.client(f"failover-{uuid.uuid4().hex[:6]}")
    state = client.execute(f"import numpy as np\nbig = np.random.default_rng(0).random("
                           f"{mb * 2 ** 20 // 8})", uuid.uuid4().hex, "initial")["state_name"]
    pid = fleet.kill(client.server)
    t = time.perf_counter()
    client.execute("big[:3].sum()", uuid.uuid4().hex, state)
    took = time.perf_counter() - t
    fleet.wait_back(next(n for n, p in fleet.pids.items() if p == pid), pid)
    return took


def load(fleet, seconds, threads=4):
    """(requests per second, p99 seconds) of `threads` sessions, each a chained cell then
    a GET /states/NAME and a /symbol_hashes, for `seconds`."""
    latencies, stop = [], threading.Event()

    def session():
        client = fleet.client(f"load-{uuid.uuid4().hex}")
        state = client.execute("x = list(range(1000))", uuid.uuid4().hex, "initial")["state_name"]
        while not stop.is_set():
            for call in (lambda: client.execute("x = x[1:] + x[:1]", uuid.uuid4().hex, state),
                         lambda: client.describe(state),
                         lambda: client.call("POST", "/symbol_hashes",
                                             {"state_name": state, "symbols": ["x"]})):
                t = time.perf_counter()
                answer = call()
                latencies.append(time.perf_counter() - t)
                if isinstance(answer, dict) and answer.get("state_name"):
                    state = answer["state_name"]

    workers = [threading.Thread(target=session) for _ in range(threads)]
    for w in workers:
        w.start()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    latencies.sort()
    return len(latencies) / seconds, latencies[int(len(latencies) * 0.99)]


def main():
    """Run the measurements and print them."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 100])
    p.add_argument("--load-s", type=float, default=10)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    print(harness.machine(), "-", harness.revision())
    with tempfile.TemporaryDirectory() as tmp:
        s3 = harness.S3(os.path.join(tmp, "s3.log"))
        try:
            for servers in (1, 2, 3):
                config = os.path.join(tmp, f"shared-{servers}.toml")
                with open(config, "w") as f:
                    f.write(s3.config(s3.bucket()))
                fleet = Fleet(os.path.join(tmp, f"fleet-{servers}"), config, servers)
                try:
                    if servers == 2:
                        direct = Client(f"http://127.0.0.1:{fleet.ports['server-1']}", TOKEN)
                        via = fleet.client("chain")
                        for run in range(args.runs):
                            d = statistics.median(chained(direct, 100)) * 1000
                            h = statistics.median(chained(via, 100)) * 1000
                            print(f"chained cell: direct {d:.2f} ms, through HAProxy {h:.2f} ms")
                        for mb in args.sizes_mb:
                            took = [failover(fleet, mb) for _ in range(args.runs)]
                            print(f"first cell after failover, {mb} MB: median "
                                  f"{statistics.median(took):.2f} s of {took}")
                    for run in range(args.runs):
                        rps, p99 = load(fleet, args.load_s)
                        print(f"{servers} server(s): {rps:.0f} requests/s, p99 "
                              f"{p99 * 1000:.0f} ms")
                finally:
                    fleet.stop()
        finally:
            s3.stop()


if __name__ == "__main__":
    main()
