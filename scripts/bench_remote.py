"""Figures of the remote store (BENCHMARKS.md, "Remote store"), against moto's S3 server.

    python scripts/bench_remote.py [--runs N] [--restore-mb MB] [--dedup-mb MB]

Starts moto's S3 server on a loopback port (tests/s3_server.py) and
servers through scripts/harness.py (needs the test extra), then:

- a trivial cell (`x += 1` on a state of one int): no remote, remote with
  durability "sync", remote with "async" (client round trips, median);
- a state of --restore-mb MB of random bytes made on one server, run from
  on a second server with an empty cache: the first cell that needs only
  a small variable, then the first that reads the whole array, with the
  bytes the S3 server sent (object sizes of the GETs in its log); the same
  cell again after a restart on the now warm cache, for comparison;
- dedup: two servers compute the same --dedup-mb MB array each; how much
  the second one sent and how much the remote grew.

Prints a Markdown table. moto keeps objects in its own memory: loopback
figures without a network, and moto serializes its requests.
"""

import argparse
import os
import re
import statistics
import tempfile
import time

import requests

import harness
from harness import S3

MB = 10 ** 6


class Server(harness.Server):
    """harness's server, with cells sent as the tests send them (requests)."""

    def execute(self, code, state="initial", new=None):
        """POST /execute; the answer of a cell that must succeed."""
        body = {"code": code, "exec_id": f"e{time.monotonic_ns()}", "state_name": state}
        if new is not None:
            body["new_state_name"] = new
        r = requests.post(self.url + "/execute", params={"token": self.token}, json=body,
                          timeout=120)
        r.raise_for_status()
        answer = r.json()
        if answer["error"] is not None:
            raise RuntimeError(f"the cell failed: {answer['error']}")
        return answer


def started(data, config):
    """A server on `data`, past its start: a cell has run and the warm zygote is up."""
    srv = Server(data, config=config or None)
    srv.execute("1")
    time.sleep(3)  # the warm zygote imports numpy, pandas, ... (1 to 2 s)
    return srv


def timed(srv, code, state, new=None):
    """(seconds, answer) of one execution."""
    start = time.perf_counter()
    answer = srv.execute(code, state=state, new=new)
    return time.perf_counter() - start, answer


def trivial(s3, tmp, runs):
    """Median ms of `x += 1` without a remote, and with sync and async durability."""
    rows = []
    for label, config in (("no remote", ""),
                          ("remote, durability sync", s3_config(s3, "sync")),
                          ("remote, durability async", s3_config(s3, "async"))):
        srv = started(os.path.join(tmp, label.replace(" ", "-").replace(",", "")), config)
        try:
            srv.execute("x = 0", new="zero")
            for _ in range(3):  # warm-up: zygote, spares, client connections
                timed(srv, "x += 1", "zero")
            times = [timed(srv, "x += 1", "zero")[0] for _ in range(runs)]
        finally:
            srv.stop()
        rows.append((f"x += 1, state of one int: {label} (median of {runs})",
                     f"{statistics.median(times) * 1000:.1f} ms"))
    return rows


def s3_config(s3, durability):
    """A server config on a new bucket of `s3` (defaults otherwise)."""
    return (f'[store]\nremote = "s3://{s3.bucket()}/states"\n'
            f'remote_endpoint = "{s3.endpoint}"\ndurability = "{durability}"\n')


def sent_bytes(s3, bucket, since, sizes):
    """Bytes of blob bodies the S3 server sent (GETs) from log offset `since` on."""
    with open(s3.log_path, errors="replace") as f:
        f.seek(since)
        keys = re.findall(rf'"GET /{bucket}/states/blobs/([0-9a-f]{{64}}) ', f.read())
    return sum(sizes[k] for k in keys), len(keys)


def restore(s3, tmp, mb):
    """A cold-cache restore of an `mb` MB state made on another server."""
    config = s3_config(s3, "sync")
    bucket = re.search(r"s3://([^/]+)/", config)[1]
    maker = started(os.path.join(tmp, "maker"), config)
    try:
        start = time.perf_counter()
        maker.execute(f"import numpy as np\nbig = np.frombuffer(np.random.default_rng(0)"
                      f".bytes({mb * MB}), dtype=np.uint8).copy()\nsmall = 7", new="big")
        made = time.perf_counter() - start
    finally:
        maker.stop()
    sizes = {k: item["Size"] for k, item in s3.objects(bucket, "blobs").items()}
    rows = [(f"make a {mb} MB state (random bytes) and upload it, sync",
             f"{made:.1f} s; {sum(sizes.values()) / MB:.0f} MB on the remote")]
    data = os.path.join(tmp, "cold")
    for cell, what in (("int(big[::4096].sum())", "reading all of `big`"),
                       ("small + 1", "reading only `small`")):
        data = os.path.join(tmp, f"cold-{len(rows)}")
        cold = started(data, config)
        try:
            mark = os.path.getsize(s3.log_path)
            seconds, _ = timed(cold, cell, "big")
            got, count = sent_bytes(s3, bucket, mark, sizes)
        finally:
            cold.stop()
        rows.append((f"empty cache: first cell {what} from the {mb} MB state",
                     f"{seconds:.2f} s; {got / MB:.1f} MB in {count} GETs by then"))
        warm = started(data, config)
        try:
            seconds, _ = timed(warm, cell, "big")
        finally:
            warm.stop()
        rows.append(("the same after a restart, from the filled local cache",
                     f"{seconds:.2f} s"))
    return rows


def dedup(s3, tmp, mb):
    """Two servers computing the same array: what the second sends, how the remote grows."""
    config = s3_config(s3, "sync")
    bucket = re.search(r"s3://([^/]+)/", config)[1]
    code = (f"import numpy as np\nsame = np.frombuffer(np.random.default_rng(1)"
            f".bytes({mb * MB}), dtype=np.uint8).copy()")
    rows = []
    total = {}
    for who in ("first", "second"):
        srv = started(os.path.join(tmp, f"dedup-{who}"), config)
        try:
            mark = os.path.getsize(s3.log_path)
            seconds, _ = timed(srv, code, "initial", new=f"on-{who}")
        finally:
            srv.stop()
        objects = s3.objects(bucket, "blobs")
        total[who] = sum(item["Size"] for item in objects.values())
        with open(s3.log_path, errors="replace") as f:
            f.seek(mark)
            puts = re.findall(rf'"PUT /{bucket}/states/blobs/([0-9a-f]{{64}}) ', f.read())
        sent = sum(objects[k]["Size"] for k in puts if k in objects)
        grew = total[who] - total.get("first", 0) if who == "second" else total[who]
        rows.append((f"dedup: {who} server makes the same {mb} MB array",
                     f"{seconds:.1f} s; sent {sent / MB:.2f} MB of blobs in {len(puts)} "
                     f"PUTs; remote grew {grew / MB:.2f} MB"))
    return rows


def main(argv=None):
    """Run the figures and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30, help="runs of the trivial cell")
    p.add_argument("--restore-mb", type=int, default=1000, help="size of the restored state")
    p.add_argument("--dedup-mb", type=int, default=100, help="size of the deduplicated array")
    args = p.parse_args(argv)
    for var, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(var, value)
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        s3 = S3(os.path.join(tmp, "s3.log"))
        try:
            rows = trivial(s3, tmp, args.runs) + restore(s3, tmp, args.restore_mb) + \
                dedup(s3, tmp, args.dedup_mb)
        finally:
            s3.stop()
    print("| measurement | result |\n|---|---|")
    for label, value in rows:
        print(f"| {label} | {value} |")


if __name__ == "__main__":
    main()
