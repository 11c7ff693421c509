"""The snapshot kernel: registry of states, worker processes, namespace, outputs."""

# The package's one version: pyproject.toml reads it (tool.setuptools.dynamic), and so do
# the receipts of fresh runs, GET /openapi.json and the Jupyter kernel's kernel_info.
__version__ = "0.3.0"
