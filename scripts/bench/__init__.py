"""Benchmark this server against snapshot-kernel 0.2.1, ipykernel and a dill checkpoint baseline.

The parts: `peers` (the servers under test, behind the same calls),
`workloads` (what is measured, a to g), `notebook` (nb: this server's
notebook runs against nbclient), `scaling` (s: costs by state size),
`floors` (fl: what this machine allows under a cell and a save), `report`
(the table and BENCHMARKS.md), `profile` (--profile: this server's phases from its own trace), `cli`
(the command line of scripts/bench.py, which runs it).
"""

PAUSE_S = 0.3  # a person's pause before a cell (workloads a and fl)
