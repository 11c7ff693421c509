"""The command line: token sources, refusals, quiet output, the bottle form."""

import os
import signal
import subprocess
import sys

import psutil
import requests

from support.server import ROOT, free_port, wait_for


def start(args, env=None):
    """Start main.py (or another module) with piped output."""
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, **(env or {})))


def wait_health(url, proc, timeout=60):
    """Wait for /health, failing at once if the process exits."""
    def up():
        """/health's answer, or None while nothing listens."""
        assert proc.poll() is None, proc.stderr.read().decode()
        try:
            return requests.get(url + "/health", timeout=5).json()
        except requests.ConnectionError:  # not listening yet
            return None
    assert wait_for(up, "the server to answer /health", timeout)["status"] == "ok"


def served_cell(args, code, env=None):
    """Serve with `main.py --bind ... --token t ARGS` (in `env`), run `code` from
    `initial` once it answers, stop it: the cell's answer."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(["main.py", "--bind", f"127.0.0.1:{port}", "--token", "t", *args], env)
    try:
        wait_health(url, proc)
        return requests.post(url + "/execute", params={"token": "t"}, timeout=60,
                             json={"code": code, "exec_id": "c", "state_name": "initial"}).json()
    finally:
        stop(proc)


def stop(proc):
    """SIGTERM and wait; returns (stdout, stderr)."""
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    return out.decode(), err.decode()


def test_refuses_to_start_without_token(tmp_path):
    env = {"SNAPSHOT_KERNEL_TOKEN": ""}
    proc = start(["main.py", "--bind", f"127.0.0.1:{free_port()}",
                  "--data-dir", str(tmp_path)], env)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "no token" in err.decode()
    proc = start(["main.py", "--bind", f"0.0.0.0:{free_port()}", "--no-auth",
                  "--data-dir", str(tmp_path)], env)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "loopback" in err.decode()
    assert "Traceback" not in err.decode()


def test_bad_bind_and_config_are_clear_errors(tmp_path):
    proc = start(["main.py", "--bind", "nonsense", "--token", "t"])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "HOST:PORT" in err.decode()
    bad = tmp_path / "bad.toml"
    bad.write_text("[workers]\nmax_live_states = 'many'\n")
    proc = start(["main.py", "--token", "t", "--config", str(bad)])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "max_live_states" in err.decode()
    assert "Traceback" not in err.decode()
    bad.write_text("[workers]\nspare_after_quiet_s = -1\n")
    proc = start(["main.py", "--token", "t", "--config", str(bad)])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "spare_after_quiet_s must be 0 or more" in err.decode()
    assert "Traceback" not in err.decode()


def test_token_from_environment_and_quiet_output(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(["main.py", "--bind", f"127.0.0.1:{port}", "--data-dir", str(tmp_path)],
                 {"SNAPSHOT_KERNEL_TOKEN": "from-env"})
    try:
        wait_health(url, proc)
        r = requests.get(url + "/states", timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized"
        r = requests.post(url + "/execute", params={"token": "from-env"}, timeout=60,
                          json={"code": "print('hi')", "exec_id": "q", "state_name": "initial"})
        assert r.json()["output"][0]["text"] == "hi\n"
    finally:
        out, err = stop(proc)
    # Nothing on the pipes: a client that never reads them cannot block the server.
    assert out == "" and err == ""


def test_no_auth_on_loopback(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(["main.py", "--bind", f"127.0.0.1:{port}", "--no-auth",
                  "--data-dir", str(tmp_path)], {"SNAPSHOT_KERNEL_TOKEN": ""})
    try:
        wait_health(url, proc)
        assert requests.get(url + "/states", timeout=10).json() == {"states": ["initial"]}
    finally:
        stop(proc)


def test_bottle_command_line_form(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(["-m", "bottle", "--server", "cheroot", "--bind", f"127.0.0.1:{port}",
                  "--param", "token=bottle-token", "--param", f"data_dir={tmp_path}",
                  "main:app"])
    try:
        wait_health(url, proc)
        r = requests.get(url + "/states", timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized"
        r = requests.post(url + "/execute", params={"token": "bottle-token"}, timeout=60,
                          json={"code": "6 * 7", "exec_id": "b", "state_name": "initial"})
        assert r.json()["output"][0]["data"]["text/plain"] == "42"
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert workers
    finally:
        stop(proc)
    _, alive = psutil.wait_procs(workers, timeout=60)
    assert not alive, [p.pid for p in alive]


def test_default_store_is_in_the_users_data_folder(tmp_path):
    """Without --data-dir or a configured data_dir the store is
    $XDG_DATA_HOME/snapshot-kernel/store, whatever the working directory."""
    answer = served_cell([], "x = 1", {"XDG_DATA_HOME": str(tmp_path / "xdg")})
    assert answer["error"] is None and answer["state_name"]
    assert (tmp_path / "xdg" / "snapshot-kernel" / "store" / "data.mdb").exists()


def test_relative_paths_of_a_config_file_are_relative_to_its_folder(tmp_path):
    """data_dir and log_file given relative in --config land beside that file, not in
    the server's working directory (the checkout here)."""
    folder = tmp_path / "conf"
    folder.mkdir()
    config = folder / "server.toml"
    config.write_text('[server]\ndata_dir = "my-store"\nlog_file = "logs.txt"\n')
    answer = served_cell(["--config", str(config)], "y = 2")
    assert answer["error"] is None and answer["state_name"]
    assert (folder / "my-store" / "data.mdb").exists()
    assert (folder / "logs.txt").exists()
    assert not os.path.exists(os.path.join(ROOT, "my-store"))
