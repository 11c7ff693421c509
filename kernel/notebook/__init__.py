"""Notebook runs: the least work that brings every cell of a notebook up to date.

analysis (what a cell defines and reads, from its parse), graph (the two
orders and their static errors), keys (a cell's key), planner (what runs,
what is reused), runner (drives a run through the kernel), ipynb (.ipynb
files in and out).

Fresh, receipted runs of whole notebooks (`fresh`: true, `run --fresh`):
fresh (the run), fresh_file and files (files and promotion), fresh_request
(over HTTP), environment (the explicit environment), processes, receipt.
"""

import sys

# nbformat imports jsonschema, which imports its optional format checkers; one of
# them, rfc3987_syntax (when installed), builds a grammar for 2 to 3 s that every
# use of .ipynb files would pay. Nothing here checks IRI formats, so it is kept out
# (unless something imported it already).
sys.modules.setdefault("rfc3987_syntax", None)
