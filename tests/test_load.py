"""Load: 8 concurrent clients with interrupts and deletes (scripts/load.py, a smaller run).

The full run (8 clients x 100 operations) is `python scripts/load.py
--write-benchmarks BENCHMARKS.md`; its figures are in BENCHMARKS.md.
"""

import json
import subprocess
import sys

from support.server import ROOT


def test_eight_clients_no_errors_no_lost_states_no_leaked_processes():
    run = subprocess.run([sys.executable, "scripts/load.py", "--clients", "8",
                          "--per-client", "12", "--alone", "5"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    print(summary)
    assert summary["problems"] == 0
    assert summary["operations"]["interrupt"] > 0 and summary["operations"]["delete"] > 0
    assert summary["executions_timed"] > 50
