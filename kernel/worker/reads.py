"""Which global names a cell may read, write or delete, found from its code.

No hooks on the namespace (they make every global lookup a Python call):
the names come from the bytecode of the cell, its nested code, and the
notebook-defined functions, classes and methods the cell can reach. The
answer may over-approximate, never miss: where reads cannot be known from
the code (`globals()`, `eval`, `sys.modules`, frame inspection, pandas
`query`/`eval` strings, IPython magics), the cell is marked dynamic and
every name counts as read. A name written in a string constant counts as
read (a formula evaluated by patsy reads the caller's names).
"""

import dis
import gc
import re
import sys
import types

from snapkernel.storage.groups import filled

# Builtins and attributes through which code can reach any global by name.
DYNAMIC_NAMES = frozenset({
    "globals", "vars", "locals", "dir", "eval", "exec", "__import__",
    "get_ipython", "breakpoint", "help"})
DYNAMIC_ATTRS = frozenset({
    "f_globals", "f_locals", "f_back", "__globals__", "modules", "_getframe",
    "currentframe", "query", "eval", "tb_frame", "gi_frame", "cr_frame"})
_LOADS = frozenset({"LOAD_NAME", "LOAD_GLOBAL", "LOAD_CLASSDEREF",
                    "LOAD_FROM_DICT_OR_GLOBALS"})
_STORES = frozenset({"STORE_NAME", "STORE_GLOBAL", "DELETE_NAME", "DELETE_GLOBAL"})
_ATTRS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "LOAD_SUPER_ATTR"})
# Objects visited while looking for notebook code inside values, before
# giving up and treating the cell as dynamic.
_REACH_BUDGET = 200_000

_code_cache = {}
# Names that a string constant of the cell may read when a library evaluates it (up to
# this many characters: longer ones are text, not expressions).
_IDENTIFIER = re.compile(r"[^\W\d]\w*")
_STRING_MAX = 2000


def _scan(code):
    """(loads, stores, dynamic, imports) of one code object and its nested code, cached;
    imports: the top-level packages it imports."""
    found = _code_cache.get(code)
    if found is not None:
        return found
    loads, stores, dynamic, imports = set(), set(), False, set()
    stack = [code]
    while stack:
        co = stack.pop()
        for ins in dis.get_instructions(co):
            op = ins.opname
            if op in _LOADS:
                loads.add(ins.argval)
                dynamic |= ins.argval in DYNAMIC_NAMES
            elif op in _STORES:
                stores.add(ins.argval)
            elif op in _ATTRS:
                dynamic |= ins.argval in DYNAMIC_ATTRS
            elif op == "IMPORT_NAME":
                dynamic |= ins.argval == "__main__"
                imports.add(ins.argval.partition(".")[0])
        for const in co.co_consts:
            if isinstance(const, types.CodeType):
                stack.append(const)
            elif isinstance(const, str) and len(const) <= _STRING_MAX:
                # A library may evaluate a string in the caller's namespace: a patsy or
                # statsmodels formula ("y ~ np.log(x)") reads `np` and `x` from there.
                loads.update(_IDENTIFIER.findall(const))
    found = _code_cache[code] = (frozenset(loads), frozenset(stores), dynamic,
                                 frozenset(imports))
    return found


class Analysis:
    """What a cell may touch: names read, names written or deleted, dynamic; and the
    top-level packages it imports."""

    def __init__(self, reads, writes, dynamic, imports=frozenset()):
        """Hold the result."""
        self.reads = reads
        self.writes = writes
        self.dynamic = dynamic
        self.imports = imports


def _notebook_code(value, namespace, budget):
    """Code objects of notebook functions and classes reachable from `value`.

    Returns (codes, exhausted). Function globals, modules and non-notebook
    classes are not followed.
    """
    ndarray = getattr(sys.modules.get("numpy"), "ndarray", None)
    codes, seen, stack = [], set(), [value]
    while stack:
        obj = stack.pop()
        if isinstance(obj, (int, float, complex, str, bytes, bool, type(None))):
            continue
        if id(obj) in seen or obj is namespace or isinstance(obj, types.ModuleType):
            continue
        seen.add(id(obj))
        budget -= 1
        if budget <= 0:
            return codes, True
        if isinstance(obj, types.FunctionType):
            if obj.__globals__ is namespace:
                codes.append(obj.__code__)
            stack.extend(c.cell_contents for c in obj.__closure__ or () if filled(c))
            stack.extend(obj.__defaults__ or ())
            continue
        if isinstance(obj, type):
            if obj.__module__ == "__main__":
                for klass in obj.__mro__:
                    if klass.__module__ == "__main__":
                        stack.extend(vars(klass).values())
            continue
        if isinstance(obj, (staticmethod, classmethod, types.MethodType)):
            stack.append(obj.__func__)
            stack.append(getattr(obj, "__self__", None))
            continue
        if isinstance(obj, property):
            stack.extend((obj.fget, obj.fset, obj.fdel))
            continue
        if ndarray is not None and isinstance(obj, ndarray):
            if obj.dtype.hasobject:
                stack.extend(obj.ravel().tolist())
            continue
        kind = type(obj)
        if kind.__module__ == "__main__":
            stack.append(kind)
        if gc.is_tracked(obj):
            stack.extend(gc.get_referents(obj))
    return codes, False


def analyse(codes, namespace, names_before):
    """Reads and writes of `codes` run in `namespace`, over the names that existed.

    `names_before` are the user names of the state (loaded or not); only
    those can be "read". A read of a notebook function or class adds what
    its code reads and writes, transitively.
    """
    loads, stores, dynamic, imports = set(), set(), False, set()
    pending = list(codes)
    done_codes, done_names = set(), set()
    budget = _REACH_BUDGET
    while pending and not dynamic:
        code = pending.pop()
        if code in done_codes:
            continue
        done_codes.add(code)
        cl, cs, cd, ci = _scan(code)
        loads |= cl
        stores |= cs
        dynamic |= cd
        imports |= ci
        for name in cl - done_names:
            done_names.add(name)
            if name in namespace:
                found, exhausted = _notebook_code(namespace[name], namespace, budget)
                dynamic |= exhausted
                pending.extend(found)
    user = {n for n in names_before if not (n.startswith("__") and n.endswith("__"))}
    if dynamic:
        return Analysis(set(user), set(user) | stores, True)
    return Analysis(loads & user, stores, False, imports)
