"""Know a buffer's blob key without hashing it again, when it has not changed.

A cell runs in a child forked from its state's holder, so the child shares
the holder's memory pages until it writes to them (copy-on-write). The
kernel marks a page the child has written as "exclusively mapped" in
/proc/self/pagemap. A large buffer whose pages are all still shared holds
exactly the bytes it held in the parent state, so it keeps the blob key
recorded for it there: re-pickling a 1 GB DataFrame a cell only read then
costs a page-table scan instead of a SHA-256 pass over every byte.
"""

import os
import weakref

_PAGE = os.sysconf("SC_PAGE_SIZE")
_PRESENT = 1 << 63
_EXCLUSIVE = 1 << 56

# (address, size) of a buffer this process (or its parent) stored -> (blob key,
# weak reference to the array owning it). While the owner lives its memory
# cannot be handed to another object, so a shared page still holds the old bytes.
_known = {}


def _address(view):
    """Start address of a contiguous buffer, or None if it cannot be told."""
    try:
        import numpy
    except ImportError:
        return None
    try:
        return numpy.frombuffer(view, dtype=numpy.uint8).__array_interface__["data"][0]
    except (ValueError, TypeError):
        return None


def remember(view, key):
    """Record that `view` (as stored now) has blob key `key`.

    An array is held by a weak reference (a strong one would change what
    `ndarray.resize` allows); a buffer loaded from the store is not the
    user's object and is held strongly, until `keep_only` drops it.
    """
    if view.nbytes < _PAGE:
        return
    address = _address(view)
    if address is None:
        return
    owner = view.obj
    try:
        ref = weakref.ref(owner)
    except TypeError:
        ref = lambda owner=owner: owner  # noqa: E731 - a strong "reference"
    _known[(address, view.nbytes)] = (key, ref)


def known_key(view):
    """The blob key of `view` if its memory is unchanged since the fork, else None."""
    address = _address(view)
    entry = _known.get((address, view.nbytes))
    if entry is None:
        return None
    key, owner = entry
    alive = owner()
    if alive is None or not _covers(alive, address, view.nbytes):
        del _known[(address, view.nbytes)]
        return None
    return key if _untouched(address, view.nbytes) else None


def keep_only(keys):
    """Forget buffers that are gone or not in the state just made (frees their memory)."""
    for spot in [k for k, (key, owner) in _known.items()
                 if key not in keys or owner() is None]:
        del _known[spot]


def _covers(owner, address, size):
    """True if the owner's memory still spans [address, address+size) (not resized)."""
    try:
        view = memoryview(owner)
    except TypeError:
        return False
    start = _address(view)
    return start is not None and start <= address and address + size <= start + view.nbytes


_pagemap_fd = [None, None]  # (pid, fd): an fd opened before a fork shows the parent's pages


def _pagemap():
    """This process's /proc/self/pagemap, opened once per process."""
    pid = os.getpid()
    if _pagemap_fd[0] != pid:
        if _pagemap_fd[1] is not None:
            os.close(_pagemap_fd[1])  # the parent's, inherited through fork
        _pagemap_fd[:] = [pid, os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)]
    return _pagemap_fd[1]


def _untouched(address, size):
    """True if every page of [address, address+size) is present and still shared."""
    first, last = address // _PAGE, (address + size - 1) // _PAGE
    count = last - first + 1
    try:
        raw = os.pread(_pagemap(), count * 8, first * 8)
    except OSError:
        return False
    if len(raw) != count * 8:
        return False
    import numpy
    entries = numpy.frombuffer(raw, dtype=numpy.uint64)
    present = (entries & numpy.uint64(_PRESENT)) != 0
    exclusive = (entries & numpy.uint64(_EXCLUSIVE)) != 0
    return bool(present.all() and not exclusive.any())
