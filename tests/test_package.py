"""The package as a user gets it: a wheel built from this checkout (`python -m build`),
installed with its jupyter extra in a new virtual environment, and its `snapshot-kernel`
command run from folders that are not the checkout.

HOME (and the Jupyter data directory) point into a temporary folder, so nothing touches
the real home; pip alone keeps the real HOME, for its cache. Dependencies come from the
package index pip is configured with.
"""

import json
import os
import signal
import subprocess
import sys

import nbformat
import psutil
import pytest

import harness
from snapkernel.kernel import __version__
from support.server import ROOT

pytestmark = pytest.mark.slow  # a build, a new virtual environment and an install

# Variables of this process that must not reach the installed package's commands: they
# would point it at the checkout or at the real home's data.
_DROPPED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "SNAPSHOT_KERNEL_TOKEN",
            "SNAPSHOT_KERNEL_URL", "XDG_DATA_HOME", "JUPYTER_DATA_DIR", "JUPYTER_CONFIG_DIR",
            "JUPYTER_PATH", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR", "MPLCONFIGDIR")

# A notebook folder's own modules named like ours: the installed command, its zygote and
# the Jupyter kernel and server must import the package, never these (python -P).
_DECOYS = {f"{name}.py": f"raise ImportError('the notebook folder {name}.py was imported')\n"
           for name in ("main", "api", "config", "protocol", "server", "worker", "launch")}
_DECOYS.update({f"{name}/__init__.py":
                f"raise ImportError('the notebook folder {name}/ was imported')\n"
                for name in ("kernel", "storage")})
# ...while a cell imports the modules beside its notebook, as in Jupyter.
_DECOYS["helper.py"] = "VALUE = 7\n"


class Installed:
    """The wheel installed in a new virtual environment, and a temporary home."""

    def __init__(self, root):
        """Build, make the environment, install (the whole cost of the module)."""
        self.root = root
        dist = root / "dist"
        built = subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), ROOT],
                               capture_output=True, text=True, timeout=600)
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
        wheels = sorted(dist.glob("*.whl"))
        assert [w.name for w in wheels] == [
            f"snapshot_kernel_server-{__version__}-py3-none-any.whl"]
        self.wheel = wheels[0]
        self.venv = root / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True,
                       timeout=300)
        self.bin = self.venv / "bin"
        pip_env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
        # --no-compile: the cells import a fraction of what is installed; bytecode
        # for the rest would cost more than the install itself.
        done = subprocess.run([str(self.bin / "python"), "-m", "pip", "install", "-q",
                               "--no-compile", f"{self.wheel}[jupyter]"],
                              env=pip_env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        self.home = root / "home"
        self.home.mkdir()
        self.env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
        self.env.update(HOME=str(self.home), PATH=f"{self.bin}{os.pathsep}{os.environ['PATH']}")

    def command(self, *args, cwd, env=None, timeout=300):
        """Run `snapshot-kernel ARGS` in `cwd`; the CompletedProcess (text)."""
        return subprocess.run([str(self.bin / "snapshot-kernel"), *map(str, args)], cwd=cwd,
                              env=dict(self.env, **(env or {})), capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=timeout)

    def default_store(self):
        """Where the store goes when none is configured (~/.local/share/...)."""
        return self.home / ".local" / "share" / "snapshot-kernel" / "store"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The installed package (built and installed once for the module)."""
    return Installed(tmp_path_factory.mktemp("package"))


def decoy_folder(path):
    """A notebook folder holding modules named like ours, and a helper module."""
    for name, text in _DECOYS.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def test_the_wheel_holds_the_package_and_its_defaults(installed):
    """What the wheel installs: the one package `snapkernel` with config.toml (every
    comment of the checkout's), the console command; nothing of the checkout is used."""
    site = subprocess.run([str(installed.bin / "python"), "-P", "-c",
                           "import snapkernel.kernel as k, sysconfig; print(k.__file__); "
                           "print(k.__version__); print(sysconfig.get_path('purelib'))"],
                          cwd=installed.root, env=installed.env, capture_output=True,
                          text=True, check=True).stdout.split("\n")
    assert site[0] == os.path.join(site[2], "snapkernel", "kernel", "__init__.py")
    assert site[1] == __version__
    shipped = os.path.join(site[2], "snapkernel", "config.toml")
    with open(shipped) as f, open(os.path.join(ROOT, "config.toml")) as g:
        assert f.read() == g.read()
    top = json.loads(subprocess.run(
        [str(installed.bin / "python"), "-c",
         "import importlib.metadata as m, json; d = m.distribution('snapshot-kernel-server'); "
         "print(json.dumps([d.read_text('top_level.txt').split(), "
         "[e.value for e in d.entry_points if e.name == 'snapshot-kernel']]))"],
        env=installed.env, capture_output=True, text=True, check=True).stdout)
    assert top[0] == ["snapkernel"]
    assert top[1] == ["snapkernel.main:main"]


def test_the_command_serves_runs_and_installs_the_kernelspec(installed, tmp_path):
    """From an empty folder the server starts on the default store in the home's data
    folder and answers; `run` runs a notebook among look-alike modules; the kernelspec
    installs and its kernel runs a cell through a server it starts itself."""
    empty = tmp_path / "empty"
    empty.mkdir()
    port = harness.free_port()
    server = harness.ServerProcess(
        [str(installed.bin / "snapshot-kernel"), "--bind", f"127.0.0.1:{port}"], port,
        str(tmp_path / "server.log"), cwd=str(empty), env=dict(installed.env,
                                                               SNAPSHOT_KERNEL_TOKEN="tok"),
        token="tok")
    try:
        answer = server.call("POST", "/execute", {
            "code": "import os\nprint(os.getcwd(), os.environ.get('PYTHONPATH'))\n6 * 7",
            "exec_id": "p1", "state_name": "initial", "new_state_name": "answered"})
        assert answer["error"] is None, answer["error"]
        # Cells work where the server was started; an installed package needs no
        # PYTHONPATH, so the programs cells start see the user's own (none here).
        assert answer["output"][0]["text"] == f"{empty} None\n"
        assert answer["output"][1]["data"]["text/plain"] == "42"
        assert server.call("GET", "/openapi.json")["info"]["version"] == __version__
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log_tail()
    assert (installed.default_store() / "data.mdb").exists()
    assert list(empty.iterdir()) == []  # nothing written where it was started

    # `run` on the same default store, now free, in a folder of look-alike modules.
    folder = decoy_folder(tmp_path / "notebook")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("import helper\nhelper.VALUE * 6"),
                      nbformat.v4.new_code_cell("print('ran')")]
    nbformat.write(notebook, str(folder / "nb.ipynb"))
    ran = installed.command("run", "nb.ipynb", cwd=folder)
    assert ran.returncode == 0, ran.stderr
    cells = nbformat.read(str(folder / "nb.ipynb"), as_version=4).cells
    assert cells[0].outputs[0]["data"]["text/plain"] == "42"
    assert cells[1].outputs[0]["text"] == "ran\n"

    # The kernelspec, into a Jupyter data directory of the temporary home.
    jupyter = {"JUPYTER_DATA_DIR": str(tmp_path / "jupyter")}
    done = installed.command("install-kernelspec", "--user", cwd=empty, env=jupyter)
    assert done.returncode == 0, done.stderr
    spec = json.loads((tmp_path / "jupyter" / "kernels" / "snapshot" / "kernel.json")
                      .read_text())
    assert spec["argv"][:2] == [str(installed.bin / "python"), "-P"]
    assert not any(ROOT in arg for arg in spec["argv"])  # an installed package needs no path
    try:
        outputs = run_in_kernel(installed, folder, jupyter,
                                "import os\nprint(6 * 7, os.getcwd())")
        assert outputs == [f"42 {folder}\n"]
    finally:
        stop_kernel_server(tmp_path / "jupyter")


# Run in the installed environment: start the kernel of kernelspec "snapshot" in a
# folder, execute one cell, print the stream texts it sent as JSON, shut the kernel down.
_KERNEL_CLIENT = r"""
import json, sys
from jupyter_client.manager import start_new_kernel
km, kc = start_new_kernel(kernel_name="snapshot", cwd=sys.argv[2], startup_timeout=120)
texts = []
try:
    reply = kc.execute_interactive(
        sys.argv[1], timeout=120,
        output_hook=lambda msg: texts.append(msg["content"]["text"])
        if msg["msg_type"] == "stream" else None)
    assert reply["content"]["status"] == "ok", reply["content"]
finally:
    kc.stop_channels()
    km.shutdown_kernel(now=True)
print(json.dumps(texts))
"""


def run_in_kernel(installed, folder, env, code):
    """The stream texts of `code` run by the installed kernelspec's kernel in `folder`."""
    done = subprocess.run([str(installed.bin / "python"), "-c", _KERNEL_CLIENT, code,
                           str(folder)], cwd=installed.root, env=dict(installed.env, **env),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def stop_kernel_server(jupyter_data):
    """Stop the server the kernel started (its supervisor, named in server.json)."""
    info = jupyter_data / "snapshot-kernel" / "snapshot" / "server.json"
    if not info.exists():
        return
    pid = json.loads(info.read_text())["pid"]
    if not psutil.pid_exists(pid):
        return
    processes = [psutil.Process(pid)]
    processes += processes[0].children(recursive=True)
    processes[0].send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(processes, timeout=60)
    for proc in alive:
        proc.kill()
    assert not alive, alive
