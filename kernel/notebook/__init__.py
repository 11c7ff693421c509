"""Notebook runs: the least work that brings every cell of a notebook up to date.

analysis (what a cell defines and reads, from its parse), graph (the two
orders and their static errors), keys (a cell's key), planner (what runs,
what is reused), runner (drives a run through the kernel), ipynb (.ipynb
files in and out).
"""
