"""Exposure: the token on every route, constant-time and unlogged; binds; TLS; slow clients."""

import inspect
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest
import requests

from api import routes
from conftest import ROOT, Server, free_port

SECRET = "s3cret-token-that-must-never-be-logged"


def test_every_route_but_health_needs_the_token(server):
    doc = server.get("/openapi.json").json()
    checked = 0
    for path, operations in doc["paths"].items():
        url = server.url + path.replace("{name}", "initial")
        for method in operations:
            if path == "/health":
                assert requests.request(method, url, timeout=10).status_code == 200
                continue
            for params, headers in [({}, {}), ({"token": "wrong"}, {}),
                                    ({"token": server.token + "x"}, {}),
                                    ({"token": ""}, {}),
                                    ({}, {"Authorization": "Bearer wrong"}),
                                    ({}, {"Authorization": f"Basic {server.token}"}),
                                    ({}, {"Authorization": f"Bearer {server.token[:-1]}"})]:
                r = requests.request(method, url, params=params, headers=headers, timeout=10)
                assert r.status_code == 401, (method, path, params, headers, r.text)
                assert r.json()["error"]["type"] == "Unauthorized"
            checked += 1
    assert checked == 15
    # Nothing was done by the refused requests.
    assert server.get("/states").json()["states"] == ["initial"]


def test_token_is_compared_in_constant_time():
    source = inspect.getsource(routes._token_ok)
    assert "hmac.compare_digest" in source
    assert "== expected" not in source and "expected ==" not in source


def test_token_never_logged_nor_given_to_cells(make_server, tmp_path, monkeypatch):
    log_file = tmp_path / "server.log"
    monkeypatch.setenv("SNAPSHOT_KERNEL_TOKEN", SECRET)
    srv = make_server(token=None, extra_args=["--verbose"], config=(
        f'[server]\nlog_file = "{log_file}"\n[workers]\nmax_live_states = 1\n'))
    srv.token = SECRET
    srv.execute("x = 1", new="log-a")
    srv.execute("y = 2", new="log-b")  # evicts log-a (a log line)
    srv.execute("raise ValueError('boom')", ok=False)
    assert srv.post("/execute", {"code": "1"}).status_code == 400
    near_miss = SECRET[:-1] + "X"
    assert requests.get(srv.url + "/states", params={"token": near_miss},
                        timeout=10).status_code == 401
    assert requests.get(srv.url + "/states", headers={"Authorization": f"Bearer {near_miss}"},
                        timeout=10).status_code == 401
    # Cells cannot read the token from their environment.
    answer = srv.execute("import os\n[k for k, v in os.environ.items() if "
                         f"{SECRET!r} in v]", state="log-b")
    assert answer["output"][-1]["data"]["text/plain"] == "[]"
    workers = psutil.Process(srv.proc.pid).children(recursive=True)
    assert workers
    for worker in workers:
        try:
            assert SECRET not in " ".join(worker.cmdline())
            assert SECRET not in str(worker.environ())
        except psutil.NoSuchProcess:
            pass  # a spare that was replaced meanwhile
    srv.stop()
    logged = log_file.read_text() + open(srv.data_dir + "-server.log").read()
    assert "evicting" in logged  # the log really was written
    assert SECRET not in logged and near_miss not in logged


def start(args, env_token=None, wait=10):
    """Run main.py with `args`; (exit code or None if still running, output)."""
    env = {k: v for k, v in os.environ.items() if k != "SNAPSHOT_KERNEL_TOKEN"}
    if env_token:
        env["SNAPSHOT_KERNEL_TOKEN"] = env_token
    proc = subprocess.Popen([sys.executable, "main.py", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=wait)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        return None, out


def test_refuses_a_network_bind_without_a_token(tmp_path):
    port = free_port()
    for bind in (f"0.0.0.0:{port}", f"[::]:{port}", f"192.0.2.1:{port}"):
        code, out = start(["--bind", bind, "--no-auth", "--data-dir", str(tmp_path / "d")])
        assert code not in (0, None) and "no token" in out, (bind, out)
    code, out = start(["--bind", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "d")])
    assert code not in (0, None) and "no token" in out
    code, out = start(["--bind", f"0.0.0.0:{port}", "--token", "",
                       "--data-dir", str(tmp_path / "d")])
    assert code not in (0, None) and "no token" in out
    # Loopback without a token is allowed, but only when asked for.
    code, _ = start(["--bind", f"127.0.0.1:{port}", "--no-auth",
                     "--data-dir", str(tmp_path / "d")], wait=3)
    assert code is None


class TlsServer(Server):
    """A server over TLS with a self-signed certificate, trusted by this client only."""

    def __init__(self, data_dir, cafile, config):
        """Start it with certfile/keyfile in its config."""
        self.cafile = cafile
        super().__init__(data_dir, config=config)

    def wait_up(self, timeout=30):
        """Wait until /health answers over HTTPS."""
        self.url = self.url.replace("http://", "https://")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, open(self.data_dir + "-server.log").read()
            try:
                if requests.get(self.url + "/health", timeout=1, verify=self.cafile).ok:
                    return
            except requests.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("server did not come up")

    def request(self, method, path, **kw):
        """An authenticated request that trusts the test certificate."""
        kw.setdefault("verify", self.cafile)
        return super().request(method, path, **kw)


def test_tls_with_a_self_signed_certificate(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    srv = TlsServer(tmp_path / "data", str(cert),
                    f'[server]\ncertfile = "{cert}"\nkeyfile = "{key}"\n')
    try:
        srv.execute("secret_value = 41", new="tls")
        assert srv.value("tls", "secret_value + 1") == "42"
        # Connections that never start their handshake stall nobody.
        held = hold(srv.port, 20)
        start = time.monotonic()
        assert srv.value("tls", "secret_value") == "41"
        assert time.monotonic() - start < 1.5
        for sock in held:
            sock.close()
        assert requests.get(srv.url + "/states", verify=str(cert), timeout=10).status_code == 401
        # A client that does not trust the certificate refuses it.
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(srv.url + "/health", timeout=10)
        # Plain HTTP on the TLS port gets no answer from the API.
        plain = srv.url.replace("https://", "http://")
        try:
            r = requests.get(plain + "/states", params={"token": srv.token}, timeout=10)
            assert r.status_code == 400 and "states" not in r.text
        except requests.ConnectionError:
            pass
    finally:
        srv.stop()


def hold(port, count, data=b""):
    """`count` connections to the server, each having sent `data` (and nothing more)."""
    held = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        if data:
            sock.sendall(data)
        held.append(sock)
    return held


def timed_execute(srv):
    """Seconds an execute takes to be answered, checking its answer."""
    start = time.monotonic()
    answer = srv.execute("ready + 1", state="slow")
    assert answer["output"][-1]["data"]["text/plain"] == "2"
    return time.monotonic() - start


def test_idle_and_slow_clients_cannot_hold_every_thread(make_server):
    srv = make_server(config="[server]\nserver_threads = 4\nsocket_timeout_s = 1\n")
    srv.execute("ready = 1", new="slow")
    # Idle connections (connected, nothing sent) wait in the selector: no thread at all.
    held = hold(srv.port, 24)
    try:
        time.sleep(0.3)
        took = timed_execute(srv)
        print(f"execute beside 24 idle connections and 4 threads: {took:.2f} s")
        assert took < 1.5, took
    finally:
        for sock in held:
            sock.close()
    # Half-sent requests hold a thread each, but only for socket_timeout_s: 12 of them
    # (3 waves of 4 threads) delay an execute by a few timeouts, never forever.
    held = hold(srv.port, 6, b"GET /states HTTP/1.1\r\nHost: x\r\n")
    held += hold(srv.port, 6, b"POST /execute HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Length: 1000\r\n\r\n{")
    try:
        time.sleep(0.3)
        took = timed_execute(srv)
        print(f"execute beside 12 half-sent requests and 4 threads: {took:.2f} s")
        assert took < 3 * 1 + 4, took
        assert requests.get(srv.url + "/health", timeout=10).ok
    finally:
        for sock in held:
            sock.close()
