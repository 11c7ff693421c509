"""Benchmark this server against snapshot-kernel 0.2.1, ipykernel and a dill checkpoint baseline.

The parts: `peers` (the servers under test, behind the same calls),
`workloads` (what is measured, a to g), `notebook` (nb: this server's
notebook runs against nbclient), `report` (the table and BENCHMARKS.md),
`profile` (--profile: this server's phases from its own trace), `cli`
(the command line of scripts/bench.py, which runs it).
"""
