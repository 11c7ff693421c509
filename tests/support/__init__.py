"""What the tests share, so that no test module imports another: server.py (the
server under test and a client for assertions, waiting, gates, scripts), notebook.py
(the `run` command and .ipynb files), jupyter.py (the test kernelspec, kernels,
JupyterLab), fidelity.py (outputs compared with Jupyter's), cells.py (running single
cells). tests/conftest.py makes its fixtures from them."""
