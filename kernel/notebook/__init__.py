"""Notebook runs: the least work that brings every cell of a notebook up to date.

analysis (what a cell defines and reads, from its parse), graph (the two
orders and their static errors), keys (a cell's key), planner (what runs,
what is reused), runner (drives a run through the kernel), ipynb (.ipynb
files in and out).

Fresh, receipted runs of whole notebooks (`fresh`: true, `run --fresh`):
fresh (the run), fresh_file and files (files and promotion), fresh_request
(over HTTP), environment (the explicit environment), processes, receipt.
"""
