"""Check that tests can fail: break the behaviour a test guards, run it, expect a failure.

Each breakage below names what it breaks (one or more exact text substitutions
in the product code) and the tests that guard that behaviour. For each one
asked for, this script copies the working tree (uncommitted changes included)
to a scratch folder, applies the breakage there, runs the tests with pytest
in that copy, and reports whether they failed. The tree itself is never
touched.

    python scripts/break_check.py --list
    python scripts/break_check.py interrupt-no-sigint maker-death-unnoticed
    python scripts/break_check.py --all  [--markdown]
    python scripts/break_check.py --at c05dfdc --test tests/test_fuzz.py::NAME BREAKAGE
        (the same breakage against an older revision's test: did it catch it?)

A breakage whose text is no longer found in the code is reported as
"stale" (the code moved on: update the breakage). A test run that goes past
--timeout counts as a hang, which is a finding too: the tests are meant to
fail within their own deadlines, not hang.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Breakage:
    """A named change that breaks one behaviour, and the tests that must then fail."""

    def __init__(self, name, what, edits, tests):
        """`edits`: [(path, old text, new text)], each old text found exactly once, or
        ("copy", source path, target path)."""
        self.name = name
        self.what = what
        self.edits = edits
        self.tests = tests


B = Breakage
BREAKAGES = [
    # tests/test_processes.py ------------------------------------------------------
    B("interrupt-no-sigint", "/interrupt sends no SIGINT (only the SIGKILL after the grace)",
      [("kernel/server/cell_runs.py", "            os.kill(run.child.pid, signal.SIGINT)\n",
        "            pass\n")],
      ["tests/test_processes.py::test_interrupt_stops_sleep"]),
    B("interrupt-no-sigkill", "no SIGKILL after interrupt_grace_s",
      [("kernel/server/cell_runs.py",
        "        if run.phase == \"running\" and run.child.alive:\n            run.child.kill()\n",
        "        pass\n")],
      ["tests/test_processes.py::test_interrupt_escalates_to_sigkill"]),
    B("exec-id-no-conflict", "a running exec_id is not refused",
      [("kernel/server/cell_runs.py",
        "            if key is not None and key in self.running:\n",
        "            if False:\n")],
      ["tests/test_processes.py::test_exec_id_already_running_is_409"]),
    B("runs-serialised", "one request runs at a time (a lock around every run)",
      [("kernel/server/cell_runs.py", "class CellRun:\n",
        "_SERIAL = threading.Lock()\n\n\nclass CellRun:\n"),
       ("kernel/server/cell_runs.py", "        key = request.exec_id\n        run = CellRun(key)\n",
        "        key = request.exec_id\n        run = CellRun(key)\n        _SERIAL.acquire()\n"),
       ("kernel/server/cell_runs.py",
        "        finally:\n            with self.lock:\n                if key is not None:\n"
        "                    self.running.pop(key, None)\n",
        "        finally:\n            _SERIAL.release()\n            with self.lock:\n"
        "                if key is not None:\n                    self.running.pop(key, None)\n")],
      ["tests/test_processes.py::test_two_executions_from_one_state_run_in_parallel"]),
    B("first-cells-wait-for-warm-zygote", "cells wait for the warm zygote (the cold one "
                                          "never serves)",
      [("kernel/server/pool.py", "                alive = [z for z in self.zygotes if z.alive]\n",
        "                alive = [z for z in self.zygotes if z.alive and z.hello.warm]\n")],
      ["tests/test_processes.py::"
       "test_first_cells_do_not_wait_for_the_warm_up_and_behave_the_same"]),
    B("maker-death-unnoticed", "a state's maker found dead does not shorten the wait for "
                               "its holder (worker_start_timeout_s is waited out)",
      [("kernel/server/pool.py",
        "                live.deadline = min(live.deadline, time.monotonic() + "
        "HOLDER_AFTER_MAKER_S)\n", "                pass\n")],
      ["tests/test_processes.py::"
       "test_state_whose_maker_died_before_forking_its_holder_is_restored_soon"]),
    B("spare-not-deferred", "the spare replacing the child that made a state is forked at "
                            "once, not at the quiet moment",
      [("kernel/server/pool.py", "                self.owed_when_quiet.add(live)\n",
        "                live.ask_fork(now=False)\n")],
      ["tests/test_processes.py::"
       "test_state_run_again_before_the_quiet_moment_gets_its_spare_at_once"]),
    B("owed-spares-oldest-first", "owed spares come in the order states were used, not "
                                  "last used first",
      [("kernel/server/pool.py", "        for live in reversed(self.live.values()):\n",
        "        for live in list(self.live.values()):\n")],
      ["tests/test_processes.py::"
       "test_spares_owed_after_a_run_in_order_come_one_at_a_time_last_used_first"]),
    # tests/test_races.py ------------------------------------------------------------
    B("forked-copy-answers", "a process a cell forked returns from the cell like the child "
                             "the pool forked (answers, stores)",
      [("kernel/worker/limits.py", "        if os.getpid() != owner:\n            os._exit(0)\n",
        "")],
      ["tests/test_races.py::test_a_process_forked_by_a_cell_never_answers_or_stores"]),
    B("stopped-holder-keeps-waiters", "requests waiting for a spare of a stopped holder are "
                                      "not woken (they wait worker_start_timeout_s)",
      [("kernel/server/pool.py", "            if not live.alive():\n"
        "                raise WorkerError(\"WorkerDied\", \"the state's holder did not come\")\n",
        ""),
       ("kernel/server/live.py", "                spare.kill()\n        self.spares.put(None)\n",
        "                spare.kill()\n")],
      ["tests/test_races.py::"
       "test_a_burst_of_first_cells_waiting_on_a_cold_holder_when_the_warm_zygote_comes",
       "tests/test_races.py::test_requests_waiting_for_a_spare_of_an_evicted_state_are_served"]),
    B("reset-keeps-late-states", "a cell that finishes after a reset still binds its state",
      [("kernel/server/registry.py", "            if generation != self.generation:\n"
        "                child.kill()\n", "            if False:\n                child.kill()\n")],
      ["tests/test_races.py::test_cells_finishing_after_a_reset_say_their_state_was_discarded"]),
    # tests/test_security.py -----------------------------------------------------------
    B("no-auth-refused-on-loopback", "--no-auth is refused on a loopback bind too",
      [("main.py", "    if not args.token and not (args.no_auth and is_loopback(host)):\n",
        "    if not args.token:\n")],
      ["tests/test_security.py::test_refuses_a_network_bind_without_a_token"]),
    B("no-auth-on-any-bind", "--no-auth is accepted on a network bind",
      [("main.py", "    if not args.token and not (args.no_auth and is_loopback(host)):\n",
        "    if not args.token and not args.no_auth:\n")],
      ["tests/test_security.py::test_refuses_a_network_bind_without_a_token"]),
    B("tls-handshake-in-accept-loop", "the TLS handshake runs in cheroot's accept loop",
      [("api/server.py", "tls = self.context.wrap_socket(sock, do_handshake_on_connect=False,",
        "tls = self.context.wrap_socket(sock, do_handshake_on_connect=True,")],
      ["tests/test_security.py::test_tls_with_a_self_signed_certificate"]),
    B("idle-connection-takes-a-thread", "a new connection goes to a worker thread at once",
      [("api/server.py", "        if not getattr(conn, \"snapk_waited\", False):\n",
        "        if False:\n")],
      ["tests/test_security.py::test_idle_clients_hold_no_thread"]),
    B("no-socket-timeout", "client sockets never time out (socket_timeout_s ignored)",
      [("api/server.py", "timeout=settings[\"server.socket_timeout_s\"],\n",
        "timeout=None,\n")],
      ["tests/test_security.py::test_half_sent_requests_hold_a_thread_only_for_socket_timeout_s"]),
    # tests/test_fuzz.py ---------------------------------------------------------------
    B("state-names-unbounded", "state names of any length pass the request checks",
      [("api/openapi.py", '"type": "string", "minLength": 1, "maxLength": MAX_NAME,',
        '"type": "string", "minLength": 1,')],
      ["tests/test_fuzz.py::test_huge_strings_and_deep_nesting_in_every_field"]),
    B("header-size-limit", "cheroot refuses requests with headers over 64 KiB (a long token "
                           "gets no JSON 401)",
      [("api/server.py", "                            request_queue_size=_BACKLOG)\n",
        "                            request_queue_size=_BACKLOG)\n"
        "    server.max_request_header_size = 65536\n")],
      ["tests/test_fuzz.py::test_huge_tokens_headers_and_lengths"]),
    # tests/test_store.py, tests/test_gc_store.py --------------------------------------
    B("write-behind", "a new state is written to the store 30 s after its answer",
      [("storage/snapshot.py", "    store.write_state(manifest[\"name\"], manifest, payloads)\n",
        "    __import__('threading').Timer(30, store.write_state, args=(\n"
        "        manifest[\"name\"], manifest, payloads)).start()\n")],
      ["tests/test_store.py::test_sigkill_during_executions_loses_no_answered_state"]),
    B("other-python-loaded", "a state pickled by another Python is loaded, not refused",
      [("storage/snapshot.py",
        "    if manifest.get(\"python\", PYTHON) != PYTHON and manifest[\"groups\"]:\n",
        "    if False:\n")],
      ["tests/test_store.py::test_state_from_another_python_is_refused_clearly"]),
    B("gc-age-ignored", "gc_states.py --older-than deletes states of any age",
      [("scripts/gc_states.py", "                      if (created_at(m) or now) < cutoff}\n",
        "                      if True}\n")],
      ["tests/test_gc_store.py::test_older_than_deletes_old_states_only"]),
    # tests/test_faults.py -------------------------------------------------------------
    B("no-cell-timeout", "cell_timeout_s is not enforced",
      [("kernel/server/cell_runs.py",
        "        if timeout and time.monotonic() - run.started > timeout:\n",
        "        if False:\n")],
      ["tests/test_faults.py::test_cell_over_cell_timeout_s_is_timeout",
       "tests/test_fresh.py::test_cell_timeout"]),
    B("no-memory-watchdog", "the watchdog on a cell's private memory is off",
      [("kernel/server/cell_runs.py",
        "        elif max_mem and private_bytes(run.child.pid) - run.private_before > "
        "max_mem:\n",
        "        elif False:\n")],
      ["tests/test_faults.py::test_memory_watchdog_catches_copy_on_write_growth"]),
    B("no-process-limit", "no pids cgroup (as on a machine without one) and the watchdog on "
                          "a cell's process count off",
      [("kernel/worker/limits.py",
        "    if not os.path.isdir(_CGROUP_V1_PIDS):\n        return None\n", "    return None\n"),
       ("kernel/server/cell_runs.py",
        "        elif max_procs and group_processes(run.child.pid) > max_procs + 1:\n",
        "        elif False:\n")],
      ["tests/test_faults.py::test_cell_forking_many_processes_is_bounded"]),
    B("kill-spares-not-their-group", "a stopped worker is killed alone, not with its process "
                                     "group (what its cells left running)",
      [("kernel/server/connections.py",
        "        for target in (lambda: os.killpg(self.pid, signal.SIGKILL),\n"
        "                       lambda: os.kill(self.pid, signal.SIGKILL)):\n",
        "        for target in (lambda: os.kill(self.pid, signal.SIGKILL),):\n")],
      ["tests/test_faults.py::test_leftover_threads_and_processes_reaped_on_delete",
       "tests/test_faults.py::test_leftover_processes_reaped_on_eviction"]),
    # tests/test_stream.py -------------------------------------------------------------
    B("no-streaming", "a streamed cell's outputs are held back until its answer",
      [("kernel/worker/child.py", "        if not msg.stream:\n            return None\n",
        "        return None\n")],
      ["tests/test_stream.py::test_first_output_arrives_before_the_cell_ends"]),
    # tests/test_notebooks.py ----------------------------------------------------------
    B("reuse-runs-again", "a notebook run executes cells it has results for (and still "
                          "calls them reused)",
      [("kernel/notebook/incremental.py", "            if i not in plan.run:\n",
        "            if False:\n"),
       ("kernel/notebook/incremental.py",
        "            status = CellStatus.RAN if failure is None else (",
        "            status = (CellStatus.REUSED if i not in plan.run else CellStatus.RAN) "
        "if failure is None else (")],
      ["tests/test_notebooks.py::test_a_second_run_runs_nothing_also_after_a_restart"]),
    B("interrupt-ignored", "/interrupt says it interrupted but stops nothing",
      [("kernel/server/cell_runs.py",
        "        self._stop(run, \"KeyboardInterrupt\",\n"
        "                   \"the cell did not stop on SIGINT and was killed after "
        "interrupt_grace_s\")\n", "")],
      ["tests/test_notebooks.py::test_interrupting_a_run_stops_its_cell_and_the_run",
       "tests/test_processes.py::test_interrupt_stops_sleep"]),
    # tests/test_fresh.py, tests/test_fresh_run.py ------------------------------------
    B("no-run-deadline", "a fresh run's deadline is not enforced",
      [("kernel/notebook/fresh.py", "                    if now > deadline:\n",
        "                    if False:\n"),
       ("kernel/notebook/fresh.py",
        "elif kill_at is None and (now > deadline or self.cancel.is_set()):\n",
        "elif kill_at is None and self.cancel.is_set():\n")],
      ["tests/test_fresh.py::test_run_deadline_stops_a_cell_that_ignores_interrupts"]),
    B("no-memory-fuse", "a fresh run's memory fuse never blows",
      [("kernel/notebook/fresh.py", "                if memory > fuse:\n",
        "                if False:\n")],
      ["tests/test_fresh_run.py::test_memory_fuse"]),
    # tests/test_fidelity.py, tests/test_api.py ---------------------------------------
    B("fidelity-notebook-duplicated", "one fidelity notebook is a copy of another",
      [("copy", "tests/notebooks/06_magics.ipynb", "tests/notebooks/07_interleaved_output.ipynb")],
      ["tests/test_fidelity.py::test_there_are_enough_notebooks"]),
    B("bearer-ignored", "the Authorization: Bearer header is not read",
      [("api/routes.py", "    if header.startswith(\"Bearer \"):\n", "    if False:\n")],
      ["tests/test_api.py::test_bearer_header_accepted"]),
    B("unknown-route-not-json", "an unknown route is answered by bottle's HTML page",
      [("api/routes.py", "@app.error(404)\n", "")],
      ["tests/test_api.py::test_unknown_route_and_method_are_json"]),
    # tests/test_remote.py, tests/test_bench.py ----------------------------------------
    B("name-not-compare-and-swap", "a server rebinds a name on the remote without "
                                   "If-Match (the last writer wins silently)",
      [("storage/remote.py",
        "        condition = {\"IfMatch\": etag} if etag else {\"IfNoneMatch\": \"*\"}\n",
        "        condition = {}\n")],
      ["tests/test_remote.py::test_rebinding_race_between_two_servers"]),
    B("ipykernel-peer-interrupt-ignored", "the bench's ipykernel peer sends no interrupt",
      [("scripts/bench/peers.py", "        \"\"\"SIGINT the kernel, as a front end's interrupt "
        "button does.\"\"\"\n        self.manager.interrupt_kernel()\n",
        "        \"\"\"SIGINT the kernel, as a front end's interrupt button does.\"\"\"\n")],
      ["tests/test_bench.py::test_ipykernel_peer_runs_cells_interrupts_and_resets"]),
    # tests/test_load.py (scripts/load.py), tests/test_processes.py ----------------------
    B("sigterm-leaves-workers", "a server stopped by SIGTERM does not stop its workers",
      [("api/server.py", "        # Workers first: a request waiting on one then ends at once.\n"
        "        service.close()\n", ""),
       ("api/routes.py", "                atexit.register(self.close)\n", "")],
      ["tests/test_load.py::test_eight_clients_no_errors_no_lost_states_no_leaked_processes",
       "tests/test_processes.py::test_server_never_forks_and_sigterm_leaves_no_worker"]),
    # tests/test_widgets.py ---------------------------------------------------------
    B("comms-cut", "the Jupyter kernel does not relay its cells' comm messages",
      [("frontends/jupyter/kernel.py",
        "                    self._note_comm(event[\"msg_type\"], event[\"content\"])\n"
        "                    relay.comm(event)\n",
        "                    pass\n")],
      ["tests/test_widgets.py::test_slider_both_ways",
       "tests/test_widgets.py::test_progress_bar_updates_while_its_cell_runs",
       "tests/test_widgets.py::test_widgets_in_jupyterlab"]),
    B("front-end-comms-dropped", "a front end's comm messages never reach the state's process",
      [("frontends/jupyter/kernel.py",
        "        await asyncio.to_thread(self._deliver_comm, parent)\n",
        "        return\n")],
      ["tests/test_widgets.py::test_slider_both_ways",
       "tests/test_widgets.py::test_widgets_in_jupyterlab"]),
    B("widgets-not-kept", "a state does not keep its widgets' models",
      [("kernel/worker/context.py",
        "    Provider(\"ipywidgets\", widgets.states, widgets.rebuild, module=\"ipywidgets\"),\n",
        "")],
      ["tests/test_widgets.py::test_widget_survives_a_server_restart",
       "tests/test_widgets.py::test_widgets_through_the_api"]),
    B("widget-described-stale", "a state describes a widget as its variable was first stored",
      [("kernel/worker/child.py",
        "        if \"ipywidgets\" in sys.modules:  # a slider moved changes no variable's pickle\n",
        "        if False:\n")],
      ["tests/test_widgets.py::test_a_moved_widget_is_described_as_it_is",
       "tests/test_widgets.py::test_widgets_in_jupyterlab"]),
    B("stopping-answers-500", "a request cut short by SIGTERM answers 500 or a cell error",
      [("api/routes.py", "    if found is None and service.stopping:\n", "    if False:\n"),
       ("kernel/server/registry.py", "        if answer.error is not None and self.closed:\n",
        "        if False:\n")],
      ["tests/test_processes.py::test_a_request_running_at_sigterm_answers_503"]),
    B("backend-list-ours", "matplotlib.use's error lists our inline module, not ipykernel's",
      [("kernel/worker/capture/figures.py",
        "            ours = used.pop(MPL_BACKEND)\n",
        "            ours = used[MPL_BACKEND]\n")],
      ["tests/test_outputs.py::test_an_unknown_backend_is_refused_as_in_ipykernel"]),
    B("output-widget-blind", "ipywidgets' Output finds no parent message in a worker",
      [("kernel/worker/capture/comms.py", "            kernel = KERNEL\n", "")],
      ["tests/test_widgets.py::test_message_id_through_the_api",
       "tests/test_widgets.py::test_output_widget_captures_as_in_ipykernel",
       "tests/test_widgets.py::test_interact_output_after_a_slider_move_as_in_ipykernel",
       "tests/test_widgets.py::test_output_widget_in_jupyterlab"]),
    B("comm-cell-parent-dropped", "a front end's comm message runs without its msg_id",
      [("frontends/jupyter/kernel.py", "parent[\"header\"].get(\"msg_id\")))",
        "parent[\"header\"].get(\"msg_id\") if parent[\"header\"][\"msg_type\"] == "
        "\"execute_request\" else None))")],
      ["tests/test_widgets.py::test_interact_output_after_a_slider_move_as_in_ipykernel",
       "tests/test_widgets.py::test_output_widget_in_jupyterlab"]),
]


def scratch_copy(at=None):
    """A copy of the working tree in a new temporary folder (no .git, no stores); with
    `at`, of that git revision instead (to see whether an older test caught a breakage)."""
    folder = tempfile.mkdtemp(prefix="break-check-")
    tree = os.path.join(folder, "tree")
    if at is None:
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
            ".git", "__pycache__", "*.pyc", ".pytest_cache", "data", "*.egg-info"))
    else:
        os.makedirs(tree)
        archive = subprocess.run(["git", "archive", at], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return folder, tree


def apply(tree, breakage):
    """Apply the breakage's edits in `tree`; the first edit whose text is missing, or None.

    An edit ("copy", source, target) copies a file over another instead.
    """
    for path, old, new in breakage.edits:
        if path == "copy":
            shutil.copyfile(os.path.join(tree, old), os.path.join(tree, new))
            continue
        full = os.path.join(tree, path)
        with open(full) as f:
            text = f.read()
        if text.count(old) != 1:
            return f"{path}: text found {text.count(old)} times: {old.strip()[:60]!r}"
        with open(full, "w") as f:
            f.write(text.replace(old, new))
    return None


def check(breakage, test, timeout, at=None):
    """Run `test` on a copy broken by `breakage`: (verdict, seconds, output tail)."""
    folder, tree = scratch_copy(at)
    started = time.monotonic()
    try:
        stale = apply(tree, breakage)
        if stale:
            return "stale", 0.0, stale
        # `python -m pytest` puts the copy first on sys.path, so the tests, the servers
        # they start (cwd = the copy) and their workers all run the broken code.
        try:
            run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "--tb=short",
                                  "-p", "no:cacheprovider", test], cwd=tree,
                                 capture_output=True, text=True, timeout=timeout,
                                 env=dict(os.environ, COLUMNS="400"))  # whole FAILED lines
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) \
                else (exc.stdout or "")
            return "hung", time.monotonic() - started, out[-1500:]
        verdict = "failed" if run.returncode == 1 else (
            "passed" if run.returncode == 0 else f"error (pytest exit {run.returncode})")
        return verdict, time.monotonic() - started, (run.stdout + run.stderr)[-1500:]
    finally:
        stop_left_in(tree)
        shutil.rmtree(folder, ignore_errors=True)


def stop_left_in(tree):
    """SIGKILL the processes still running in `tree`: what a broken copy leaked (its
    workers, the sleeps of its cells), found by their working directory."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if cwd == tree or cwd.startswith(tree + "/") or cwd.startswith(tree + " "):
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:  # it exited since
                pass


def main():
    """Run the breakages asked for; exit 1 unless every test failed as it should."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="breakages to check (see --list)")
    parser.add_argument("--all", action="store_true", help="check every breakage")
    parser.add_argument("--list", action="store_true", help="list the breakages")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds a breakage's test run may take before it counts as a hang")
    parser.add_argument("--markdown", action="store_true", help="print a table at the end")
    parser.add_argument("--at", metavar="REV", help="break a git revision's tree instead of "
                        "the working tree (its tests must have the names given)")
    parser.add_argument("--test", action="append", metavar="NODE",
                        help="run this test (pytest node id) instead of the breakage's own")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each run's output")
    args = parser.parse_args()
    known = {b.name: b for b in BREAKAGES}
    if args.list:
        for b in BREAKAGES:
            print(f"{b.name}: {b.what}\n    " + "\n    ".join(b.tests))
        return 0
    chosen = BREAKAGES if args.all else [known[n] for n in args.names]
    if not chosen:
        parser.error("name breakages, or --all")
    rows = []
    for b in chosen:
        for test in args.test or b.tests:
            verdict, seconds, out = check(b, test, args.timeout, args.at)
            rows.append((b, test, verdict))
            print(f"{b.name}: {test} {verdict} ({seconds:.0f} s)", flush=True)
            for line in out.splitlines():
                if line.startswith("FAILED "):  # how it failed: for the cause, not another
                    print("    " + line[:400])
            if args.verbose or verdict != "failed":
                print("    " + out.replace("\n", "\n    "))
    if args.markdown:
        print("\n| test | breakage | failed |\n|---|---|---|")
        for b, test, verdict in rows:
            print(f"| {test.replace('tests/', '')} | {b.what} | "
                  f"{'yes' if verdict == 'failed' else 'NO: ' + verdict} |")
    return 0 if all(v == "failed" for _, _, v in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
