"""Alias groups: which notebook variables share mutable objects.

Two variables are in one group when their object graphs meet in an object
whose identity matters (a list, a dict, an instance, a numpy buffer...).
A group is pickled under one memo, so the sharing survives a restore.
Classes, modules and function globals are not followed: every instance
refers to its class, and every function to the whole namespace, which
would otherwise put everything into one group.

pandas objects share internals that no user-visible write can reach:
Index objects and dtypes (immutable), and, under copy-on-write (always on
from pandas 3), the blocks and buffers two frames share until one of them
is written (pandas copies first; `to_numpy()` of a shared block is read
only). Such an object joins two variables only when one of them reaches it
other than through pandas internals: `a = np.arange(3)` with
`s = pd.Series(a, copy=False)` is one group (writing `a` shows in `s`);
`clean` and `df = clean.assign(...)` are two. Two frames stored apart no
longer share their Index after a restore, so renaming one's index
(`df.index.name = ...`, which pandas does in place) then leaves the other's.
"""

import gc
import sys
import types
import weakref

# Objects whose identity never matters: equal values are interchangeable.
_ATOMS = (int, float, complex, str, bytes, bool, type(None), range, slice,
          type(Ellipsis), type(NotImplemented))
_SKIP = (type, types.ModuleType, types.CodeType, types.BuiltinFunctionType,
         types.FrameType, types.GetSetDescriptorType, types.MemberDescriptorType,
         types.WrapperDescriptorType, types.MethodDescriptorType)


def _pandas_guard():
    """A test: does this object start pandas internals that cannot join variables?

    None when pandas is not imported (then nothing is guarded).
    """
    pandas = sys.modules.get("pandas")
    if pandas is None:
        return None
    cow = (int(pandas.__version__.split(".")[0]) >= 3
           or pandas.options.mode.copy_on_write is True)
    if cow:
        return lambda obj: type(obj).__module__.partition(".")[0] in ("pandas", "pyarrow")
    return lambda obj: isinstance(obj, pandas.Index)


def _dtypes():
    """numpy's and pandas' dtype classes: immutable values, shared by every array of
    a type, so their identity never matters either."""
    found = []
    numpy, pandas = sys.modules.get("numpy"), sys.modules.get("pandas")
    if numpy is not None:
        found.append(numpy.dtype)
    if pandas is not None:
        found.append(pandas.api.extensions.ExtensionDtype)
    return tuple(found)


def _identity_keys(value, namespace):
    """Yield (key, guarded) for the identity-bearing objects reachable from `value`.

    `guarded`: reached only through pandas internals (see the module doc).
    """
    ndarray = getattr(sys.modules.get("numpy"), "ndarray", None)
    starts_guard = _pandas_guard()
    atoms = _ATOMS + _dtypes()
    seen = {}  # id -> guarded when visited; a plain path visits a guarded object again
    stack = [(value, False)]
    while stack:
        obj, guarded = stack.pop()
        if isinstance(obj, atoms) or isinstance(obj, _SKIP) or obj is namespace:
            continue
        if guarded and type(obj) is weakref.ReferenceType:
            # pandas keeps a weak reference per view a frame's block ever had (copy-on-write
            # bookkeeping): 186 of the 288 objects of the nb workload's `df`. A weak
            # reference holds nothing, and no variable holds pandas' own plainly.
            continue
        key = id(obj)
        if key in seen and (guarded or not seen[key]):
            continue
        seen[key] = guarded
        if ndarray is not None and isinstance(obj, ndarray):
            # Views share memory through their base: key them on the root.
            root = obj
            while isinstance(root.base, ndarray):
                root = root.base
            yield ("buf", id(root)), guarded
            if obj.dtype.hasobject:
                # The elements are the user's objects, even inside pandas (but pandas'
                # own: dtypes, Timestamps... in an object column or index).
                stack.extend((item, guarded and starts_guard(item))
                             for item in obj.ravel().tolist())
            continue
        yield ("obj", key), guarded
        if isinstance(obj, types.FunctionType):
            stack.extend((c.cell_contents, guarded)
                         for c in obj.__closure__ or () if filled(c))
            stack.extend((d, guarded) for d in obj.__defaults__ or ())
            stack.extend((d, guarded) for d in (obj.__kwdefaults__ or {}).values())
            stack.append((obj.__dict__, guarded))
            continue
        if isinstance(obj, (tuple, frozenset)) and not gc.is_tracked(obj):
            continue
        inside = guarded or (starts_guard is not None and starts_guard(obj))
        stack.extend((ref, inside) for ref in gc.get_referents(obj))


def filled(cell):
    """True if a closure cell holds a value."""
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def alias_groups(values, namespace):
    """Partition `values` ({name: value}) into sorted lists of aliased names.

    Every name is in exactly one group; groups are ordered by first member.
    """
    if len(values) < 2:
        return [[name] for name in values]  # nothing to share with: skip the walk
    owner = {}     # key -> the first name that reached it plainly
    guarded = {}   # key -> names that reached it through pandas internals only
    parent = {name: name for name in values}

    def find(name):
        """Union-find root with path halving."""
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    def union(a, b):
        """Put names a and b in one group."""
        a, b = find(a), find(b)
        if a != b:
            parent[a] = b

    for name, value in values.items():
        for key, inside in _identity_keys(value, namespace):
            if inside:
                names = guarded.setdefault(key, [])
                if not names or names[-1] != name:
                    names.append(name)
            else:
                union(owner.setdefault(key, name), name)
    # An object reached plainly by one variable joins every variable reaching it.
    for key, names in guarded.items():
        first = owner.get(key)
        if first is not None:
            for name in names:
                union(first, name)
    groups = {}
    for name in values:
        groups.setdefault(find(name), []).append(name)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])
