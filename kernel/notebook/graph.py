"""The dependency graph of a notebook's cells, in either order, and its static errors.

Both orders answer the same questions, per cell (cells are numbered by
position): which cells' results its own depends on (`inputs`); for every
name it needs, which cell's state holds the value it must see (`needs`,
None when no cell gives the name a value); which names it may change
(`changes`, so its state's version of them is its own); which names it is
the source of for later cells (`provides`); and whether it cannot run at
all (`blocked`), with the diagnostics that say why.

"notebook" order is Jupyter's: cells run top to bottom, a name read by a
cell is the value the latest earlier cell that defined, read (a read can
mutate: `df.dropna(inplace=True)`) or deleted it left, and the cell's
inputs are every such cell since the name's last definition.

"dataflow" order is reactive: a cell depends on the cells that define
what it reads, whatever their position, and runs after them (a topological
order, ties by position). A name has one defining cell; two defining cells
(double_definition), a cell rebinding or deleting another cell's name
(foreign_assignment), and cycles are errors, and the cells caught in one do
not run. As in marimo, a cell that mutates another cell's value in place is
not tracked: the value's version stays its defining cell's.

In both orders a global read inside a function runs when the function is
called: a cell that reads a function (or a value made with one) also needs
what that function's body reads, as it is when the cell runs (`closure`).
"""

import builtins
import dataclasses
import heapq

from snapkernel.kernel.notebook.analysis import BUILTINS
from snapkernel.kernel.notebook.model import ORDERS
from snapkernel.kernel.protocol import error


@dataclasses.dataclass
class Graph:
    """The dependencies of a notebook's cells in one order."""

    kind: str               # "notebook" or "dataflow"
    ids: list
    order: list             # cell positions in execution order
    inputs: dict            # position -> positions whose results it depends on
    needs: dict             # position -> {name: position holding its value, or None}
    changes: dict           # position -> names whose value it may change
    provides: dict          # position -> names later cells take from its state
    blocked: dict           # position -> error dict {ename, evalue, traceback}
    diagnostics: list       # [{kind, cells, names, message (, line, column)}]

    def downstream(self, positions):
        """`positions` and every cell whose inputs lead back to one of them."""
        found = set(positions)
        for i in self.order:
            if i not in found and self.inputs.get(i, set()) & found:
                found.add(i)
        return found


def _names(names):
    """Names for a message: 'a', 'b' and 'c'."""
    names = [repr(n) for n in sorted(names)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def build(ids, analyses, order="notebook"):
    """The Graph of cells `ids` with their CellAnalysis list, in `order`."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; use one of {', '.join(ORDERS)}")
    graph = Graph(order, list(ids), [], {}, {}, {}, {}, {}, [])
    for i, a in enumerate(analyses):
        if a.error is not None:
            err = a.error
            where = f" (line {err['line']}, column {err['column']})" if err["line"] else ""
            graph.diagnostics.append({
                "kind": "syntax_error", "cells": [ids[i]], "names": [],
                "message": f"cell {ids[i]!r}: {err['message']}{where}",
                "line": err["line"], "column": err["column"]})
            # The cell's error as running it would show it: the exception's own class
            # (IndentationError, TabError, ...) and its line.
            ename, _, message = err["message"].partition(": ")
            at = f" (line {err['line']})" if err["line"] else ""
            graph.blocked[i] = error(ename if is_parse_error(ename) else "SyntaxError",
                                     f"{message}{at}")
    (_notebook if order == "notebook" else _dataflow)(graph, analyses)
    _block_dependents(graph)
    return graph


def is_parse_error(ename):
    """Whether `ename` names SyntaxError or a subclass of it (the error of a cell that
    does not parse, as opposed to the graph's own: Blocked, Cycle, ...)."""
    cls = getattr(builtins, ename, None)
    return isinstance(cls, type) and issubclass(cls, SyntaxError)


def _block_dependents(graph):
    """A cell whose inputs include a cell that cannot run cannot run either."""
    for i in graph.order:
        if i in graph.blocked:
            continue
        stuck = sorted(p for p in graph.inputs.get(i, ()) if p in graph.blocked)
        if stuck:
            graph.blocked[i] = error("Blocked", f"needs cell {graph.ids[stuck[0]]!r}, which "
                                      f"cannot run")


def _closure(direct, providers, carried):
    """`direct` names plus, transitively, what the function bodies of their providers read."""
    found, todo = set(direct), list(direct)
    while todo:
        name = todo.pop()
        for p in providers(name):
            for more in carried.get(p, ()):
                if more not in found:
                    found.add(more)
                    todo.append(more)
    return found


def _notebook(graph, analyses):
    """Jupyter's order: every earlier cell that touched a name since its last definition."""
    touchers = {}   # name -> cells that defined, read or deleted it since its last definition
    last_def = {}   # name -> position of its last definition
    wild = []       # cells that may bind names the parse does not show
    carried, carried_writes = {}, {}

    def providers(name):
        """The cells whose states may hold `name`'s current value, oldest first."""
        return touchers.get(name, []) + [w for w in wild if w > last_def.get(name, -1)]

    for i, a in enumerate(analyses):
        graph.order.append(i)
        if a.error is not None:
            # It runs nothing; the cells that seem to need it wait for a fix.
            for name in a.probable_defines:
                touchers[name], last_def[name] = [i], i
            graph.inputs[i], graph.needs[i] = set(), {}
            graph.changes[i] = graph.provides[i] = set(a.probable_defines)
            continue
        direct = set(a.reads) | (set(touchers) if a.dynamic else set())
        needs, inputs = {}, set(wild) if a.dynamic else set()
        for name in _closure(direct, providers, carried):
            cells = providers(name)
            if not cells and name in BUILTINS:
                continue
            inputs.update(cells)
            needs[name] = max(cells) if cells else None
        inherited = set().union(*(carried_writes.get(p, ()) for p in inputs))
        carried[i] = set(a.deferred_reads).union(*(carried.get(p, ()) for p in inputs))
        carried_writes[i] = set(a.deferred_writes) | inherited
        changes = set(needs) | a.defines | a.deletes | inherited
        if a.dynamic or a.unknown_writes:
            changes |= set(touchers)
        for name in changes - a.defines:
            touchers.setdefault(name, []).append(i)
        for name in a.defines:
            touchers[name], last_def[name] = [i], i
        if a.unknown_writes:
            wild.append(i)
        graph.inputs[i], graph.needs[i] = inputs, needs
        graph.changes[i] = graph.provides[i] = changes


def _dataflow(graph, analyses):
    """Reactive order: a cell depends on the cells defining what it reads."""
    ids = graph.ids
    owners, modifiers, probable = {}, {}, {}
    for i, a in enumerate(analyses):
        if a.error is not None:
            for name in a.probable_defines:
                probable.setdefault(name, []).append(i)
            continue
        for name in a.assigns:
            owners.setdefault(name, []).append(i)
        for name in (a.augments | a.deletes) - a.assigns:
            modifiers.setdefault(name, []).append(i)
    caught = {}  # position -> error
    clashes = {}  # (kind, defining cells, rebinding cells) -> names
    for name, mods in modifiers.items():
        own = owners.get(name)
        if own:
            clashes.setdefault(("foreign_assignment", tuple(own), tuple(mods)), []).append(name)
        elif len(mods) > 1:
            clashes.setdefault(("double_definition", tuple(mods), ()), []).append(name)
        else:
            owners[name] = mods
    for name, own in owners.items():
        if len(own) > 1:
            clashes.setdefault(("double_definition", tuple(own), ()), []).append(name)
    ambiguous = {}
    for (kind, own, mods), names in sorted(clashes.items(),
                                           key=lambda kv: sorted(kv[0][1] + kv[0][2])):
        cells = sorted(set(own + mods))
        listed = lambda cs: ", ".join(repr(ids[c]) for c in cs)  # noqa: E731
        verb = "is" if len(names) == 1 else "are"
        if kind == "double_definition":
            message = (f"{_names(names)} {verb} defined in cells {listed(own)}: in dataflow "
                       f"order a name is defined in one cell only")
        else:
            message = (f"{_names(names)} {verb} defined in cell {listed(own)} and rebound "
                       f"or deleted in {listed(mods)}: in dataflow order only the defining "
                       f"cell may rebind or delete a name")
        graph.diagnostics.append({"kind": kind, "cells": [ids[c] for c in cells],
                                  "names": sorted(names), "message": message})
        for c in cells:
            caught.setdefault(c, error("DoubleDefinition" if kind == "double_definition"
                                        else "ForeignAssignment", message))
        for name in names:
            ambiguous[name] = kind
    definer = {n: own[0] for n, own in owners.items() if n not in ambiguous}
    wild = [i for i, a in enumerate(analyses) if a.error is None and a.unknown_writes]
    defined_at = {}  # position -> names defined by the cells before it
    seen = set()
    for i, a in enumerate(analyses):
        defined_at[i] = set(seen)
        if a.error is None:
            seen |= a.assigns | a.augments

    def providers(name):
        """The cell defining `name`, or the cells that may bind anything."""
        if name in definer:
            return [definer[name]]
        return [] if name in ambiguous else wild

    carried = {i: a.deferred_reads for i, a in enumerate(analyses) if a.error is None}
    edges_by = {}  # position -> {name: definer} over the names it reads from other cells
    for i, a in enumerate(analyses):
        graph.inputs[i], graph.needs[i] = set(), {}
        graph.provides[i] = set(a.assigns | a.augments | a.deletes | a.deferred_writes)
        # Mutations in place of another cell's values are not tracked here (as in
        # marimo): a value's version is its defining cell's.
        graph.changes[i] = set(graph.provides[i])
        if a.error is not None:
            graph.provides[i] = graph.changes[i] = set()
            continue
        own = a.assigns | a.augments | a.deletes
        direct = set(a.reads) | (defined_at[i] if a.dynamic else set())
        waits = []
        for name in _closure(direct, providers, carried) - own:
            if name in ambiguous:
                waits.append(name)
                continue
            cells = providers(name)
            if not cells and name in BUILTINS:
                continue
            if not cells and name in probable:
                graph.inputs[i].update(probable[name])  # a cell that does not parse yet
            graph.inputs[i].update(cells)
            graph.needs[i][name] = max(cells) if cells else None
        if a.dynamic:
            graph.inputs[i].update(j for j in range(i) if analyses[j].error is None)
        graph.inputs[i].discard(i)
        edges_by[i] = {n: p for n, p in graph.needs[i].items() if p is not None}
        if waits and i not in caught:
            caught[i] = error("Blocked", f"reads {_names(waits)}, defined in more than one cell")
    _order_and_cycles(graph, analyses, edges_by, caught)
    for i, err in caught.items():
        graph.blocked.setdefault(i, err)


def _order_and_cycles(graph, analyses, edges_by, caught):
    """Topological order (ties by position) of the strongly connected components; each
    component of more than one cell is a cycle diagnostic."""
    n = len(analyses)
    components = _strongly_connected(n, graph.inputs)
    comp_of = {c: k for k, comp in enumerate(components) for c in comp}
    for comp in components:
        if len(comp) < 2:
            continue
        members = set(comp)
        names = sorted({name for c in comp for name, p in edges_by.get(c, {}).items()
                        if p in members})
        ids = [graph.ids[c] for c in sorted(comp)]
        message = (f"cells {', '.join(repr(x) for x in ids)} form a cycle through "
                   f"{_names(names)}: each needs another's result first")
        graph.diagnostics.append({"kind": "cycle", "cells": ids, "names": names,
                                  "message": message})
        for c in comp:
            caught.setdefault(c, error("Cycle", message))
    # Kahn's algorithm over components, the one with the earliest cell first.
    after = {k: set() for k in range(len(components))}
    waiting = {k: 0 for k in range(len(components))}
    for i in range(n):
        for p in graph.inputs[i]:
            a, b = comp_of[p], comp_of[i]
            if a != b and b not in after[a]:
                after[a].add(b)
                waiting[b] += 1
    ready = [(min(components[k]), k) for k in waiting if waiting[k] == 0]
    heapq.heapify(ready)
    while ready:
        _, k = heapq.heappop(ready)
        graph.order.extend(sorted(components[k]))
        for b in after[k]:
            waiting[b] -= 1
            if waiting[b] == 0:
                heapq.heappush(ready, (min(components[b]), b))


def _strongly_connected(n, inputs):
    """Tarjan's components of the graph cell <- inputs, iteratively (no recursion limit)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for root in range(n):
        if root in index:
            continue
        work = [(root, iter(sorted(inputs.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(inputs.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                components.append(comp)
    return components
