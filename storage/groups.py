"""Alias groups: which notebook variables share mutable objects.

Two variables are in one group when their object graphs meet in an object
whose identity matters (a list, a dict, an instance, a numpy buffer...).
A group is pickled under one memo, so the sharing survives a restore.
Classes, modules and function globals are not followed: every instance
refers to its class, and every function to the whole namespace, which
would otherwise put everything into one group.
"""

import gc
import sys
import types

# Objects whose identity never matters: equal values are interchangeable.
_ATOMS = (int, float, complex, str, bytes, bool, type(None), range, slice,
          type(Ellipsis), type(NotImplemented))
_SKIP = (type, types.ModuleType, types.CodeType, types.BuiltinFunctionType,
         types.FrameType, types.GetSetDescriptorType, types.MemberDescriptorType,
         types.WrapperDescriptorType, types.MethodDescriptorType)


def _identity_keys(value, namespace):
    """Yield the ids of the identity-bearing objects reachable from `value`."""
    ndarray = getattr(sys.modules.get("numpy"), "ndarray", None)
    seen = set()
    stack = [value]
    while stack:
        obj = stack.pop()
        if isinstance(obj, _ATOMS) or isinstance(obj, _SKIP) or obj is namespace:
            continue
        key = id(obj)
        if key in seen:
            continue
        seen.add(key)
        if ndarray is not None and isinstance(obj, ndarray):
            # Views share memory through their base: key them on the root.
            root = obj
            while isinstance(root.base, ndarray):
                root = root.base
            yield ("buf", id(root))
            if obj.dtype.hasobject:
                stack.extend(obj.ravel().tolist())
            continue
        yield ("obj", key)
        if isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if filled(c))
            stack.extend(obj.__defaults__ or ())
            stack.extend((obj.__kwdefaults__ or {}).values())
            stack.append(obj.__dict__)
            continue
        if isinstance(obj, (tuple, frozenset)) and not gc.is_tracked(obj):
            continue
        stack.extend(gc.get_referents(obj))


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
    owner = {}
    parent = {name: name for name in values}

    def find(name):
        """Union-find root with path halving."""
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for name, value in values.items():
        for key in _identity_keys(value, namespace):
            other = owner.setdefault(key, name)
            if other != name:
                a, b = find(other), find(name)
                if a != b:
                    parent[a] = b
    groups = {}
    for name in values:
        groups.setdefault(find(name), []).append(name)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])
