"""The status of a cell in a notebook run's answer and in a fresh run's receipt.

A module of its own so that the OpenAPI document can name them without
importing the notebook machinery at every server start.
"""

# A notebook run's cell; "pending" and "running" only while the run goes on.
RUN = ("ran", "reused", "failed", "blocked", "not_run", "pending", "running")
# A fresh run's cell, as its receipt records it.
FRESH = ("ran", "failed", "skipped", "empty", "not_run")
