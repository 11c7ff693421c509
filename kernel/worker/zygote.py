"""The zygotes: the processes every holder is forked from.

The server spawns one zygote (never forks: it is multi-threaded). That
process forks, first thing, a second zygote that imports what cells
commonly use and runs a throwaway cell before it connects (seconds);
holders forked from it start warm, so their cells do not pay those imports
again. Meanwhile the spawned one, cold, answers `Spawn` within milliseconds
of start (a holder it forks imports what its cells import, as in a fresh
Python), and later stays on as the reaper of its holders and the fallback
should the warm one die.
"""

import gc
import os
import select
import signal

from snapkernel.kernel import protocol, trace
from snapkernel.kernel.channel import ChannelClosed
from snapkernel.kernel.worker import context, limits, opened
from snapkernel.kernel.worker.process import (PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, WorkerProcess,
                                   fork_worker, fresh_main, prctl)
from snapkernel.storage import guard, remote


def zygote_main(sock_path, settings):
    """Entry point of the spawned zygote (and, after its first fork, of the warm one)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["MPLBACKEND"] = "Agg"
    guard.install()  # before any fork: every holder and cell child has it
    trace.configure(settings, "zygote")
    context.remember_base()
    limits.init_zygote()
    opened.install(settings["server.data_dir"])
    from snapkernel.kernel.worker import execution, holder  # every holder runs cells: imported once, here
    execution.capture.watch_imports()
    child_loads = holder.ChildLock("child-loads")  # shared by every holder of both zygotes
    warm = settings["workers.warm_zygote"] and os.fork() == 0
    if warm:
        # Neither attribute survives a fork; the warm zygote dies with the cold one.
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        trace.after_fork("zygote")
        _warm(settings)
        context.remember_base()  # its own random generator: a fork reseeds it
    namespace = fresh_main()
    proc = WorkerProcess(sock_path, settings)
    proc.connect(protocol.ZYGOTE, warm=warm)
    wake = proc.reaper()
    while True:
        ready, _, _ = select.select([proc.channel, wake], [], [])
        if wake in ready:
            proc.reap(wake)
        if proc.channel not in ready:
            continue
        try:
            msg = proc.channel.recv()
        except ChannelClosed:
            os._exit(0)
        if isinstance(msg, protocol.Spawn):
            gc.freeze()
            if fork_worker("holder") == 0:
                proc.channel.close()
                holder.StateHolder(sock_path, settings, namespace, msg.manifest,
                                   child_loads).restore(msg.req)


def _warm(settings):
    """Import what cells commonly use and run a throwaway cell, once, before any fork."""
    for name in ("numpy", "pandas", "matplotlib", "matplotlib.pyplot", "dill", "IPython"):
        try:
            __import__(name)
        except Exception:
            pass
    from snapkernel.kernel.worker import execution
    execution.capture.warm()
    remote.warm(settings)
    execution.run_cell(execution.compile_cell("_w = [1]\n_w", 0), {"__builtins__": __builtins__}, 0,
                    settings)
