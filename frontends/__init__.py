"""The front ends: clients of the server, apart from its core (nothing in kernel/,
storage/ or api/ imports them). run.py is the `run` command; jupyter/ the Jupyter
kernel."""
