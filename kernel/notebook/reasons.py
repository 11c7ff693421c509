"""Why a cell of a notebook run runs, which failures a run keeps, and what a reused
result cannot know from the code (the clock, an unseeded generator).

Pure functions over the plan, the graph, the previous record of the notebook and
the stored results: the run (incremental.py) puts their answer in each cell's
`reason` ({"kind", "message"}) and its progress lines. docs/notebook-runs.md,
"Why a cell runs", says what each kind means.
"""

import builtins
import hashlib

# The kinds of reason a cell that runs is given, most telling first.
REASONS = ("rerun", "volatile", "input_ran", "wrote_file", "new", "failed_before",
           "result_gone", "source_changed", "environment_changed", "module_changed",
           "input_changed", "file_changed", "key_changed")
# The notes of a reused cell whose result its code does not determine.
NOTES = ("reads_clock", "unseeded_random")

# Failures that may come from the world outside a cell's key: the network, a file
# the read tracking does not see (a C library's, another process's), the machine's
# memory, an interrupt or a timeout. A failure allow_errors lets pass is stored and
# reused like any result unless its exception is one of these (by class name: the
# worker reports no more), so the next run tries such a cell again.
RETRIED = frozenset(
    {c.__name__ for c in vars(builtins).values()
     if isinstance(c, type) and issubclass(c, OSError)} | {
        "MemoryError", "KeyboardInterrupt", "SystemExit", "Timeout", "StoreFull",
        # socket, ssl, urllib, http.client
        "gaierror", "herror", "timeout", "SSLError", "SSLCertVerificationError",
        "URLError", "HTTPError", "HTTPException", "RemoteDisconnected", "IncompleteRead",
        # requests, urllib3, httpx, aiohttp
        "RequestException", "ConnectTimeout", "ReadTimeout", "ProxyError",
        "ChunkedEncodingError", "TooManyRedirects", "NewConnectionError", "MaxRetryError",
        "ProtocolError", "ConnectError", "TimeoutException", "ClientError",
        "ClientConnectorError", "ServerDisconnectedError",
        # databases opened by their C libraries
        "OperationalError", "DatabaseError", "InterfaceError"})


def reason(kind, message):
    """A cell's reason: {"kind", "message"}."""
    return {"kind": kind, "message": message}


def retried(failure):
    """True when a failure (an error dict) is one the next run must try again."""
    return failure is not None and failure.get("ename") in RETRIED


def basis(source, parts, needs):
    """What a result records of its key's parts, for the next run to say what changed:
    the source's hash, the interpreter and rules, the installed distributions' digest,
    the local modules' hashes and {name: key of the cell giving it} (`parts`:
    keys.cell_parts)."""
    return {"source": hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest(),
            "interpreter": parts["interpreter"], "rules": parts["rules"],
            "environment": parts["environment"],
            "local_modules": {**parts.get("local_modules", {}), **parts.get("run_files", {})},
            "needs": needs}


def why(i, graph, plan, rerun, ran, key, before, old, now, content):
    """The reason cell i runs.

    `plan`: planner.Plan; `rerun`: the positions `rerun` named; `ran`: the
    positions that ran so far in this run; `key`: the cell's key now;
    `before`: its cell in the notebook's previous record (a dict, or None);
    `old`: the stored result under the key it had then (None: gone); `now`:
    its basis() now; `content(path)`: what a file holds now.
    """
    ids = graph.ids
    if i in plan.forced:
        if i in rerun:
            return reason("rerun", "rerun asked for it")
        up = min(p for p in rerun if i in graph.downstream([p]))
        return reason("rerun", f"rerun asked for cell {ids[up]!r}, which it depends on")
    if before is None or not before.get("key"):
        return reason("new", "no result is stored under its key (it has not run before)")
    if i in plan.for_volatile:
        p = plan.for_volatile[i]
        return reason("volatile", f"cell {ids[p]!r} runs and needs a value it made that "
                                  f"cannot be stored (a volatile value)")
    # A cell run again for its volatile values gives its dependents nothing new.
    inputs = sorted(graph.inputs[i] & ran - set(plan.for_volatile))
    if inputs:
        return reason("input_ran", f"cell {ids[inputs[0]]!r}, which it depends on, ran")
    if i in plan.refreshed:
        return reason("wrote_file", "a file it writes is gone or changed, or another cell "
                                    "writing it runs")
    if before["key"] == key:
        if before.get("status") == "failed":
            failure = before.get("error") or {}
            text = f"{failure.get('ename')}: {(failure.get('evalue') or '')[:60]}"
            return reason("failed_before", f"it failed last time ({text}), and a failure "
                          f"that may come from outside its key is not kept: tried again"
                          if retried(failure) else
                          f"it failed last time ({text}) in a run that stopped there")
        return reason("result_gone", "its stored result is gone (deleted, or its state was "
                                     "evicted)")
    then = (old or {}).get("basis")
    if not then:
        return reason("key_changed", "its key changed: its source, an input, the "
                                     "environment or a file it reads")
    if then["source"] != now["source"]:
        return reason("source_changed", "its source changed")
    if (then["interpreter"], then["rules"]) != (now["interpreter"], now["rules"]):
        return reason("environment_changed", "the interpreter or the rules of keys changed")
    if then["environment"] != now["environment"]:
        return reason("environment_changed", "the installed packages changed")
    modules = sorted(m for m in set(then["local_modules"]) | set(now["local_modules"])
                     if then["local_modules"].get(m) != now["local_modules"].get(m))
    if modules:
        return reason("module_changed", f"a module of the notebook's folder it imports "
                                        f"(or a file it %runs) changed: "
                                        f"{', '.join(modules)}")
    names = sorted(n for n in set(then["needs"]) | set(now["needs"])
                   if then["needs"].get(n) != now["needs"].get(n))
    if names:
        giver = graph.needs[i].get(names[0])
        source = f"cell {ids[giver]!r}" if giver is not None else "no cell"
        return reason("input_changed", f"the cell giving it {names[0]!r} changed ({source} "
                                       f"now)")
    files = sorted(p for p, digest in (old.get("reads") or {}).items() if content(p) != digest)
    if files:
        return reason("file_changed", f"a file it reads changed: {', '.join(files[:3])}"
                                      f"{' ...' if len(files) > 3 else ''}")
    return reason("key_changed", "its key changed (the files it reads, or what the cells "
                                 "before it wrote)")


def note(analyses, i, created):
    """The note of reused cell i (analysis.CellAnalysis of every position) whose result
    was stored at `created`, when its code reads the clock or an unseeded generator;
    else None."""
    a = analyses[i]
    created = f"{created[:16].replace('T', ' ')} UTC" if created else "an earlier run"
    if a.clock:
        return reason("reads_clock", f"it reads the clock ({', '.join(sorted(a.clock))}): "
                                     f"its stored result is from {created}; rerun it for "
                                     f"the time now")
    seeded = set().union(*(analyses[p].seeds for p in range(i + 1)))
    draws = sorted(call for generator, call in a.draws if generator not in seeded)
    if draws:
        return reason("unseeded_random", f"it draws from an unseeded generator "
                                         f"({', '.join(draws)}): its stored numbers are "
                                         f"those of a run at {created}; rerun it for "
                                         f"new ones")
    return None
