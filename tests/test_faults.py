"""Cell faults and server faults: crashes, limits, leftovers, SIGKILL of the server.

Every fault must leave the server answering and every other state intact.
The limits run on a server of their own (`limited`); the 5-round version of
scripts/faults.py runs at the end.
"""

import subprocess
import sys

import psutil
import pytest

import harness
from support.server import ROOT, Server, in_thread, wait_for

LIMITS = """
[limits]
max_cell_memory_mb = 256
cell_timeout_s = 3
max_cell_processes = 8
[workers]
max_live_states = 3
# Every state gets its holder, so that a cell's writes to its state copy pages (the
# watchdog's case); in a chain step they would change the only copy, costing nothing.
hold_chain_steps = true
"""


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """A server with every cell limit on and a small LRU."""
    srv = Server(tmp_path_factory.mktemp("limited") / "data", config=LIMITS)
    yield srv
    srv.stop()


def states(srv):
    """The set of state names."""
    return set(srv.get("/states").json()["states"])


def intact(srv, before):
    """The server answers, no state appeared or vanished, the kept values are right."""
    assert srv.get("/health").json()["status"] == "ok"
    assert states(srv) == before
    assert srv.value("f-keep", "kept, len(big)") == "([1, 2, 3], 100000)"
    assert srv.value("f-other", "other") == "'untouched'"


def make_kept(srv):
    """A state the faults run from and a sibling they must not disturb."""
    srv.execute("kept = [1, 2, 3]\nbig = list(range(100000))", new="f-keep")
    srv.execute("other = 'untouched'", new="f-other")
    return states(srv)


def wait_gone(pids, what):
    """Wait until no process of `pids` is alive (zombies count as gone)."""
    wait_for(lambda: not [p for p in pids if harness.alive(p)], what)


def processes_named(marker):
    """Pids of processes whose command line contains `marker`."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if marker in " ".join(p.info["cmdline"] or []):
            found.append(p.pid)
    return found


@pytest.mark.parametrize("code, ename, detail", [
    ("import ctypes\nctypes.string_at(0)", "WorkerDied", "SIGSEGV"),
    ("import os\nos._exit(3)", "WorkerDied", "code 3"),
    ("x = bytearray(1 << 44)", "MemoryError", ""),
    ("x = [0] * (1 << 42)", "MemoryError", ""),
])
def test_crashing_cell_leaves_server_and_states_intact(server, code, ename, detail):
    before = make_kept(server)
    answer = server.execute(code, state="f-keep", ok=False)
    assert answer["error"]["ename"] == ename, answer["error"]
    assert detail in answer["error"]["evalue"]
    assert answer["state_name"] is None
    intact(server, before)
    assert server.execute("kept.append(4)\nkept", state="f-keep")["error"] is None


@pytest.mark.parametrize("code", [
    "x = b'x' * (600 * 2 ** 20)",            # one fast allocation, faster than any poll
    "import numpy as np\nx = np.ones(100_000_000)",
    "xs = []\nwhile True:\n    xs.append(bytearray(2 ** 20))",
])
def test_cell_over_max_cell_memory_mb_is_memory_limit(limited, code):
    before = make_kept(limited)
    answer = limited.execute(code, state="f-keep", ok=False)
    assert answer["error"]["ename"] == "MemoryLimit", answer["error"]
    assert "max_cell_memory_mb = 256" in answer["error"]["evalue"]
    intact(limited, before)


@pytest.mark.parametrize("hold", ["true", "false"])
def test_memory_limit_counts_the_cells_memory_not_the_states(make_server, hold):
    # A 160 MiB state, then a cell adding 160 MiB more: each under the 256 MiB limit,
    # also when the cell runs in the process that made the state as a chain step (no
    # holder forked: the state is that process's private memory).
    # numpy is imported in a cell of its own: in a worker forked before the warm zygote
    # was up, its import reserves address space (BLAS buffers) that counts for that cell.
    srv = make_server(config=LIMITS.replace("hold_chain_steps = true",
                                            f"hold_chain_steps = {hold}"))
    srv.execute("import numpy as np", new="f-np")
    srv.execute("base = np.ones(20_000_000)", state="f-np", new="f-big")
    answer = srv.execute("more = np.ones(20_000_000)\nfloat(base.sum() + more.sum())",
                         state="f-big")
    assert answer["output"][-1]["data"]["text/plain"] == "40000000.0"


def test_memory_watchdog_catches_copy_on_write_growth(limited):
    # Writing to inherited pages adds no address space (RLIMIT_AS cannot see it) but
    # makes them the cell's own: the watchdog on private memory stops it.
    # numpy is imported in a cell of its own, as above (run alone, this test's first cells
    # run in workers forked before the warm zygote is up).
    limited.execute("import numpy as np", new="f-cow0")
    limited.execute("a = np.ones(20_000_000)", state="f-cow0", new="f-cow1")
    limited.execute("b = np.ones(20_000_000)", state="f-cow1", new="f-cow2")
    # The cell never ends on its own: only the watchdog (or cell_timeout_s, a failure
    # here) stops it.
    answer = limited.execute("import time\nwhile True:\n    a += 1\n    b += 1\n"
                             "    time.sleep(0.05)", state="f-cow2", ok=False)
    assert answer["error"]["ename"] == "MemoryLimit", answer["error"]
    assert limited.value("f-cow2", "float(a[0] + b[-1])") == "2.0"


def test_cell_over_cell_timeout_s_is_timeout(limited):
    before = make_kept(limited)
    # Cells that would run for an hour, or for ever: only the limit ends them in time.
    codes = ["import time\ntime.sleep(3600)",
             "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
             "time.sleep(3600)",
             "while True:\n    pass"]
    answers = {code: in_thread(limited.execute, code, state="f-keep", ok=False)
               for code in codes}
    for code, answer in answers.items():
        answer = answer.result(timeout=120)
        assert answer["error"]["ename"] == "Timeout", (code, answer["error"])
        assert "cell_timeout_s = 3" in answer["error"]["evalue"]
    intact(limited, before)
    # A cell under the limit is untouched by it.
    assert limited.execute("import time\ntime.sleep(1)\n'ok'")["error"] is None


# After starting its processes the cell waits an hour: it cannot end before the watchdog
# sees them (were the watchdog gone, cell_timeout_s would end it: a Timeout, a failure).
@pytest.mark.parametrize("code", [
    "import subprocess\nps = [subprocess.Popen(['sleep', '3071']) for _ in range(30)]\n"
    "import time\ntime.sleep(3600)",
    "import os, time\nfor i in range(40):\n    if os.fork() == 0:\n"
    "        time.sleep(3071)\n        os._exit(0)\ntime.sleep(3600)",
])
def test_cell_forking_many_processes_is_bounded(limited, code):
    before = make_kept(limited)
    answer = limited.execute(code, state="f-keep", ok=False)
    # A pids cgroup makes fork fail (BlockingIOError); without one the watchdog kills.
    assert answer["error"]["ename"] in ("BlockingIOError", "ProcessLimit"), answer["error"]
    wait_gone(processes_named("3071"), "the cell's processes to be killed")
    intact(limited, before)


def test_processes_run_one_after_another_are_not_limited(limited):
    code = "import subprocess\nfor _ in range(20):\n    subprocess.run(['true'], check=True)\n'ok'"
    assert limited.execute(code)["error"] is None


def test_closed_stdout_cwd_and_environ_do_not_reach_the_parent_state(server):
    server.execute("import os\nstart = os.getcwd()", new="f-env")
    server.execute("import os, sys\nos.chdir('/tmp')\nos.environ['SNAPK_FAULT'] = '1'\n"
                   "sys.stdout.close()\nos.close(1)", state="f-env", ok=False)
    answer = server.execute("import os\nprint('still here')\n"
                            "os.getcwd() == start, os.environ.get('SNAPK_FAULT')", state="f-env")
    texts = [o.get("text", "") for o in answer["output"] if o["output_type"] == "stream"]
    assert "still here\n" in "".join(texts)
    assert answer["output"][-1]["data"]["text/plain"] == "(True, None)"


def test_leftover_threads_and_processes_reaped_on_delete(server):
    answer = server.execute(
        "import os, subprocess, threading, time\n"
        "t = threading.Thread(target=time.sleep, args=(3072,), daemon=True)\nt.start()\n"
        "p = subprocess.Popen(['sleep', '3072'])\n"
        "holder, sleeper = os.getpid(), p.pid\n"
        "holder, sleeper", new="f-leftover")
    holder, sleeper = eval(answer["output"][-1]["data"]["text/plain"])
    assert psutil.pid_exists(holder) and psutil.pid_exists(sleeper)
    assert server.delete("/states/f-leftover").json() == {"deleted": "f-leftover"}
    wait_gone([holder, sleeper], "the deleted state's holder and its leftovers to go")


def test_leftover_processes_reaped_on_eviction(limited):
    answer = limited.execute("import subprocess\np = subprocess.Popen(['sleep', '3073'])\n"
                             "import os\nos.getpid(), p.pid", new="f-evicted")
    holder, sleeper = eval(answer["output"][-1]["data"]["text/plain"])
    for i in range(4):  # max_live_states = 3: the leftover's holder is evicted
        limited.execute(f"n = {i}", new=f"f-evict{i}")
    assert not limited.get("/states/f-evicted").json()["live"]
    wait_gone([holder, sleeper], "the evicted holder and its leftovers to go")


def test_faults_script_five_rounds(tmp_path):
    """Five rounds, each SIGKILL within 1 s of the round's first answer (the script's
    default is 2 s): a kill still lands at a random point of three streams of saves,
    and a round checks about half as many states."""
    run = subprocess.run([sys.executable, "scripts/faults.py", "--rounds", "5",
                          "--max-delay", "1", "--work-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "survived 5/5 rounds" in run.stdout
