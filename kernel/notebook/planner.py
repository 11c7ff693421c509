"""What a notebook run does: the keys, which cells run and which are reused, the states
to compose. Pure functions over the graph and what the store holds.

A cell runs when no result is stored under its key, when `rerun` names it
or a cell upstream of it, or when a cell it depends on runs; otherwise its
stored result (outputs, execution count, state) is reused.

A value that cannot be stored (a generator, a socket) is *volatile*: the
stored state only says which cell made it. So when a cell that must run
needs such a value, the cells that made it (the maker and every later
cell that touched it) run again, in order, just before it, and only then.
Their dependents are not run for that: the re-run gives the same result.

The state a cell runs in is composed from its inputs' states: for every
name it needs, the version the cell that gives it left. Each state's
*provenance* says, for each of its names, the key of the cell that last
touched it; a state whose provenance matches every needed name can be run
from as it is, otherwise the mismatched names are taken from the states
that hold the right versions (`compose`). Its process context (the
generators, settings, folder... kernel/worker/context.py) is what a Run
All's process would have there: that of the state of the cell taken just
before it, so only a state with that same context is a base; the others
only give it names.
"""

import dataclasses

from snapkernel.kernel.notebook import keys as keys_mod
from snapkernel.storage import snapshot

# A provenance entry for a name whose origin is not known: it matches no key.
UNKNOWN = "?"


def cell_keys(graph, sources, analyses, environment, folder=None):
    """{position: key} in execution order; None for a cell that cannot run. `folder`:
    the notebook's, whose module files the cells importing them hash too."""
    return CellKeys(graph, sources, analyses, environment, folder).compute()[0]


class CellKeys:
    """The keys of a notebook's cells, computed again as cells run and show which files
    they read: what a key hashes but its inputs' keys is found once."""

    def __init__(self, graph, sources, analyses, environment, folder=None):
        """Key the cells of `graph` (see cell_keys)."""
        self.graph = graph
        self.parts = {i: keys_mod.cell_parts(sources[i], analyses[i], environment, folder)
                      for i in graph.order if i not in graph.blocked}

    def compute(self, files=None, fixed=None):
        """({position: key}, {position: key before files}) in execution order; None for a
        cell that cannot run.

        `files` (kernel/notebook/inputs.py RunFiles) knows which files each
        cell read and wrote when it last ran: a cell's key covers what the
        files it read hold, or, for a file an earlier cell of the notebook
        wrote, that cell's key and the bytes it left. `fixed`: {position: (key,
        key before files)} of cells whose keys are settled (taken by the run).
        """
        graph = self.graph
        found, static = {}, {}
        written = {}  # path -> [key of the last cell so far that wrote it, its bytes]
        for i in graph.order:
            if i in graph.blocked:
                found[i] = static[i] = None
                continue
            if fixed and i in fixed:
                found[i], static[i] = fixed[i]
            elif files is None:
                found[i] = static[i] = self._static(i, found)
                continue
            else:
                static[i] = self._static(i, found)
                seen = {path: ["written", *written[path]] if path in written else
                        files.content(path) for path in files.reads(i, static[i])}
                found[i] = keys_mod.file_key(static[i], seen)
            for path, digest in files.writes(i, static[i], found[i]).items():
                written[path] = [found[i], digest]
        return found, static

    def _static(self, i, found):
        """The key before files of cell i, given the keys `found` of the cells before."""
        graph = self.graph
        needs = {n: None if p is None else found[p] for n, p in graph.needs[i].items()}
        return keys_mod.cell_key(self.parts[i], needs, [found[p] for p in graph.inputs[i]])


@dataclasses.dataclass
class Plan:
    """Which cells run, in which order they are taken, and why."""

    sequence: list       # positions in the order the run takes them
    run: set             # positions that run
    for_volatile: dict   # position -> the position whose run needs its volatile values
    forced: set = dataclasses.field(default_factory=set)     # by `rerun` (and downstream)
    refreshed: set = dataclasses.field(default_factory=set)  # for the files they write


def plan(graph, keys, stored, rerun=(), refresh=()):
    """The Plan for a graph, its keys and `stored` {key: volatile names of the stored result}.

    `rerun` are positions to run with everything downstream of them;
    `refresh` are positions to run for their effect on files (what they
    wrote is gone or changed), not their dependents for that.
    """
    forced = graph.downstream(rerun)
    run = set()
    for i in graph.order:
        if i in graph.blocked:
            continue
        if i in forced or keys[i] not in stored or graph.inputs[i] & run:
            run.add(i)
    refreshed = set(refresh) - set(graph.blocked)
    run |= refreshed
    for_volatile = {}

    def refresh(i):
        """Run again the reused cells whose volatile values `i` needs (and theirs)."""
        for name, p in sorted(graph.needs[i].items(), key=lambda kv: kv[0]):
            if p is None or p in run or p in for_volatile:
                continue
            if name in stored.get(keys[p], ()):
                for_volatile[p] = i
                refresh(p)

    rank = {p: n for n, p in enumerate(graph.order)}
    for i in graph.order:
        if i in run:
            refresh(i)
    sequence, placed = [], set()
    for i in graph.order:
        if i in for_volatile:
            continue
        if i in run:
            chain = sorted((p for p, wanted in for_volatile.items()
                            if _needed_by(p, i, for_volatile) and p not in placed),
                           key=rank.get)
            sequence.extend(chain)
            placed.update(chain)
        sequence.append(i)
    return Plan(sequence, run | set(for_volatile), for_volatile, forced, refreshed)


def _needed_by(p, i, for_volatile):
    """True when p runs again for i, directly or through another re-run cell."""
    while p in for_volatile:
        p = for_volatile[p]
        if p == i:
            return True
    return False


def required_versions(needs, states):
    """{name: the key its value must come from, or None (absent)} and {name: source state}.

    `needs` maps names to the position giving them (or None); `states`
    maps positions to their (state name, provenance, volatile names).
    """
    required, sources = {}, {}
    for name, p in needs.items():
        if p is None:
            required[name] = None
            continue
        state, provenance, _ = states[p]
        required[name] = provenance.get(name)
        sources[name] = state
    return required, sources


def compose(required, sources, candidates, volatile=(), exact=False, live=(), preferred=None,
            bases=None):
    """How to make a state holding `required` versions from the states at hand.

    `candidates` are (state name, provenance) pairs, best first when they
    match equally; `bases`, when given, the names of those that may be the
    base (the others only give names to it). Returns (base state, takes, drops): run from `base` after
    taking, for each (source state, names) of `takes`, those names from that
    state, and removing `drops`. The base is the candidate matching the most
    names (names in `volatile` count most: they are live only in the state
    that made them, and taken from another state they would be recomputed),
    then a state in `live` (with a live holder) that holds any name, then
    the `preferred` one (the previous cell's: a cell that reads nothing runs
    on from it rather than from the empty `initial`, so that the cells after
    it find what they read). The rest is taken from as few states as can
    give it. With `exact`, names not in `required` are dropped too.
    """
    def holds(candidate, name):
        """True when the candidate state has the required version of `name`."""
        state, prov = candidate
        if sources.get(name) == state:
            return True
        version = required[name]
        return prov.get(name) == version and version != UNKNOWN

    def score(candidate):
        """How many required names a candidate holds in the right version; then whether
        it is live and not empty; then whether it is the preferred one."""
        held = sum(1 + (len(required) + 1) * (name in volatile)
                   for name in required if holds(candidate, name))
        return held, candidate[0] in live and bool(candidate[1]), candidate[0] == preferred

    best = max((c for c in candidates if bases is None or c[0] in bases),
               key=score)  # max keeps the first of equals
    base, prov = best
    missing = {n for n in required if not holds(best, n)}
    drops = {n for n in missing if required[n] is None}
    missing -= drops
    takes = []
    while missing:
        giver = max(candidates, key=lambda c: sum(holds(c, n) for n in missing))
        names = {n for n in missing if holds(giver, n)}
        if not names:  # only its source has it (an unknown origin): take it from there
            giver = next(c for c in candidates if c[0] == sources[min(missing)])
            names = {n for n in missing if holds(giver, n)}
        takes.append((giver[0], sorted(names)))
        missing -= names
    if exact:
        drops |= set(prov) - set(required)
    return base, takes, sorted(drops)


def merged_manifest(name, base, parts, drops, auto_named=False):
    """The manifest of a state made of whole alias groups of other states, no process
    needed: `base`'s names but the `drops` and those taken, and for each (manifest,
    names) of `parts` those names. None when a name would leave part of its alias
    group behind: only a worker (Registry.rebuild) can split a group.
    """
    taken = set().union(*(set(names) for _, names in parts))
    merged = snapshot.new_manifest(name, base, "", base["execution_count"], auto_named)
    for origin, wanted in [(base, set(base["variables"]) - taken - set(drops))] + [
            (manifest, set(names)) for manifest, names in parts]:
        groups = [g for g in origin["groups"] if not wanted.isdisjoint(g["members"])]
        if any(not set(g["members"]) <= wanted for g in groups):
            return None
        snapshot.carry(merged, origin, groups, [n for n in origin["modules"] if n in wanted],
                       [n for n in origin["volatile"] if n in wanted])
    return merged
