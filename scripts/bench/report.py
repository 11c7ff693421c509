"""The results: formatting, the table with a column per peer, and BENCHMARKS.md."""

import os
import statistics

OWNED = ("How to run", "Results: quick", "Results: full", "Results: notebook",
         "Results: scaling")


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


class Table:
    """Rows of the results table, with ratios of ours to each other peer and the target."""

    def __init__(self, titles):
        """`titles`: {peer kind: column title}, ours first."""
        self.titles = titles
        self.rows = []

    def add(self, workload, metric, values, target=None, met=None, better="lower",
            kind="time"):
        """A row: `values` {peer: number or text}; ratios are peer / ours."""
        self.rows.append({"workload": workload, "metric": metric, "values": values,
                          "target": target, "met": met, "better": better, "kind": kind})
        print(f"  {workload:10} {metric:44} " + "  ".join(
            f"{p}={self.cell(values.get(p), kind)}" for p in self.titles) +
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
        ours, *others = self.titles
        head = ["workload", "metric", self.titles[ours]]
        for kind in others:
            head += [self.titles[kind], f"ours vs {kind}"]
        head += ["target", "met"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            v = r["values"]
            cells = [r["workload"], r["metric"], self.cell(v.get(ours), r["kind"])]
            for kind in others:
                cells += [self.cell(v.get(kind), r["kind"]),
                          self.ratio(v.get(ours), v.get(kind), r["better"])]
            cells += [r["target"] or "",
                      "" if r["met"] is None else ("yes" if r["met"] else "**no**")]
            lines.append("| " + " | ".join(cells) + " |")
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
python scripts/bench.py --only s   # this server only: costs by state size, 0 B to 4 GB
```

The script (its parts are in `scripts/bench/`: `peers.py`, `workloads.py`,
`notebook.py`, `report.py`, `profile.py`) installs snapshot-kernel 0.2.1
with numpy and pandas into a virtual environment of its own (`--venv`,
default `~/.cache/snapshot-bench/ref`) and runs four peers side by side: this
server (`main.py` on a temporary store), the reference (in memory only),
ipykernel (a Jupyter kernel of the same interpreter, driven through
jupyter_client as a notebook front end does: a cell's round trip ends when
both its reply and the kernel's return to idle have arrived), and
`scripts/dill_baseline.py`, which runs cells in one namespace and dumps all
of it with dill after every cell. The three servers get the same HTTP
calls. ipykernel and dill have one namespace and no states: a workload
that runs from named states or in parallel from one state is "n/a" for
them, and each sequence starts from an emptied namespace.
Latencies are client round trips, medians, with peers interleaved run by
run. Before every cell the bench calls `os.sync()`, so the dirty pages of
earlier cells (the dill peer writes its whole namespace each time) are
not flushed by the kernel during the next cell, which would charge one
peer's writes to another's disk flush. Store growth of this server is
exact: bytes of new blobs plus growth of the manifests, read from the
LMDB file between cells; for dill it is the size of the checkpoint written
after the cell. "ours vs X" is how many times better this server is
(> 1× = better). A cell's own time in b3 is the plain `exec` time the dill
baseline measured for it (display included).

Workload a is a chain of `x += 1` as a person works: each cell runs from
the state the cell before it made, back to back and then with a 0.3 s
pause before each cell (what a cell waits for after a pause is what the
machine let go cold meanwhile), next to an empty state, numeric DataFrames
of growing size and DataFrames with a string column (10 MB with --quick;
100 MB and 1 GB). Peers take turns cell by cell; a peer that needs more
than a second for one such cell (dill dumping a large namespace) runs a
chain of 3 cells instead.

`--profile` runs this server alone with `server.trace_file` set (a
`--config` file), so that each of its processes stamps the phases of every
request (`kernel/trace.py`: CLOCK_MONOTONIC, one file); the bench adds its
own stamps for sending each request and reading its answer. With a
request's stamps in time order across processes, it prints for each stamp
the median time since the one before it (HTTP in, server to child,
compile, run, save, answer, HTTP out, ...), per workload and pause
between cells (`--gaps`; `--quick`: 10 cells each instead of 30), each
cell run from the state the one before made.

The notebook workload (nb) runs this server alone (no other peer is
started when it is the only workload) and compares POST /notebooks/run on
a 30-cell data notebook with nbclient running the same notebook in
ipykernel (each one-cell edit with an nbclient run made just before it:
the machine's speed drifts by more than the difference measured); run
alone (`--only nb`) it writes the section "Results: notebook".

The scaling workload (s, `scaling.py`) runs only when named: this server
alone, on states of 0 B to 4 GB (`--quick`: to 100 MB), each a DataFrame of
six float columns and an Arrow-backed string column. For each it gives
`x += 1` (median), the first save (the make cell's round trip minus the
time its `make()` took, measured in the cell; the same `make()` in a plain
interpreter is shown beside it), the store's growth, a restart's
first answer and full load (server start to the holder's `loaded` trace
stamp: every variable of the state in its memory) and the workers' PSS.
For 1 GB (`--quick`: 100 MB) it also gives issue 27's rows, each beside
its floor measured in the same run: the first save against writing and
`fdatasync`ing as many bytes beside the store (the faster of a write just
before the make cell and one right after the save); the restore of the state's
buffers in a new interpreter against copying the same bytes into new
memory with their XXH3-64 (turn about, median of 3); and, after another
restart, the first cell that reads every column (minus its own time, as
the cell measured it), then the same cell from a second state sharing the
frame's blobs. Run alone (`--only s`) it writes the section "Results:
scaling".

The floors (fl, `floors.py`) run right after workload a, with no server of
ours in them: what a trivial cell must cross at the least here (an HTTP
round trip to a route of bottle on cheroot that reads JSON, a byte to a
forked process and back, a synced LMDB commit of one small record), back
to back and paced as in a, and their sum; beside them a raw HTTP server (a
thread per connection, no framework), the fork of a process that imported
what a holder has (back to back, a cell waits for its state's holder to be
forked), and the time to write and sync 1 GiB (`--quick`: 256 MiB) beside
the bench's stores, under a large first save."""


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
