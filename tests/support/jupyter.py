"""The Jupyter kernel under test: a kernelspec installed into a temporary Jupyter data
directory (the `data_dir` fixture, for a whole module: a test module that uses it
imports it from here, with `kernel` and `lab`), kernels of it started with
jupyter_client, and JupyterLab with headless Chromium."""

import json
import os
import shutil
import signal
import subprocess
import sys

import nbformat
import psutil
import pytest
import requests

from support.server import ROOT, free_port, wait_for

pytest.importorskip("ipykernel")
jupyter_client = pytest.importorskip("jupyter_client")


SPEC = "snapshot-test"


IDLE_S = 3.0  # jupyter.server_idle_s of the test kernelspec


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A Jupyter data directory with the test kernelspec installed (for the whole module)."""
    path = tmp_path_factory.mktemp("jupyter-data")
    config = path / "kernel-config.toml"
    config.write_text(f"[jupyter]\nserver_idle_s = {IDLE_S}\n"
                      # A loaded machine must not turn a slow completion into none.
                      "introspect_timeout_s = 60.0\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_DATA_DIR", str(path))
        done = subprocess.run([sys.executable, "main.py", "install-kernelspec", "--user",
                               "--name", SPEC, "--config", str(config)],
                              cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        yield path
        stop_server(path)


def private_folder(data_dir):
    """The test kernelspec's store, sessions and server.json."""
    return data_dir / "snapshot-kernel" / SPEC


def server_info(data_dir):
    """server.json of the running server, or None."""
    try:
        return json.loads((private_folder(data_dir) / "server.json").read_text())
    except FileNotFoundError:
        return None


def stop_server(data_dir):
    """SIGTERM the supervisor of the kernelspec's server and wait until both are gone."""
    info = server_info(data_dir)
    if info is None or not psutil.pid_exists(info["pid"]):
        return
    processes = [psutil.Process(info["pid"])]
    processes += processes[0].children(recursive=True)
    processes[0].send_signal(signal.SIGTERM)
    psutil.wait_procs(processes, timeout=60)


def jupyter_env(extra=None):
    """This process's environment as a Jupyter front end gives it to a kernel, with
    `extra`: without the MPLBACKEND a test run may set (the loaded series export Agg,
    a headless shell often does), so that ipykernel draws with its own inline backend."""
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    return {**env, **(extra or {})}


class Kernel:
    """A kernel of the test kernelspec, started by jupyter_client, and a blocking client."""

    def __init__(self, env=None, cwd=None, spec=SPEC):
        """Start the kernel (of kernelspec `spec`: ipykernel's is "python3") and wait
        until it answers."""
        self.manager = jupyter_client.KernelManager(kernel_name=spec)
        self.manager.start_kernel(env=jupyter_env(env), cwd=cwd or ROOT)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def run(self, code, timeout=120):
        """Execute `code`: (the execute_reply content, its outputs as iopub contents)."""
        outputs = []

        def hook(msg):
            """Keep the cell's outputs."""
            if msg["msg_type"] in ("stream", "display_data", "update_display_data",
                                   "execute_result", "error", "clear_output"):
                outputs.append(dict(msg["content"], msg_type=msg["msg_type"]))

        reply = self.client.execute_interactive(code, output_hook=hook, timeout=timeout)
        return reply["content"], outputs

    def value(self, expr):
        """The text/plain of `expr` in the session's head."""
        content, outputs = self.run(expr)
        assert content["status"] == "ok", content
        results = [o for o in outputs if o["msg_type"] == "execute_result"]
        return results[-1]["data"]["text/plain"]

    def text(self, code):
        """The stdout of a successful cell."""
        content, outputs = self.run(code)
        assert content["status"] == "ok", content
        return "".join(o["text"] for o in outputs if o["msg_type"] == "stream")

    def restart(self):
        """Restart the kernel process (a new process; the same connection file)."""
        pid = self.manager.provisioner.process.pid
        self.manager.restart_kernel(now=False)
        self.client.wait_for_ready(timeout=120)
        assert self.manager.provisioner.process.pid != pid

    def stop(self):
        """Shut the kernel down."""
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)


@pytest.fixture
def kernel(data_dir):
    """A running kernel of the test kernelspec (shut down after the test)."""
    k = Kernel()
    yield k
    k.stop()


class Lab:
    """JupyterLab serving a temporary folder, and headless Chromium on it (the `lab`
    fixture): notebooks of the test kernelspec opened, cells typed and run as a user
    would."""

    def __init__(self, tmp_path):
        """Start JupyterLab and the browser (skips when either is missing)."""
        pytest.importorskip("jupyterlab")
        webdriver = pytest.importorskip("selenium.webdriver")
        from selenium.webdriver.chrome.service import Service
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys
        self.By, self.Keys = By, Keys
        chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
        if not (chromium and driver):
            pytest.skip("Debian's chromium and chromium-driver are not installed "
                        "(.ci/run does it)")
        self.tmp_path = tmp_path
        self.root = tmp_path / "notebooks"
        self.root.mkdir()
        self.port, self.token = free_port(), "lab-token"
        self.log = open(tmp_path / "jupyterlab.log", "wb")
        self.browser = None
        self.lab = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
             "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
             "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
             f"--ServerApp.root_dir={self.root}"],
            env=jupyter_env({"JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
                             "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}),
            stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL)
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                    "--disable-gpu", "--window-size=1400,900"):
            options.add_argument(arg)
        wait_for(lambda: self.lab.poll() is None and _answers(
            f"http://127.0.0.1:{self.port}/api/status?token={self.token}"),
            what="JupyterLab to start")
        self.browser = webdriver.Chrome(service=Service(driver), options=options)

    def open(self, name):
        """Make an empty notebook `name` of the test kernelspec, open it, wait for its
        kernel."""
        nb = nbformat.v4.new_notebook()
        nb.metadata.kernelspec = {"name": SPEC, "display_name": f"Python (snapshot: {SPEC})",
                                  "language": "python"}
        nb.cells = [nbformat.v4.new_code_cell("")]
        nbformat.write(nb, self.root / name)
        self.browser.get(f"http://127.0.0.1:{self.port}/lab/tree/{name}?token={self.token}")
        wait_for(self.idle, timeout=120, what="the notebook's kernel to be idle")

    def kernel_pids(self):
        """The pids of JupyterLab's running snapshot kernels."""
        pids = set()
        for p in psutil.Process(self.lab.pid).children():
            try:
                if "snapkernel.frontends.jupyter.kernel" in " ".join(p.cmdline()):
                    pids.add(p.pid)
            except psutil.NoSuchProcess:
                continue  # exited since it was listed: not a running kernel
        return pids

    def idle(self):
        """True when the status bar shows the notebook's snapshot kernel idle."""
        return self.browser.execute_script(
            "return Array.from(document.querySelectorAll('.jp-StatusBar-TextItem'))"
            ".some(e => e.textContent === arguments[0])", f"Python (snapshot: {SPEC}) | Idle")

    def run_in_last_cell(self, code):
        """Type `code` into the notebook's last cell and run it (Shift+Enter)."""
        editor = self.browser.find_elements(self.By.CSS_SELECTOR,
                                            ".jp-Notebook .jp-Cell .cm-content")[-1]
        editor.click()
        for i, line in enumerate(code.split("\n")):
            editor.send_keys(*([self.Keys.ENTER] if i else []), line)
        editor.send_keys(self.Keys.SHIFT, self.Keys.ENTER)

    def outputs(self):
        """The texts of the output areas on the page."""
        return [e.text for e in self.browser.find_elements(self.By.CSS_SELECTOR,
                                                           ".jp-OutputArea-output")]

    def close(self):
        """Keep a screenshot and the page; stop the browser and JupyterLab."""
        if self.browser is not None:
            self.browser.save_screenshot(str(self.tmp_path / "jupyterlab.png"))
            (self.tmp_path / "jupyterlab.html").write_text(self.browser.page_source)
            self.browser.quit()
        self.lab.terminate()
        try:
            self.lab.wait(30)
        except subprocess.TimeoutExpired:
            self.lab.kill()  # seen once: JupyterLab did not stop on SIGTERM
            self.lab.wait()
        self.log.close()


@pytest.fixture
def lab(data_dir, tmp_path):
    """JupyterLab and headless Chromium (a Lab), stopped after the test."""
    started = None
    try:
        started = Lab(tmp_path)
        yield started
    finally:
        if started is not None:
            started.close()


def _answers(url):
    """True when `url` answers 200."""
    try:
        return requests.get(url, timeout=5).ok
    except requests.ConnectionError:
        return False
