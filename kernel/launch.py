"""How the package starts Python processes of its own code: the zygote, the
Jupyter kernel and the server it starts, a fresh run's environment probe.

Each is this interpreter with `-P` (Python 3.11): the working directory stays
off sys.path, and our code is all inside the one package `snapkernel`, so a
notebook folder's own `kernel/`, `storage.py` or `main.py` stays the
notebook's (these processes start in the notebook's folder). An installed
package (a wheel, or `pip install -e .`) is found without help; the folder
that holds the `snapkernel` package goes on PYTHONPATH only when a new
interpreter would not find this very package there (a fresh run's new HOME
hides a package installed in the user site), since PYTHONPATH reaches every
program a cell starts too.
"""

import glob
import json
import os
import site
import subprocess
import sys

# The `snapkernel` package: site-packages/snapkernel for a wheel, the checkout for an
# editable install (setuptools maps the package onto it).
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The folder holding it, for PYTHONPATH (a wheel's site-packages).
PACKAGE_HOME = os.path.dirname(PACKAGE_DIR)

# Where a new interpreter finds `snapkernel`, if anywhere.
_PROBE = ("import importlib.util\n"
          "spec = importlib.util.find_spec('snapkernel')\n"
          "print(spec.origin if spec is not None and spec.origin else '')")

# What decides a new interpreter's sys.path besides the executable.
_PATH_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONNOUSERSITE", "HOME")


def command(code, *args):
    """The argv running `code` (python -c) with this interpreter, away from the cwd."""
    return [sys.executable, "-P", "-c", code, *args]


def env(base):
    """`base` (an environment) with PACKAGE_HOME first on PYTHONPATH if the processes
    of command() need it to import this package."""
    env = dict(base)
    if needs_home(env):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_HOME, env.get("PYTHONPATH")]))
    return env


# needs_home()'s answers by the values of _PATH_VARIABLES: one probe per set of values
# (a fresh run's new HOME asks again: it hides a package installed in the user site).
_answers = {}


def needs_home(base=None):
    """True if a process of command() in environment `base` (default os.environ) would
    not import this package without PACKAGE_HOME on its sys.path."""
    base = os.environ if base is None else base
    if PACKAGE_HOME in site.getsitepackages() or _editable_here():
        return False  # installed in this interpreter's own site-packages: always found
    key = tuple(base.get(name) for name in _PATH_VARIABLES)
    if key not in _answers:
        _answers[key] = _probe(base)
    return _answers[key]


def _editable_here():
    """True when this checkout is installed in editable mode in this interpreter's own
    site-packages (`pip install -e .`): a new interpreter finds it without asking,
    and a server start saves the probe (about 0.15 s)."""
    # The dist-info's own file, read directly: importing importlib.metadata alone costs
    # a server start 0.1 s.
    for folder in site.getsitepackages():
        for found in glob.glob(os.path.join(folder, "snapshot_kernel_server-*.dist-info",
                                            "direct_url.json")):
            try:
                with open(found) as f:
                    info = json.load(f)
            except (OSError, ValueError):
                continue
            url = info.get("url", "")
            if info.get("dir_info", {}).get("editable") and url.startswith("file://") and \
                    os.path.realpath(url[len("file://"):]) == os.path.realpath(PACKAGE_DIR):
                return True
    return False


def _probe(base):
    """Ask a new interpreter in environment `base` where it finds `snapkernel`: True
    unless it finds this package."""
    try:
        done = subprocess.run(command(_PROBE), env=base, cwd="/", capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return True  # cannot tell: with the folder on PYTHONPATH it works either way
    found = done.stdout.strip()
    return not (done.returncode == 0 and found
                and os.path.realpath(os.path.dirname(found)) == os.path.realpath(PACKAGE_DIR))
