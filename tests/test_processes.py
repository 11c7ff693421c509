"""Process model: interrupts, crashing cells, parallel runs, eviction, shutdown."""

import contextlib
import glob
import os
import signal
import tempfile

import psutil
import pytest

import harness
from snapkernel.kernel import trace
from support.server import asleep, in_thread, wait_for, warm_zygote


def run_async(server, body):
    """POST /execute in a thread; a Future of the decoded answer."""
    def post():
        """The request, its status checked."""
        r = server.post("/execute", body)
        assert r.status_code == 200, r.text
        return r.json()
    return in_thread(post)


def test_interrupt_stops_sleep(server, gate):
    """SIGINT ends a time.sleep with KeyboardInterrupt in the cell (the sleep is an hour:
    only the interrupt can end it within the wait below)."""
    server.execute("x = 1", new="proc-int")
    here = gate()
    body = {"code": here.arrive_code + "import time\ntime.sleep(3600)", "exec_id": "sleeper",
            "state_name": "proc-int", "new_state_name": "proc-int2"}
    answer = run_async(server, body)
    (pid,) = here.arrived()
    wait_for(lambda: asleep(pid), "the cell to be inside time.sleep")
    assert server.post("/interrupt", {"exec_id": "sleeper"}).json() == {"interrupted": True}
    error = answer.result(timeout=60)["error"]
    assert error["ename"] == "KeyboardInterrupt"
    # Raised in the cell's sleep, not the SIGKILL after the grace period.
    assert "killed" not in error["evalue"], error
    assert any("time.sleep(3600)" in line for line in error["traceback"]), error
    assert answer.result()["state_name"] is None
    assert "proc-int2" not in server.get("/states").json()["states"]
    assert server.value("proc-int", "x") == "1"


def test_interrupt_escalates_to_sigkill(server, gate):
    """A cell that ignores SIGINT is killed after interrupt_grace_s (its sleep is an hour:
    only the SIGKILL can end it within the wait below)."""
    here = gate()
    code = ("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n" +
            here.arrive_code + "time.sleep(3600)")
    answer = run_async(server, {"code": code, "exec_id": "stubborn", "state_name": "initial"})
    (pid,) = here.arrived()
    wait_for(lambda: asleep(pid), "the cell to be inside time.sleep")
    assert server.post("/interrupt", {"exec_id": "stubborn"}).json() == {"interrupted": True}
    error = answer.result(timeout=60)["error"]
    assert error["ename"] == "KeyboardInterrupt"
    assert "killed after interrupt_grace_s" in error["evalue"], error
    wait_for(lambda: not harness.alive(pid), "the stubborn cell's process to be gone")


@pytest.mark.parametrize("code, expect", [
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "SIGSEGV"),
    ("import ctypes\nctypes.string_at(0)", "SIGSEGV"),
    ("import os\nos._exit(7)", "code 7"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "SIGKILL"),
])
def test_dying_cell_is_reported_and_server_carries_on(server, code, expect):
    server.execute("kept = [1, 2]", new="proc-crash")
    answer = server.execute(code, state="proc-crash", ok=False)
    assert answer["error"]["ename"] == "WorkerDied"
    assert expect in answer["error"]["evalue"]
    assert answer["state_name"] is None
    assert server.value("proc-crash", "kept") == "[1, 2]"
    assert server.execute("kept + [3]", state="proc-crash")["error"] is None


def test_exec_id_already_running_is_409(server, gate):
    # The first cell waits at the gate, so it is surely still running when the second
    # request comes (its exec_id is registered before the cell starts).
    here = gate()
    first = run_async(server, {"code": here.code + "'first'", "exec_id": "dup",
                               "state_name": "initial"})
    here.arrived()
    r = server.post("/execute", {"code": "1", "exec_id": "dup", "state_name": "initial"})
    assert r.status_code == 409 and r.json()["error"]["type"] == "Conflict", r.text
    assert "dup" in r.json()["error"]["message"]
    here.open()
    answer = first.result(timeout=60)
    assert answer["error"] is None
    assert answer["output"][-1]["data"]["text/plain"] == "'first'"


def test_two_executions_from_one_state_run_in_parallel(server, gate):
    # Neither cell can end before the gate opens: both arriving there means both ran at
    # once. One after the other, the second would never arrive (the wait fails).
    server.execute("import time", new="proc-par")
    here = gate()
    answers = [run_async(server, {"code": here.code + f"'done {i}'", "exec_id": f"par{i}",
                                  "state_name": "proc-par"}) for i in range(2)]
    pids = here.arrived(2)
    assert len(set(pids)) == 2 and all(harness.alive(pid) for pid in pids)
    here.open()
    for i, answer in enumerate(answers):
        answer = answer.result(timeout=60)
        assert answer["error"] is None, answer["error"]
        assert answer["output"][-1]["data"]["text/plain"] == f"'done {i}'"


def test_server_never_forks_and_sigterm_leaves_no_worker(make_server):
    srv = make_server()
    srv.execute("x = 1", new="a")
    srv.execute("import subprocess\np = subprocess.Popen(['sleep', '300'])", state="a",
                new="b")
    server_proc = psutil.Process(srv.proc.pid)
    workers = server_proc.children(recursive=True)
    assert len(workers) >= 3
    # Only the zygote is the server's child: it was spawned, every other worker forked from it.
    direct = server_proc.children()
    assert len(direct) == 1 and "zygote_main" in " ".join(direct[0].cmdline())
    stray = [c for c in workers if c.name() == "sleep"]
    assert stray
    srv.stop(signal.SIGTERM)
    assert srv.proc.returncode == 0
    gone, alive = psutil.wait_procs(workers, timeout=60)
    assert not alive, [p.pid for p in alive]


@pytest.mark.parametrize("route", ["/execute", "/notebooks/run"])
def test_a_request_running_at_sigterm_answers_503(make_server, gate, route):
    """A request whose cell runs when the server is told to stop is answered 503
    ServerStopping (the workers and store closed under it), not a 500 or an error of
    the cell."""
    srv = make_server()
    srv.execute("x = 1", new="a")
    waiting = gate()
    if route == "/execute":
        body = {"code": waiting.code, "state_name": "a", "exec_id": "held"}
    else:
        body = {"notebook": "nb", "cells": [{"id": "one", "source": "y = 1"},
                                            {"id": "two", "source": waiting.code},
                                            {"id": "three", "source": "z = 3"}]}
    answer = in_thread(srv.post, route, json=body, timeout=120)
    (pid,) = waiting.arrived()
    cell = psutil.Process(pid)
    srv.stop(signal.SIGTERM)
    assert srv.proc.returncode == 0
    _, alive = psutil.wait_procs([cell], timeout=60)
    assert not alive  # stopped with the server: the gate was never opened
    r = answer.result(timeout=120)
    assert r.status_code == 503, r.text
    assert r.json() == {"error": {"type": "ServerStopping", "message": (
        "the server is stopping, and this request was cut short; send it again once the "
        "server is back")}}


def test_ctrl_c_stops_cleanly(make_server):
    srv = make_server()
    srv.execute("y = 2", new="c")
    workers = psutil.Process(srv.proc.pid).children(recursive=True)
    srv.stop(signal.SIGINT)
    assert srv.proc.returncode == 0
    _, alive = psutil.wait_procs(workers, timeout=60)
    assert not alive, [p.pid for p in alive]


def test_lru_eviction_and_restore_with_identical_values(make_server):
    srv = make_server(config="[workers]\nmax_live_states = 2\n")
    srv.execute("import numpy as np\narr = np.arange(5) * 1.5\nfirst = {'k': [1, 2]}\n"
                "alias = first['k']\ndef f():\n    return first['k'][0] + len(arr)",
                new="s0")
    hashes = srv.post("/symbol_hashes", {"state_name": "s0",
                                         "symbols": ["arr", "first", "alias"]}).json()
    for i in range(1, 4):
        srv.execute(f"v{i} = {i}", new=f"s{i}")
    live = [n for n in srv.get("/states").json()["states"]
            if srv.get(f"/states/{n}").json()["live"]]
    assert "s0" not in live and len(live) <= 2
    assert srv.value("s0", "arr.tolist(), first, alias is first['k'], f()") \
        == "([0.0, 1.5, 3.0, 4.5, 6.0], {'k': [1, 2]}, True, 6)"
    again = srv.post("/symbol_hashes", {"state_name": "s0",
                                        "symbols": ["arr", "first", "alias"]}).json()
    assert again == hashes


def test_memory_bound_evicts(make_server):
    srv = make_server(config="[workers]\nmax_live_memory_mb = 300\n")
    srv.execute("import numpy as np\nbig = np.ones(40_000_000)", new="m1")
    srv.execute("import numpy as np\nbig = np.ones(40_000_000)", new="m2")
    assert not srv.get("/states/m1").json()["live"]
    assert srv.value("m1", "float(big.sum())") == "40000000.0"



def test_first_cells_do_not_wait_for_the_warm_up_and_behave_the_same(make_server):
    """A new server answers at once from its cold zygote (which imports neither numpy
    nor pandas, so that it starts fast); those cells still get pandas limits, inline
    figures and IPython.display; then the warm zygote takes over."""
    srv = make_server(extra_args=["--display-max-rows", "6"], wait=False)
    # The warm zygote is stopped until the first cell ran: that cell surely runs cold.
    warm = warm_zygote(srv)
    warm.send_signal(signal.SIGSTOP)
    try:
        srv.wait_up()
        first = srv.execute(
            "import sys\ncold = not {'numpy', 'pandas'} & set(sys.modules)\n"
            "import pandas as pd\n"
            "from IPython.display import clear_output\nprint('gone'); clear_output()\n"
            "import matplotlib.pyplot as plt\nplt.plot([1, 2]); plt.show()\n"
            "print('after')\npd.DataFrame({'c': range(20)})", new="first")
    finally:
        warm.send_signal(signal.SIGCONT)
    assert srv.execute("cold", state="first")["output"][0]["data"]["text/plain"] == "True"
    kinds = [(o["output_type"], sorted(o.get("data", {})) or o.get("text")) for o in
             first["output"]]
    assert kinds == [("display_data", ["image/png", "text/plain"]), ("stream", "after\n"),
                     ("execute_result", ["text/html", "text/plain"])]
    assert "[20 rows x 1 columns]" in first["output"][-1]["data"]["text/plain"]
    # Once the warm zygote is up, initial's holder is forked anew from it: pandas is
    # imported there already.
    wait_for(lambda: srv.execute("import sys\n'pandas' in sys.modules", new="probe")[
        "output"][0]["data"]["text/plain"] == "True", "the warm zygote to take over")


def test_state_gets_its_holder_without_a_next_request(make_server):
    """The child that made a state forks the state's holder a moment after its answer,
    not only when a next request comes."""
    srv = make_server()
    out = srv.execute("import os\nos.getpid()", new="alone")["output"]
    maker = psutil.Process(int(out[0]["data"]["text/plain"]))
    (holder,) = wait_for(maker.children, "a holder forked without a next request")
    assert holder.ppid() == maker.pid and holder.is_running()


def test_state_whose_maker_died_before_forking_its_holder_is_restored_soon(make_server):
    """The child that made a state dies before it forks the holder (here a cell's at-fork
    hook exits it): the next cell from the state does not wait worker_start_timeout_s
    for a holder that will never connect, but runs in the state restored from the store."""
    # worker_start_timeout_s is an hour: waiting it out would outlast the request's own
    # timeout (a failure), where noticing the dead maker answers at once.
    srv = make_server(config="[workers]\nworker_start_timeout_s = 3600\n")
    srv.execute("import os\nos.register_at_fork(before=lambda: os._exit(0))\nx = 1",
                new="hooked")
    answers = []

    def ran():
        """One try; True once it ran (a try sent while that child was still dying
        gets WorkerDied: it forks 2 ms after its answer)."""
        answer = srv.execute("print(x + 1)", state="hooked", ok=False)
        answers.append(answer)
        assert answer["error"] is None or answer["error"]["ename"] == "WorkerDied", answer
        return answer["error"] is None

    wait_for(ran, "a cell from the state to run", timeout=120)
    assert answers[-1]["output"] == [{"output_type": "stream", "name": "stdout",
                                      "text": "2\n"}]


def test_next_cell_runs_in_the_process_that_made_its_state(make_server):
    """In a chain, the child that made a state takes the next cell itself; with
    hold_chain_steps it forks the state's holder first. Earlier states stay intact and
    their dead holders are reaped."""
    srv = make_server(config="[workers]\nhold_chain_steps = true\n")
    srv.execute("import os\npids = [os.getpid()]", new="run-a")
    srv.execute("pids.append(os.getpid())", state="run-a", new="run-b")
    out = srv.execute("pids.append(os.getpid())\npids", state="run-b", new="run-c")["output"]
    pids = eval(out[0]["data"]["text/plain"])
    assert len(set(pids)) == 1
    runner = psutil.Process(pids[0])
    # run-a kept its value; its holder (forked off by the runner) answers from a spare of its own.
    again = srv.execute("pids, os.getpid()", state="run-a")["output"][0]["data"]["text/plain"]
    assert eval(again)[0] == pids[:1] and eval(again)[1] != pids[0]
    holders = runner.children()  # those of run-a, run-b and run-c, forked by the runner
    for name in ("run-a", "run-b"):
        assert srv.delete(f"/states/{name}").json() == {"deleted": name}

    def zombies():
        """How many of the holders have exited and wait to be reaped."""
        count = 0
        for holder in holders:
            with contextlib.suppress(psutil.NoSuchProcess):
                count += holder.status() == psutil.STATUS_ZOMBIE
        return count

    # The deleted states' holders exit; the runner reaps them when it next forks one.
    wait_for(lambda: zombies() >= 2, "the deleted states' holders to exit")
    srv.execute("pids.append(os.getpid())", state="run-c", new="run-d")
    wait_for(lambda: not zombies(), "the runner to reap its exited holders")


def test_a_chain_sent_back_to_back_keeps_every_state(make_server):
    """Cells sent as soon as the answer before them came run in the process that made
    their input state; a state that was only a step of the chain (no holder forked for
    it, if the next cell came first) is restored from the store when run from again,
    with its value, also while others run from it at once."""
    srv = make_server()
    made = [srv.execute("import os\nx = 0\npids = [os.getpid()]", new="step-0")]
    for n in range(1, 12):
        made.append(srv.execute("x += 1\npids.append(os.getpid())", state=f"step-{n - 1}",
                                new=f"step-{n}"))
    assert srv.value("step-11", "len(set(pids))") == "1"
    again = [in_thread(srv.execute, "x * 10", state=f"step-{n}") for n in range(12)]
    for n, future in enumerate(again):
        assert future.result(timeout=120)["output"][0]["data"]["text/plain"] == str(n * 10)
    for n in range(12):
        assert srv.value(f"step-{n}", "x, len(pids)") == f"({n}, {n + 1})"


def test_the_warm_up_between_cells_is_not_seen_by_the_users_cell_events(make_server,
                                                                        tmp_path):
    """The child that made a state rehearses a throwaway cell before the next one (its
    page faults taken early): no IPython event callback of the user's runs for it."""
    path = tmp_path / "trace.jsonl"
    srv = make_server(config=f'[server]\ntrace_file = "{path}"\n')
    state = "events"
    srv.execute("ran = []\nget_ipython().events.register('post_run_cell', "
                "lambda result: ran.append(1))", new=state, exec_id="events-0")
    for i in (1, 2):
        # The child that made the state has rehearsed by now (its stamp says so).
        wait_for(lambda: any(s["phase"] == "warmed" and s["exec"] == f"events-{i - 1}"
                             for s in trace.read(path)), f"the warm-up after events-{i - 1}")
        out = srv.execute("len(ran)", state=state, new=f"events-{i}", exec_id=f"events-{i}")
        assert out["output"][0]["data"]["text/plain"] == str(i)
        state = f"events-{i}"


def _leave_state_behind(srv, name):
    """Make state `name`, then run the next cell from it (taking the child that made
    it); the pid of `name`'s idle holder, which that child had forked."""
    srv.execute("import os\nx = 1", new=name)
    out = srv.execute("me = os.getpid()\nopen(f'/proc/{me}/task/{me}/children').read()",
                      state=name, new=f"{name}-next")["output"][0]["data"]["text/plain"]
    return psutil.Process(int(eval(out).split()[0]))


def _children(process, other_than=()):
    """Pids of `process`'s children but `other_than`, waiting for one."""
    return wait_for(lambda: {c.pid for c in process.children()} - set(other_than),
                    f"a child of {process.pid} (other than {sorted(other_than)})")


def _run_in(srv, name, exec_id=None):
    """(pid, parent pid) of the process that ran a cell from state `name`."""
    out = srv.execute("assert x == 1\nos.getpid(), os.getppid()", state=name,
                      exec_id=exec_id)["output"]
    return eval(out[0]["data"]["text/plain"])


def _forks(path, holder):
    """Trace stamps of the children `holder` forked (its "spare" stamps), in order."""
    return sorted((s for s in trace.read(path) if s["phase"] == "spare" and
                   s["pid"] == holder.pid), key=lambda s: s["t"])


def test_state_left_behind_by_a_run_in_order_gets_a_spare_once_quiet(make_server,
                                                                     tmp_path):
    """The child that made a state is taken by the next cell without a replacement being
    forked at once (it would compete with that cell); once no cell has run for
    spare_after_quiet_s, the state's holder forks a spare, and a later cell runs in it."""
    path = tmp_path / "trace.jsonl"
    srv = make_server(config=f'[server]\ntrace_file = "{path}"\n'
                             "[workers]\nhold_chain_steps = true\n"
                             "spare_after_quiet_s = 0.3\n")
    holder = _leave_state_behind(srv, "left")
    spares = _children(holder)
    # A cell sent before the server has the spare's hello is given a new fork instead
    # (seen once on a loaded machine): wait until the spare is the server's.
    wait_for(lambda: any(s["phase"] == "spare-ready" and int(s["exec"]) in spares
                         for s in trace.read(path)), "the spare's hello at the server")
    pid, parent = _run_in(srv, "left")
    assert pid in spares and parent == holder.pid


def test_state_run_again_before_the_quiet_moment_gets_its_spare_at_once(make_server,
                                                                          tmp_path):
    """A state run from again before the quiet moment forks a child for that cell and
    asks for its deferred spare at once, so the cell after finds one ready."""
    path = tmp_path / "trace.jsonl"
    srv = make_server(config=f'[server]\ntrace_file = "{path}"\n'
                             "[workers]\nhold_chain_steps = true\n"
                             "spare_after_quiet_s = 600\n")
    holder = _leave_state_behind(srv, "again")
    first, _ = _run_in(srv, "again", exec_id="again-1")
    # Deferred (the quiet moment is 10 minutes away): the holder forked nothing before
    # that request came, then the cell's child and the spare owed.
    (request,) = [s for s in trace.read(path) if s["phase"] == "request"
                  and s["exec"] == "again-1"]
    forks = wait_for(lambda: len(_forks(path, holder)) >= 2 and _forks(path, holder),
                     "the holder to fork the cell's child and the owed spare")
    assert len(forks) == 2 and all(s["t"] > request["t"] for s in forks), (request, forks)
    spares = _children(holder, other_than={first})
    pid, parent = _run_in(srv, "again")
    assert pid in spares and parent == holder.pid


def test_spares_owed_after_a_run_in_order_come_one_at_a_time_last_used_first(make_server,
                                                                               tmp_path):
    """A chain run in order leaves each state but the last owed a spare; once quiet they
    are forked a quiet period apart, the state used last first (forked all at once, they
    held up the next run's first cell)."""
    path = tmp_path / "trace.jsonl"
    srv = make_server(config=f'[server]\ntrace_file = "{path}"\n'
                             "[workers]\nhold_chain_steps = true\n"
                             "spare_after_quiet_s = 0.5\n")
    srv.execute("import os\nx = 1", new="c0")
    seen, holders = set(), []
    for i in range(1, 4):
        # Run by the child that made c{i-1}: its children are the holders it forked.
        out = srv.execute("me = os.getpid()\nopen(f'/proc/{me}/task/{me}/children').read()",
                          state=f"c{i - 1}", new=f"c{i}")["output"][0]["data"]["text/plain"]
        pids = set(map(int, eval(out).split()))
        new = pids - seen
        seen |= pids
        assert len(new) == 1
        holders.append(psutil.Process(new.pop()))  # the holder of c{i - 1}
    # Each holder stamps "spare" as it forks one: the order of those stamps is the order
    # the spares came in.
    wait_for(lambda: all(_forks(path, holder) for holder in holders),
             "a spare forked by each holder")
    first = [_forks(path, holder)[0] for holder in holders]
    assert [s["exec"] for s in first] == ["c0", "c1", "c2"]
    # c2's first (c3's cell ran from it last), then c1's, then c0's.
    assert first[2]["t"] < first[1]["t"] < first[0]["t"], first


def _socket_dirs(pid):
    """The worker-socket folders of the server with process id `pid`."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"snapk-{pid}-*"))


def test_socket_folder_of_a_killed_server_is_removed_by_the_next(make_server, tmp_path):
    """A server killed with SIGKILL cannot remove its socket folder; the next server
    started by the same user does, and a server stopped normally removes its own."""
    killed = make_server(tmp_path / "a")
    (left,) = _socket_dirs(killed.proc.pid)
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait()
    assert os.path.isdir(left)
    other = make_server(tmp_path / "b")
    assert not os.path.exists(left)
    (own,) = _socket_dirs(other.proc.pid)
    other.stop()
    assert not os.path.exists(own)


def test_a_stop_signal_during_a_connections_hand_over_leaves_once_it_is_queued():
    """A stop signal's SystemExit never lands inside the queue that hands a connection
    to cheroot's threads (it could lose the wakeup of a thread's stop request, and the
    stop then waited 10 s): one that comes meanwhile leaves once the connection is
    queued; one that comes at any other time leaves at once."""
    from snapkernel.api.routes import app
    from snapkernel.api.server import DeferredServer

    server = DeferredServer(("127.0.0.1", 0), app)
    queued = []

    class Requests:
        """cheroot's queue of connections for its threads, where the signal lands."""

        def put(self, conn):
            server.leave()  # the signal handler, run in the middle of the put
            queued.append(conn)

    server.requests = Requests()
    conn = type("Conn", (), {"snapk_waited": True})()  # had its bytes to read
    with pytest.raises(SystemExit):
        server.process_conn(conn)
    assert queued == [conn]
    with pytest.raises(SystemExit):
        server.leave()
