"""The explicit environment of a fresh run, and the identity of its interpreter.

A fresh run's interpreter starts from nothing of the caller's but `PATH`
and the names allowed (config.toml's `fresh.env`, plus `--env`): `HOME` is
a new temporary folder, and the folders programs look for configuration and
caches in (`XDG_*`, IPython's, matplotlib's, Jupyter's) are inside it, as
is `TMPDIR`, so what the notebook leaves there goes with the run. A name
that looks like it holds a secret is refused before anything runs.

The interpreter's identity is measured in that environment, by the same
interpreter started the way the run's zygote is (kernel/worker/process.py
`worker_env`, kernel/launch.py `command`, the working directory first on
sys.path): what it finds installed is what the notebook can import.
"""

import hashlib
import json
import os
import re
import subprocess
import sys

from snapkernel.kernel import launch
from snapkernel.kernel import files

# Parts of a variable name that mark it as a secret (compared without case).
REFUSED_PARTS = ("SECRET", "TOKEN", "PASSWORD", "KEY", "CREDENTIAL", "PROXY")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# Where each variable points, relative to the temporary HOME.
HOME_FOLDERS = {
    "XDG_CONFIG_HOME": ".config",
    "XDG_CACHE_HOME": ".cache",
    "XDG_DATA_HOME": ".local/share",
    "XDG_STATE_HOME": ".local/state",
    "XDG_RUNTIME_DIR": ".runtime",
    "IPYTHONDIR": ".ipython",
    "MPLCONFIGDIR": ".config/matplotlib",
    "JUPYTER_CONFIG_DIR": ".jupyter",
    "JUPYTER_DATA_DIR": ".local/share/jupyter",
    "JUPYTER_RUNTIME_DIR": ".local/share/jupyter/runtime",
}

# Run in the kernel's interpreter and environment: what it is and what it can import.
_PROBE = r"""
import importlib.metadata, json, platform, re, sys
sys.path.insert(0, "")  # as the zygote does once its own imports are done
found = {}
for dist in importlib.metadata.distributions():
    name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
    if name and name not in found:  # the first on sys.path is the one imported
        found[name] = dist.version
json.dump({"executable": sys.executable, "version": sys.version,
           "python_version": platform.python_version(),
           "implementation": platform.python_implementation(),
           "distributions": sorted(f"{n}=={v}" for n, v in found.items())}, sys.stdout)
"""


class EnvironmentRefused(ValueError):
    """A variable name that cannot be passed to a fresh run (the message says why)."""


def check_name(name):
    """Raise EnvironmentRefused unless `name` may be passed to a run."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise EnvironmentRefused(f"{name!r} is not an environment variable name")
    upper = name.upper()
    for part in REFUSED_PARTS:
        if part in upper:
            raise EnvironmentRefused(
                f"environment variable {name} is refused: a name containing {part} may "
                f"hold a secret, and fresh runs never pass one to a notebook")


def explicit(home, tmp, configured, requested, source=None):
    """The run's environment: PATH, HOME=`home` and the folders inside it, TMPDIR=`tmp`,
    the `configured` names that are set in `source` (default os.environ) and the
    `requested` ones, which must be set. Creates the folders.

    Raises EnvironmentRefused, before anything is created, for a refused name or a
    requested one that is not set.
    """
    source = os.environ if source is None else source
    for name in list(configured) + list(requested):
        check_name(name)
    missing = [n for n in requested if n not in source]
    if missing:
        raise EnvironmentRefused(f"--env {missing[0]}: the variable is not set")
    env = {"PATH": source.get("PATH", os.defpath), "HOME": home, "TMPDIR": tmp}
    for variable, folder in HOME_FOLDERS.items():
        env[variable] = os.path.join(home, folder)
        os.makedirs(env[variable], mode=0o700, exist_ok=True)
    os.makedirs(tmp, mode=0o700, exist_ok=True)
    for name in list(configured) + list(requested):
        if name in source:
            env[name] = source[name]
    return env


# The probe's longest wait, whatever the run's deadline: subprocess waits in epoll, whose
# timeout (int milliseconds) overflows past 24.8 days, and a run may be given a year.
_PROBE_MAX_S = 24 * 3600


class ProbeFailed(RuntimeError):
    """The kernel's interpreter could not be started in the run's environment."""


def interpreter_identity(env, cwd, timeout):
    """What the run's interpreter is, measured in `env` and `cwd` within `timeout` s.

    {executable, interpreter_sha256, python_version, version, implementation,
    distributions (how many), environment_sha256}; environment_sha256 is over
    the interpreter binary's SHA-256 (its bytes, not its path, so equal
    environments on two machines agree), the full version string and the
    sorted `name==version` inventory of the distributions it can import.
    subprocess.TimeoutExpired when it takes longer than `timeout`.
    """
    try:
        done = subprocess.run(launch.command(_PROBE), env=env, cwd=cwd,
                              stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=min(max(timeout, 0.01), _PROBE_MAX_S))
    except OSError as exc:
        raise ProbeFailed(f"cannot start {sys.executable}: {exc.strerror}") from None
    if done.returncode != 0:
        raise ProbeFailed(f"{sys.executable} failed to report its environment: "
                          f"{done.stderr.decode(errors='replace')[-500:]}")
    try:
        found = json.loads(done.stdout)
    except ValueError:  # something in the environment printed on its stdout
        raise ProbeFailed(f"{sys.executable} did not report its environment as JSON: "
                          f"{done.stdout[:200]!r}") from None
    binary = files.sha256_file(os.path.realpath(found["executable"]))
    inventory = found["distributions"]
    environment = hashlib.sha256(json.dumps(
        {"interpreter_sha256": binary, "version": found["version"],
         "distributions": inventory}, sort_keys=True).encode()).hexdigest()
    return {"executable": found["executable"], "interpreter_sha256": binary,
            "python_version": found["python_version"], "version": found["version"],
            "implementation": found["implementation"], "distributions": len(inventory),
            "environment_sha256": environment}
