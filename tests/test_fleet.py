"""A fleet: `snapshot-kernel fleet` (three servers on moto's S3, HAProxy 2.6 in front).

Sessions stay on one server; a server lost (SIGKILL) between cells or during one is a
blip: the next request is served by another from the bucket with the same answer, a cut
cell is retried by api.client with its exec_id and never runs twice once committed; a
rolling restart under load fails no request; a server that lost its cache rejoins;
Plainbook's requests (no key of ours) are served through HAProxy.
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import uuid

import pytest
import requests

from support.fleet import TOKEN, Fleet
from support.server import ROOT, in_thread, wait_for

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None,
                                reason="HAProxy is not installed (apt-get install haproxy)")


@pytest.fixture(scope="module")
def fleet(s3, tmp_path_factory):
    """Three servers on one bucket (sync), HAProxy in front."""
    root = tmp_path_factory.mktemp("fleet")
    config = root / "shared.toml"
    # No warm zygote: three servers starting one each would cost this 2-core machine more
    # than the tests' cells (numpy is imported by the cells that need it).
    config.write_text(s3.config(s3.bucket(), extra="") + "[workers]\nwarm_zygote = false\n")
    running = Fleet(root / "data", config)
    yield running
    running.stop()


def spread_keys(fleet, count=8):
    """Sessions' keys and the server each one's first cell was served by."""
    found = {}
    for n in range(count):
        client = fleet.client(f"session-{n}-{uuid.uuid4().hex[:6]}")
        client.execute("x = 1", uuid.uuid4().hex, "initial")
        found[client.affinity] = client.server
    return found


def test_health_names_the_server_and_every_answer_carries_it(fleet):
    r = requests.get(fleet.url + "/health", timeout=10)
    assert r.json()["status"] == "ok"
    assert r.json()["server"]["id"] in fleet.ports
    assert r.headers["X-Snapshot-Server"] == r.json()["server"]["id"]
    for url in ("/no-such-route", "/states/no-such-state"):
        r = requests.get(fleet.url + url, params={"token": TOKEN}, timeout=10)
        assert r.status_code == 404 and r.headers["X-Snapshot-Server"] in fleet.ports


def test_a_session_stays_on_its_server_and_sessions_spread(fleet):
    client = fleet.client("one-session")
    state, seen = "initial", set()
    for n in range(5):
        state = client.execute(f"n{n} = {n}", uuid.uuid4().hex, state)["state_name"]
        seen.add(client.server)
    assert len(seen) == 1
    assert len(set(spread_keys(fleet).values())) > 1


def test_a_server_lost_between_cells(fleet):
    """SIGKILL the session's server: the next cell is served by another, from the bucket,
    with what the lost one would have answered (values, hashes, the random generator)."""
    client = fleet.client("between-" + uuid.uuid4().hex[:6])
    first = client.execute("import random\nrandom.seed(7)\ndata = list(range(1000))",
                           uuid.uuid4().hex, "initial")["state_name"]
    lost = client.server
    hashes = client.call("POST", "/symbol_hashes", {"state_name": first,
                                                    "symbols": ["data", "random"]})
    fleet.kill(lost)
    answer = client.execute("random.random(), sum(data)", uuid.uuid4().hex, first)
    assert client.server != lost
    random.seed(7)
    assert answer["output"][0]["data"]["text/plain"] == repr((random.random(), 499500))
    assert client.call("POST", "/symbol_hashes", {"state_name": first,
                                                  "symbols": ["data", "random"]}) == hashes


def test_a_cell_committed_then_cut_is_answered_from_the_store(fleet, tmp_path):
    """The same /execute sent again (its answer lost with its server) after the state was
    committed: another server answers it from the bucket; the cell ran once."""
    log = tmp_path / "ran.txt"
    client = fleet.client("committed-" + uuid.uuid4().hex[:6])
    code = f"with open({str(log)!r}, 'a') as f:\n    f.write('ran\\n')\nk = 5\nprint('done')"
    exec_id = uuid.uuid4().hex
    answer = client.execute(code, exec_id, "initial")
    fleet.kill(client.server)
    again = client.execute(code, exec_id, "initial")
    assert again == answer
    assert log.read_text() == "ran\n"
    assert client.execute("k * 2", uuid.uuid4().hex, again["state_name"])[
        "output"][0]["data"]["text/plain"] == "10"


def test_a_cell_cut_before_its_commit_is_run_by_the_retry(fleet, tmp_path):
    """SIGKILL the server while the cell runs: api.client sends it again with its exec_id,
    another server runs it (nothing was committed), and its state is kept."""
    log = tmp_path / "ran.txt"
    client = fleet.client("cut-" + uuid.uuid4().hex[:6])
    client.execute("pass", uuid.uuid4().hex, "initial")
    serving = client.server
    # The first run waits to be killed; the retry, finding the line, goes on.
    code = (f"import time\nwith open({str(log)!r}, 'a') as f:\n    f.write('ran\\n')\n"
            f"if open({str(log)!r}).read().count('ran') == 1:\n    time.sleep(120)\nv = 3")
    running = in_thread(client.execute, code, uuid.uuid4().hex, "initial")
    wait_for(lambda: log.exists() and log.read_text() == "ran\n", "the cell to start")
    fleet.kill(serving)
    answer = running.result(120)
    assert answer["error"] is None and answer["state_name"]
    assert log.read_text() == "ran\nran\n"
    assert client.execute("v", uuid.uuid4().hex, answer["state_name"])[
        "output"][0]["data"]["text/plain"] == "3"


def test_a_server_that_lost_its_cache_rejoins_from_the_bucket(fleet):
    client = fleet.client("cache-" + uuid.uuid4().hex[:6])
    state = client.execute("import numpy as np\nbig = np.arange(300_000)", uuid.uuid4().hex,
                           "initial")["state_name"]
    name = client.server
    fleet.proc.send_signal(signal.SIGSTOP)  # no restart while its disk goes
    try:
        pid = fleet.kill(name)
        wait_for(lambda: not os.path.exists(f"/proc/{pid}/stat") or
                 open(f"/proc/{pid}/stat").read().split()[2] == "Z", "the server to die")
        shutil.rmtree(fleet.root / name)
    finally:
        fleet.proc.send_signal(signal.SIGCONT)
    fleet.wait_back(name, pid)
    direct = fleet.direct(name)
    assert direct.execute("int(big.sum())", uuid.uuid4().hex, state)[
        "output"][0]["data"]["text/plain"] == str(sum(range(300_000)))


def test_a_rolling_restart_under_load(fleet):
    """Each server SIGTERMed (drained, started again) in turn while three sessions run
    chained cells: no request fails, every session's count is its cells'."""
    stop = threading.Event()

    def session(n):
        client = fleet.client(f"rolling-{n}-{uuid.uuid4().hex[:6]}")
        state = client.execute("count = 0", uuid.uuid4().hex, "initial")["state_name"]
        cells = 0
        while not stop.is_set():
            answer = client.execute("count += 1\ncount", uuid.uuid4().hex, state)
            assert answer["error"] is None, answer["error"]
            state, cells = answer["state_name"], cells + 1
            assert answer["output"][0]["data"]["text/plain"] == str(cells)
        return cells

    runs = [in_thread(session, n) for n in range(3)]
    for name in sorted(fleet.ports):
        pid = fleet.kill(name, signal.SIGTERM)
        fleet.wait_back(name, pid)
    stop.set()
    assert all(run.result(120) > 0 for run in runs)


def test_plainbook_through_haproxy_without_a_key_of_ours(fleet):
    """Plainbook's requests (plainbook 0.6.3's _sk_request: the token in the query, no
    affinity header, a state name per cell, a uuid4 exec_id per run): served, chained and
    kept on one server by the token."""
    fleet.wait_routed()  # the test before restarts every server

    def sk(method, path, body=None):
        r = requests.request(method, fleet.url + path, params={"token": TOKEN}, json=body,
                             timeout=300)
        assert r.status_code == 200, r.text
        return r.headers["X-Snapshot-Server"], r.json()

    names = [uuid.uuid4().hex for _ in range(3)]
    servers = set()
    state = "initial"
    for name, code in zip(names, ["a = [1, 2]", "b = a + [3]", "len(b)"]):
        server, answer = sk("POST", "/execute", {"code": code, "exec_id": uuid.uuid4().hex,
                                                 "state_name": state, "new_state_name": name})
        assert answer["error"] is None
        servers.add(server)
        state = name
    assert answer["output"][0]["data"]["text/plain"] == "3"
    server, hashes = sk("POST", "/symbol_hashes", {"state_name": names[1], "symbols": ["a"]})
    servers.add(server)
    server, rebuilt = sk("POST", "/rebuild_state", {
        "input_state": names[0], "source_state": names[1], "source_vars": ["b"],
        "input_vars": ["a"], "new_state_name": names[2]})
    servers.add(server)
    assert len(servers) == 1 and hashes["hashes"]["a"]


def test_fleet_without_haproxy_says_how_to_install_it(tmp_path):
    r = subprocess.run([sys.executable, "-m", "snapkernel.main", "fleet", "--token", "t",
                        "--data-root", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ, PATH=os.path.dirname(sys.executable)))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "apt-get install haproxy" in r.stderr
