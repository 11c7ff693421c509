"""The Jupyter kernel: a client of the snapshot server; each executed cell is a new state."""
