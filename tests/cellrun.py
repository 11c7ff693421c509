"""Test helper: run cells through kernel.cell in a real forked worker-like process."""

import multiprocessing
import os
import sys
import types

import nbformat


def _child(conn, cells, settings, setup):
    """The forked process: a fresh __main__ namespace, fds 1/2 on /dev/null, like a worker."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
        # A worker shows warnings; pytest's recording of them must not reach the child.
        import importlib
        import warnings
        importlib.reload(warnings)
        warnings.resetwarnings()
        warnings.simplefilter("default")
        # Inherited garbage (the parent's old pipe objects) must not close fds mid-cell.
        import gc
        gc.collect()
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        from kernel.worker import runner as kcell
        from kernel.worker import outputs as kout
        if setup:
            setup(kout)
        kout.watch_imports()  # as the worker's zygote does
        import builtins
        import threading
        results = []
        for n, source in enumerate(cells, 1):
            before = _process_state()
            builtins_before = set(vars(builtins))
            compiled = kcell.compile_cell(source, n)
            outs, err = kcell.run_cell(compiled, main.__dict__, n, settings or {})
            after = _process_state()
            results.append({
                "outputs": outs, "error": err,
                "uses_ipython": compiled.uses_ipython,
                "n_codes": len(compiled.codes),
                "user_names": sorted(k for k in main.__dict__ if not k.startswith("__")),
                "restored": before == after,
                "restore_diff": [before, after] if before != after else None,
                "builtins_added": sorted(set(vars(builtins)) - builtins_before),
                "threads": threading.active_count(),
            })
        conn.send(results)
    except BaseException:  # report the harness's own failure to the test
        import traceback
        conn.send({"harness_error": traceback.format_exc()})
    finally:
        conn.close()
        os._exit(0)


def _link(fd):
    """What an open fd points to ('' if it closed meanwhile)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _process_state():
    """What a cell must leave as it found: fds 1/2, sys streams, open fds."""
    return {
        "fd1": (os.fstat(1).st_dev, os.fstat(1).st_ino),
        "fd2": (os.fstat(2).st_dev, os.fstat(2).st_ino),
        "stdout": id(sys.stdout), "stderr": id(sys.stderr),
        # Pipes and memory files only: libraries may keep regular files open (fonts).
        "fds": sorted(f"{f}:{link}" for f in os.listdir("/proc/self/fd")
                      if (link := _link(f)).startswith(("pipe:", "/memfd:", "socket:"))),
    }


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
    parent.close()
    proc.join(10)
    proc.close()
    if isinstance(results, dict):
        raise RuntimeError(results["harness_error"])
    return results


def outputs_of(result):
    """The outputs of one cell's result, each checked against nbformat's v4 schema."""
    for out in result["outputs"]:
        nbformat.validate(out, ref="output", version=4)
    error = result["error"]
    if error is not None:
        assert set(error) == {"ename", "evalue", "traceback"}, error
        nbformat.validate(dict(error, output_type="error"), ref="output", version=4)
    return result["outputs"]


def texts(outputs):
    """Compact view of outputs: ("stdout", text) / ("display_data", mime keys) pairs."""
    view = []
    for out in outputs:
        if out["output_type"] == "stream":
            view.append((out["name"], out["text"]))
        else:
            view.append((out["output_type"], tuple(sorted(out["data"]))))
    return view
