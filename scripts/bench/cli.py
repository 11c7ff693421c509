"""The command line of scripts/bench.py."""

import argparse
import compileall
import datetime
import os

from bench.profile import profile
from bench.report import write_markdown
from bench.workloads import WORKLOADS, plan, run
from harness import ROOT, machine, revision


def gap_list(text):
    """--gaps: comma-separated pauses in seconds."""
    try:
        gaps = [float(g) for g in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of seconds: {text!r}") from None
    if any(g < 0 for g in gaps):
        raise argparse.ArgumentTypeError(f"a pause cannot be negative: {text!r}")
    return gaps


def compile_tree():
    """Write this tree's bytecode, as pip does when it installs a package.

    The reference and ipykernel start from the bytecode pip wrote; where
    PYTHONDONTWRITEBYTECODE is set (as on this machine), every start of this
    server would otherwise compile its sources again and be timed doing it.
    """
    for folder in ("api", "kernel", "storage"):
        compileall.compile_dir(os.path.join(ROOT, folder), quiet=1)


def main(argv=None):
    """Parse the command line, run, print and write the table."""
    ap = argparse.ArgumentParser(prog="bench.py", description=(
        "Benchmark this server against snapshot-kernel 0.2.1, ipykernel and a dill "
        "checkpoint baseline, side by side; write the table into BENCHMARKS.md."))
    ap.add_argument("--quick", action="store_true", help="smaller states, fewer runs (< 3 min)")
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/snapshot-bench/ref"),
                    help="virtual environment of the reference (made if missing)")
    ap.add_argument("--only", help=f"comma-separated workloads among {','.join(WORKLOADS)}")
    ap.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"),
                    help="the file the table is written into (default BENCHMARKS.md)")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    ap.add_argument("--keep", action="store_true", help="keep the stores and server logs")
    ap.add_argument("--profile", action="store_true",
                    help="instead: this server's phase timings (from its trace) on a (0 B, "
                    "100 MB) and b3; with --quick, 10 cells each instead of 30")
    ap.add_argument("--gaps", type=gap_list, default=[0.0, 0.2],
                    help="with --profile: pauses before each cell, in seconds (default 0,0.2)")
    ap.add_argument("--ours-config", help="a TOML file passed to this server as --config "
                    "(e.g. to compare store.durability settings)")
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    if only is not None and not only <= set(WORKLOADS):
        ap.error(f"unknown workload(s) {','.join(sorted(only - set(WORKLOADS)))}; "
                 f"choose among {','.join(WORKLOADS)}")
    if args.ours_config and not os.path.isfile(args.ours_config):
        ap.error(f"--ours-config: no such file: {args.ours_config}")
    compile_tree()
    if args.profile:
        if args.ours_config:
            ap.error("--profile writes this server's config itself (its trace_file); "
                     "it cannot be combined with --ours-config")
        profile(args.gaps, args.quick)
        return
    ours_args = ["--config", os.path.abspath(args.ours_config)] if args.ours_config else []
    if ours_args:
        args.no_write = True  # results of a non-default configuration are not the table
    p = plan(args.quick)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mach = (f"{machine()}, {now}; commit {revision()}; shared with other jobs (load "
            f"average {os.getloadavg()[0]:.1f} at the start), so figures are noisy")
    print(f"{p['mode']} run on {mach}", flush=True)
    table, details, seconds = run(p, only, args.venv, args.keep, ours_args)
    print()
    print(table.markdown())
    for title, text in details:
        print(f"\n{title}\n{text}")
    print(f"\n{p['mode']} run took {seconds / 60:.1f} min")
    if not args.no_write and only in (None, {"nb"}, {"s"}):
        # The notebook and the scaling workloads alone have a section of their own.
        mode = {None: p["mode"], "nb": "notebook", "s": "scaling"}[only and min(only)]
        write_markdown(args.out, dict(p, mode=mode), table, details, seconds, mach)
        print(f"wrote {args.out}")
