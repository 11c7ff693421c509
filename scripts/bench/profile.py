"""`bench.py --profile`: where this server's time goes, from the stamps its processes write.

The server runs alone with `server.trace_file` set, so that every one of its
processes appends a stamp for each phase of each request (kernel/trace.py:
CLOCK_MONOTONIC, one file). The bench adds two stamps of its own per request,
on the same clock: "client send" just before the request is written and
"client done" once the answer is read. For each request, its stamps are put
in time order across processes; the table gives, for each stamp ("role
phase"), the median time since the stamp before it, per workload and pause
between cells.
"""

import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench.peers import Ours
from bench.workloads import MB, READS, UPDATE_SETUP, frame_cell
from snapkernel.kernel import trace

# What happens before a stamp of each phase, from the usual stamp before it.
PHASES = {
    "request": "HTTP in: the request reaches its route",
    "sent": "server: a child for the state, the request about to be sent",
    "received": "server → child: the request sent, and read by the child",
    "compiled": "child: compile (read analysis)",
    "ran": "child: run the cell",
    "saved": "child: save the state",
    "answering": "child: the answer made",
    "answer": "child → server: the answer read",
    "bound": "server: the new state named, its child kept as a spare",
    "synced": "server: the store flushed, so the answer is durable",
    "reply": "server: the reply made",
    "done": "HTTP out: the reply read by the client",
    "forked": "child, after its answer: its state's holder forked",
    "warmed": "child: a throwaway cell rehearsed (its page faults taken)",
}
ROUND_TRIP = "round trip"


def client_stamps(exec_id, sent, done):
    """The bench's two stamps of one request, shaped as kernel/trace.py's."""
    return [{"t": sent, "pid": os.getpid(), "role": "client", "phase": "send", "exec": exec_id},
            {"t": done, "pid": os.getpid(), "role": "client", "phase": "done", "exec": exec_id}]


def by_request(stamps):
    """{exec_id: its stamps in time order}."""
    mine = collections.defaultdict(list)
    for s in stamps:
        if s["exec"] is not None:
            mine[s["exec"]].append(s)
    for ss in mine.values():
        ss.sort(key=lambda s: s["t"])
    return mine


def steps(stamps):
    """{exec_id: [(stamp, stamp before it, seconds since it)]}, in time order.

    A stamp is named "role phase"; the first entry is (ROUND_TRIP, None,
    client send to client done) when the bench stamped both.
    """
    out = {}
    for exec_id, mine in by_request(stamps).items():
        names = [f"{s['role']} {s['phase']}" for s in mine]
        out[exec_id] = [(name, before, b["t"] - a["t"])
                        for a, b, before, name in zip(mine, mine[1:], names, names[1:])]
        ends = {s["phase"]: s["t"] for s in mine if s["role"] == "client"}
        if "send" in ends and "done" in ends:
            out[exec_id].insert(0, (ROUND_TRIP, None, ends["done"] - ends["send"]))
    return out


def summarise(stamps, columns):
    """Rows [(stamp, usual stamp before it, {column: (median ms, count)})].

    For `columns` {title: exec ids}: the time from the stamp before each one
    (in any process) to it. Rows are in the order the stamps usually come
    (their median position in a request); a race between processes (two
    stamps of one moment in two processes) changes which stamp comes before,
    not the rows.
    """
    durations = collections.defaultdict(lambda: collections.defaultdict(list))
    positions = collections.defaultdict(list)
    before = collections.defaultdict(collections.Counter)
    per_exec = steps(stamps)
    for title, exec_ids in columns.items():
        for exec_id in exec_ids:
            for position, (name, prior, seconds) in enumerate(per_exec.get(exec_id, ())):
                durations[name][title].append(seconds * 1e3)
                positions[name].append(position)
                before[name][prior] += 1
    order = sorted(durations, key=lambda name: (statistics.median(positions[name]),
                                                statistics.mean(positions[name])))
    return [(name, before[name].most_common(1)[0][0],
             {title: (statistics.median(ms), len(ms)) for title, ms in durations[name].items()})
            for name in order]


def describe(name):
    """What happens before a stamp `name` ("role phase")."""
    if name == ROUND_TRIP:
        return "client send → client done"
    return PHASES.get(name.split(" ", 1)[-1], "")


def markdown(rows, titles):
    """The rows as a table: a column per workload, each cell "median ms (n=count)"."""
    head = ["stamp", "usually after", "what happened since (median ms)"] + list(titles)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, prior, cells in rows:
        values = [f"{cells[t][0]:.2f} (n={cells[t][1]})" if t in cells else "-" for t in titles]
        lines.append("| " + " | ".join([name, prior or "", describe(name)] + values) + " |")
    return "\n".join(lines)


def untagged(stamps):
    """"role phase ×count" of the stamps that belong to no request."""
    counts = collections.Counter(f"{s['role']} {s['phase']}" for s in stamps
                                 if s["exec"] is None)
    return ", ".join(f"{name} ×{n}" for name, n in sorted(counts.items()))


def profile(gaps, quick):
    """Run this server on a (0 B, 100 MB) and b3 with each pause in `gaps`; print the table."""
    tmp = tempfile.mkdtemp(prefix="snapshot-bench-profile-")
    path = os.path.join(tmp, "trace.jsonl")
    # A JSON string is a TOML basic string.
    peer = Ours(tmp, config=f"[server]\ntrace_file = {json.dumps(path)}\n")
    peer.start()
    cells = 10 if quick else 30
    columns, ours = {}, []
    try:
        peer.must(frame_cell(0), new="p0")
        peer.must(frame_cell(100 * MB), new="p100")
        peer.must(UPDATE_SETUP, new="p-b3")
        for gap in gaps:
            # Each cell from the state the one before made, as a person works.
            for name, base, codes in (
                    ("a: x += 1 chained, 0 B", "p0", ["x += 1"] * cells),
                    ("a: x += 1 chained, 100 MB", "p100", ["x += 1"] * cells),
                    ("b3: read-only cells, 1M rows", "p-b3", (READS * 3)[:cells])):
                title = f"{name}, {gap} s pause"
                columns[title] = []
                state = base
                for i, code in enumerate(codes):
                    time.sleep(gap)
                    exec_id = f"profile-{len(columns)}-{i}"
                    answer = peer.execute(code, state, exec_id=exec_id)[1]
                    if answer.get("error"):
                        raise RuntimeError(f"{code!r} failed: {answer['error']}")
                    ours += client_stamps(exec_id, *peer.client.times())
                    columns[title].append(exec_id)
                    state = answer["state_name"]
    finally:
        peer.stop()  # every process has written its stamps once the server is gone
    if not os.path.exists(path):
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit("bench.py --profile: the server wrote no stamps with server.trace_file set "
                 "(see kernel/trace.py)")
    stamps = trace.read(path) + ours
    table = markdown(summarise(stamps, columns), list(columns))
    print(table)
    others = untagged(stamps)
    if others:
        print(f"\nStamps of no request: {others}.")
    shutil.rmtree(tmp, ignore_errors=True)
    return table
