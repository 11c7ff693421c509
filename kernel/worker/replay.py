"""Recomputing volatile variables: values no pickler can store (generators, sockets).

A volatile variable is listed in its state's manifest with the code of the
cell that made it. When a restored state needs it, that cell runs again, as
any cell does (IPython syntax, output capture, the cell limits), in a
shallow copy of the restored namespace; only its volatile names are taken
back, and what it printed is dropped. Restoring a state never acts on the
world, so the replay runs sealed (storage/guard.py): a cell that would write a
file, start a process or connect cannot recompute its values, and says so.
"""

from snapkernel.kernel.worker import execution, limits
from snapkernel.storage import guard


class ReplayFailed(Exception):
    """Replaying the cell that made a volatile variable failed."""


def volatile(manifest, namespace, settings, names=None):
    """Recompute the volatile variables `names` (all when None) of `manifest` into `namespace`."""
    by_code = {}
    for name, record in manifest["volatile"].items():
        if names is None or name in names:
            by_code.setdefault(record["code"], []).append(name)
    for code, wanted in by_code.items():
        scratch = dict(namespace)
        cell = execution.compile_cell(code, manifest["execution_count"])
        with guard.sealed():
            _, error = limits.run_limited(cell, scratch, manifest["execution_count"],
                                          settings)
        missing = [n for n in wanted if n not in scratch]
        if error is None and not missing:
            namespace.update({n: scratch[n] for n in wanted})
            continue
        why = (f"raised {error['ename']}: {error['evalue']}" if error else
               f"did not define {', '.join(missing)}")
        raise ReplayFailed(
            f"cannot recompute volatile variable(s) {', '.join(wanted)}: replaying the "
            f"cell that made them ({code[:200]!r}) {why}")
