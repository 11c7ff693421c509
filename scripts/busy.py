"""Keep cores busy until stopped: the load the test suite must pass under.

    python scripts/busy.py [--cores N] &      # N spinning processes (default 1)
    ...                                       # run the suite
    kill %1                                   # SIGTERM (or Ctrl-C) stops them all

Each process spins in pure Python at full speed on one core, like `stress
--cpu N`. It is how a loaded machine is made on purpose: a test that fails
only while this runs depended on timing, which is a defect of the test
(tests/support/server.py's wait_for and Gate are the alternatives).
"""

import argparse
import multiprocessing
import signal
import sys


def spin():
    """Use one core until the process is stopped."""
    n = 0
    while True:
        n += 1


def main():
    """Spin on --cores cores until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=int, default=1, help="processes spinning (default 1)")
    args = parser.parse_args()
    # The other spinners are daemonic: they are stopped when this one exits on a signal.
    others = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.cores - 1)]
    for p in others:
        p.start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        spin()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
