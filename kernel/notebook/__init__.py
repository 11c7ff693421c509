"""Notebook runs, on the one model of model.py (NotebookRequest, NotebookCell,
NotebookRun).

Incremental runs, the least work that brings every cell up to date:
analysis (what a cell defines and reads, from its parse), graph (the two
orders and their static errors), keys (a cell's key), planner (what runs,
what is reused), incremental (drives a run through the registry).

Fresh, receipted runs of whole notebooks (`fresh`: true, `run --fresh`):
fresh (the run, and one asked for over HTTP), fresh_file (a file's run:
its checks, promotion, receipt), environment (the explicit environment),
processes, receipt.

Both: ipynb (.ipynb files in and out); atomic writes and file digests are
kernel/files.py. The `run` command over them is frontends/run.py.
"""

import sys

# nbformat imports jsonschema, which imports its optional format checkers; one of
# them, rfc3987_syntax (when installed), builds a grammar for 2 to 3 s that every
# use of .ipynb files would pay. Nothing here checks IRI formats, so it is kept out
# (unless something imported it already).
sys.modules.setdefault("rfc3987_syntax", None)
