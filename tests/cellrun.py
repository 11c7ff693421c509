"""Test helper: run cells through kernel.cell in a real forked worker-like process."""

import multiprocessing
import os
import sys
import types


def _child(conn, cells, settings, setup):
    """The forked process: a fresh __main__ namespace, fds 1/2 on /dev/null, like a worker."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        from kernel import cell as kcell
        from kernel import outputs as kout
        if setup:
            setup(kout)
        results = []
        for n, source in enumerate(cells, 1):
            compiled = kcell.compile_cell(source, n)
            outs, err = kcell.run_cell(compiled, main.__dict__, n, settings or {})
            results.append({"outputs": outs, "error": err,
                            "uses_ipython": compiled.uses_ipython,
                            "user_names": sorted(k for k in main.__dict__ if not k.startswith("__")),
                            "stdout_ok": sys.stdout is sys.__stdout__ or type(sys.stdout).__name__ != "StreamProxy"})
        conn.send(results)
    except BaseException as exc:  # report the harness's own failure to the test
        import traceback
        conn.send({"harness_error": traceback.format_exc()})
    finally:
        conn.close()
        os._exit(0)


def run_cells(cells, settings=None, setup=None, timeout=120):
    """Run `cells` one after the other in a forked process; return one result dict per cell."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, list(cells), settings, setup))
    proc.start()
    child.close()
    if not parent.poll(timeout):
        proc.kill()
        raise TimeoutError("cells did not finish")
    results = parent.recv()
    proc.join(10)
    if isinstance(results, dict):
        raise RuntimeError(results["harness_error"])
    return results
