"""Know a buffer's blob key without hashing it again, when it has not changed.

A cell runs in a child forked from its state's holder, so the child shares
the holder's memory pages until it writes to them (copy-on-write). The
kernel marks a page the child has written as "exclusively mapped" in
/proc/self/pagemap. A large buffer whose pages are all still shared holds
exactly the bytes it held in the parent state, so it keeps the blob key
recorded for it there: re-pickling a 1 GB DataFrame a cell only read then
costs a page-table scan instead of a SHA-256 pass over every byte.

In a notebook run the next cell runs in the process that made the state
before it, with no fork in between, so every page is exclusive. There a
chunk's XXH3-128 of its bytes when stored vouches for it instead: a pass
about twenty times cheaper than SHA-256, and 2^-128 the chance that a
changed chunk matches by accident. The same digest names a chunk made again
with bytes already stored (a value a re-run cell makes anew), wherever its
memory is now.

Buffers restored from the store are allocated here too, in transparent huge
pages as numpy allocates its own large arrays: every fork of a holder
copies one page-table entry per page, so a restored 1 GB array costs a
fork 19 ms in 4 KB pages and 1 ms in 2 MB ones.
"""

import contextlib
import mmap
import os
import sys
import weakref

import xxhash

from snapkernel.storage import threads

_PAGE = os.sysconf("SC_PAGE_SIZE")
_PRESENT = 1 << 63
_EXCLUSIVE = 1 << 56

# Buffers this large get huge pages (numpy's threshold for its arrays).
_HUGE_MIN = 4 * 2 ** 20

# (address, size) of a buffer this process (or its parent) stored -> (blob key,
# weak reference to the array owning it, XXH3-128 of its bytes or None). While the
# owner lives its memory cannot be handed to another object, so a shared page
# still holds the old bytes.
_known = {}

# XXH3-128 of a chunk this process (or its parent) stored -> its blob key, wherever
# the chunk's bytes are now: a value made again with the same bytes (a notebook
# run's `train = df[mask]` in the cell edited after it) is not hashed again. Bounded,
# the oldest forgotten first.
_keys_by_digest = {}
_DIGESTS_KEPT = 2 ** 16

# Blob key -> {spot: the save that remembered it} of the buffers held strongly for
# it (see `remember`); saves are counted by `begin_save`.
_held = {}
_saves = [0]


def digest(piece):
    """The XXH3-128 of a chunk's bytes, which vouches for it in the process that stored
    it (see the module doc)."""
    return xxhash.xxh3_128_digest(piece)


def key_of(checked):
    """The blob key of a chunk whose bytes have XXH3-128 `checked`, if this process knows
    one (the same 2^-128 chance of an accidental match as above)."""
    return _keys_by_digest.get(checked)


def allocate(size):
    """A zeroed, writable buffer of `size` bytes; from `_HUGE_MIN` on, private
    anonymous memory advised into transparent huge pages."""
    if size < _HUGE_MIN:
        return bytearray(size)
    # MAP_PRIVATE: a forked child's writes must stay its own (a shared mapping
    # would let a cell change the state it ran from).
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP here: small pages
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


def copy_into(target, data):
    """target[:] = data (equal sizes), with the GIL released: a restore copies its
    chunks on several threads, and a memoryview's own copy holds the GIL (two
    threads copied 8.4 GB/s where one copied 9.0; numpy's copy, 13.1)."""
    import numpy
    numpy.copyto(numpy.frombuffer(target, dtype=numpy.uint8),
                 numpy.frombuffer(data, dtype=numpy.uint8))


def buffer_address(view):
    """Start address of a contiguous buffer, or None if it cannot be told."""
    try:
        import numpy
    except ImportError:
        return None
    try:
        return numpy.frombuffer(view, dtype=numpy.uint8).__array_interface__["data"][0]
    except (ValueError, TypeError):
        return None


def _spans(nbytes, chunk):
    """(offset, size) of each `chunk`-byte piece of a buffer of `nbytes`."""
    return [(start, min(chunk, nbytes - start)) for start in range(0, nbytes, chunk)]


def remember(view, keys, chunk, digests=None):
    """Record that the `chunk`-byte pieces of `view` (as stored now) have blob `keys`
    (and, if given, the `digest`s of their bytes).

    An array is held by a weak reference (a strong one would change what
    `ndarray.resize` allows). Other owners are held strongly, until
    `keep_only` drops them: a buffer loaded from the store is not the
    user's object, and pyarrow makes a new wrapper of a buffer each time an
    array is pickled (a weak reference to it would be dead at once). So a
    value made again with the same bytes (a re-run `pd.read_csv` with
    string columns) would leave the old copy held for its key, which the
    state still has: a buffer held strongly for a key is dropped once a
    later save remembers that key elsewhere (equal buffers of one save stay).
    """
    address = buffer_address(view)
    if address is None or view.nbytes < _PAGE:
        return
    owner = _owner(view)
    numpy = sys.modules.get("numpy")
    strong = numpy is None or not isinstance(owner, numpy.ndarray)
    ref = (lambda owner=owner: owner) if strong else weakref.ref(owner)
    for (offset, size), key, checked in zip(_spans(view.nbytes, chunk), keys,
                                           digests or [None] * len(keys)):
        if size >= _PAGE:
            spot = (address + offset, size)
            _let_go_of_older_copies(key, spot)
            if strong:
                _held.setdefault(key, {})[spot] = _saves[0]
            _known[spot] = (key, ref, checked)
        if checked is not None and checked not in _keys_by_digest:
            if len(_keys_by_digest) >= _DIGESTS_KEPT:
                del _keys_by_digest[next(iter(_keys_by_digest))]
            _keys_by_digest[checked] = key


def _let_go_of_older_copies(key, spot):
    """Forget the buffers earlier saves held strongly for `key` elsewhere than `spot`
    (and `spot` itself as held: `remember` records it anew)."""
    held = _held.get(key)
    if not held:
        return
    for old in [o for o, save in held.items() if save < _saves[0] or o == spot]:
        del held[old]
        if old != spot and _known.get(old, (None,))[0] == key:
            del _known[old]


def _owner(view):
    """The object whose life keeps `view`'s memory: the object it exports, through the
    views made to export it (storage/serializer.py: a read-only memoryview of an
    Arrow buffer, a byte view of a datetime64 array, which ends a chain of numpy
    bases)."""
    owner = view.obj
    while isinstance(owner, memoryview):
        owner = owner.obj
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        while isinstance(owner, numpy.ndarray) and isinstance(owner.base, numpy.ndarray):
            owner = owner.base
    return owner


def known(view, chunk, workers=1):
    """Per `chunk`-byte piece of `view`: (blob key, digest) if its bytes are unchanged
    since it was stored, else None. One page-map read serves the whole buffer; a
    piece whose pages are no longer shared is checked by its digest, if it has one,
    on `workers` threads when there are enough bytes for them (threads.for_hashing;
    a 1 GB frame restored or made in this process: 0.2 s on one)."""
    spans = _spans(view.nbytes, chunk)
    address = buffer_address(view)
    if address is None:
        return [None] * len(spans)
    found = [_known.get((address + offset, size)) for offset, size in spans]
    if not any(found):
        return [None] * len(spans)
    changed = _changed_pages(address, view.nbytes)
    first_page = address // _PAGE
    entries, covered, unshared = [], {}, []
    for (offset, size), entry in zip(spans, found):
        if entry is not None:
            key, ref, checked = entry
            owner = ref()
            if owner is not None and id(owner) not in covered:
                covered[id(owner)] = _covers(owner, address, view.nbytes)
            if owner is None or not covered[id(owner)]:
                del _known[(address + offset, size)]
                entry = None
            elif not _shared(changed, (address + offset) // _PAGE - first_page,
                             (address + offset + size - 1) // _PAGE - first_page):
                if checked is None:
                    entry = None
                else:
                    unshared.append((len(entries), view[offset:offset + size], checked))
        entries.append(None if entry is None else (entry[0], entry[2]))
    workers = threads.for_hashing(sum(piece.nbytes for _, piece, _ in unshared), workers)
    same = list(threads.ordered(lambda item: digest(item[1]) == item[2], unshared, workers))
    for (at, _, _), unchanged in zip(unshared, same):
        if not unchanged:
            entries[at] = None
    return entries


def _shared(changed, first, last):
    """True if pages first..last (indexes into `changed`) are all still shared."""
    if changed is None:
        return False
    before = changed[first - 1] if first else 0
    return changed[last] == before


def begin_save():
    """A new save starts: what it remembers replaces copies held for the same keys."""
    _saves[0] += 1


def keep_only(keys):
    """Forget buffers that are gone or not in the state just made (frees their memory)."""
    for spot in [k for k, (key, owner, _) in _known.items()
                 if key not in keys or owner() is None]:
        del _known[spot]
    for key in list(_held):
        held = {spot: save for spot, save in _held[key].items()
                if _known.get(spot, (None,))[0] == key}
        if held:
            _held[key] = held
        else:
            del _held[key]


def _covers(owner, address, size):
    """True if the owner's memory still spans [address, address+size) (not resized)."""
    interface = getattr(owner, "__array_interface__", None)
    if interface is not None:  # a datetime64 array has no buffer export of its own
        start, nbytes = interface["data"][0], owner.nbytes
    else:
        try:
            view = memoryview(owner)
        except TypeError:
            return False
        start, nbytes = buffer_address(view), view.nbytes
    return start is not None and start <= address and address + size <= start + nbytes


_pagemap_fd = [None, None]  # (pid, fd): an fd opened before a fork shows the parent's pages


def _pagemap():
    """This process's /proc/self/pagemap, opened once per process."""
    pid = os.getpid()
    if _pagemap_fd[0] != pid:
        if _pagemap_fd[1] is not None:
            os.close(_pagemap_fd[1])  # the parent's, inherited through fork
        _pagemap_fd[:] = [pid, os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)]
    return _pagemap_fd[1]


def _changed_pages(address, size):
    """Running count of the pages of [address, address+size) that are absent or no
    longer shared with the parent (a numpy array, one entry per page), or None
    if the page map cannot be read."""
    first, last = address // _PAGE, (address + size - 1) // _PAGE
    count = last - first + 1
    try:
        raw = os.pread(_pagemap(), count * 8, first * 8)
    except OSError:
        return None
    if len(raw) != count * 8:
        return None
    import numpy
    entries = numpy.frombuffer(raw, dtype=numpy.uint64)
    bad = ((entries & numpy.uint64(_PRESENT)) == 0) | ((entries & numpy.uint64(_EXCLUSIVE)) != 0)
    return numpy.cumsum(bad)
