"""Benchmark this server against snapshot-kernel 0.2.1, ipykernel and a dill checkpoint baseline.

    python scripts/bench.py --quick      # < 3 minutes, states up to 100 MB
    python scripts/bench.py              # < 30 minutes, states up to 1 GB
    python scripts/bench.py --only a,b3 --no-write   # a subset, print only
    python scripts/bench.py --profile    # where our server's time goes, phase by phase
    python scripts/bench.py --only nb    # notebook runs against nbclient + ipykernel

The parts are in the package scripts/bench/ beside this file (peers,
workloads, notebook, report, profile); BENCHMARKS.md says what each
workload measures.
"""

from bench.cli import main

if __name__ == "__main__":
    main()
