"""`snapshot-kernel install-kernelspec`: make the kernel known to Jupyter.

The kernelspec runs this package's kernel with this interpreter, with -P:
Jupyter starts a kernel in the notebook's folder, whose own `kernel/` must
not be imported instead of ours (kernel/launch.py). An installed package
(a wheel, or `pip install -e .`) needs nothing more; only a checkout that is
not installed has the command put its folder first on sys.path itself (not
PYTHONPATH in the spec's env, which would replace the user's own PYTHONPATH
in every cell).
"""

import json
import os
import re
import shutil
import sys
import tempfile

from snapkernel.kernel import launch

DEFAULT_NAME = "snapshot"
DISPLAY_NAME = "Python (snapshot)"
_NAME = re.compile(r"^[a-zA-Z0-9._-]+$")  # what jupyter_client accepts
_LAUNCH = "from snapkernel.frontends.jupyter.kernel import main; main()"
_LAUNCH_FROM = "import sys; sys.path.insert(0, sys.argv.pop(1)); " + _LAUNCH


def spec(name, config_file=None):
    """The kernel.json of kernelspec `name`."""
    if launch.needs_home():
        argv = launch.command(_LAUNCH_FROM, launch.PACKAGE_HOME)
    else:
        argv = launch.command(_LAUNCH)
    argv.append(f"--SnapshotKernel.spec_name={name}")
    if config_file:
        argv.append(f"--SnapshotKernel.config_file={config_file}")
    return {
        "argv": argv + ["-f", "{connection_file}"],
        "display_name": DISPLAY_NAME if name == DEFAULT_NAME else f"Python (snapshot: {name})",
        "language": "python",
        "interrupt_mode": "message",
        "metadata": {"debugger": False},
    }


def install(name, user=False, prefix=None, config=None):
    """Install kernelspec `name` (for this `user`, under `prefix`, or system-wide) with
    the configuration file `config`; the exit status (2 with a message on bad input)."""
    if not _NAME.match(name):
        print(f"error: --name {name!r}: a kernelspec name has only ASCII letters, "
              f"digits, '.', '_' and '-'", file=sys.stderr)
        return 2
    # Jupyter lowercases the names it installs; the private store is named the same.
    name = name.lower()
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        import ipykernel  # noqa: F401  (the kernel's base class)
    except ImportError as exc:
        print(f"error: {exc.name} is missing: install the jupyter extra "
              f"(pip install 'snapshot-kernel-server[jupyter]', or pip install -e '.[jupyter]' "
              f"in a checkout)", file=sys.stderr)
        return 2
    config_file = None
    if config:
        from snapkernel.kernel import config as config_mod
        config_file = os.path.abspath(config)
        try:
            config_mod.load(config_file)
        except config_mod.ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    import ipykernel.kernelspec
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "kernel.json"), "w") as f:
            json.dump(spec(name, config_file), f, indent=1)
        logos = os.path.join(os.path.dirname(ipykernel.kernelspec.__file__), "resources")
        for logo in ("logo-32x32.png", "logo-64x64.png"):
            if os.path.exists(os.path.join(logos, logo)):
                shutil.copy(os.path.join(logos, logo), folder)
        try:
            path = KernelSpecManager().install_kernel_spec(folder, name, user=user,
                                                           prefix=prefix)
        except OSError as exc:
            print(f"error: cannot install the kernelspec: {exc} (try --user)", file=sys.stderr)
            return 2
    print(f"installed kernelspec {name!r} in {path}")
    return 0
