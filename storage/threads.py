"""Run the per-chunk work of one large save or restore on a few threads.

Hashing (hashlib), compressing and decompressing (zstd) release the GIL on
a chunk of a megabyte, so a 1 GB buffer's chunks go about as many times
faster as there are free cores. Results come back in order, and at most a
small window of them is in flight: a 1 GB save must not hold a second
gigabyte of encoded chunks before it writes the first (fresh memory is
what costs most here, about 2 s a GB on a virtual machine that backs its
memory lazily).

The threads are gone when the iteration ends, however it ends: a worker
process forks right after a save, and a fork must not copy a thread
mid-task.
"""

import collections
import concurrent.futures

# Hashing less than this is done in the calling thread: SHA-256 (with the CPU's SHA
# instructions) runs at about 2 GB/s and XXH3 at 30, so below it a thread's start and
# hand-offs cost more than the second core saves, and far more when the other core is
# busy (a notebook edit's saves, 16 MB of a frame checked a cell: 0.5 ms in this thread,
# 1.5 to 12 ms on two).
_HASH_THREADS_FROM = 2 ** 26


def for_hashing(nbytes, threads):
    """The threads worth using to hash `nbytes` in all: `threads`, or 1 below
    _HASH_THREADS_FROM."""
    return threads if nbytes >= _HASH_THREADS_FROM else 1


def ordered(work, items, threads, ahead=None):
    """Yield work(item) for every item, in order, computed on up to `threads` threads,
    at most `ahead` (default twice `threads`) results ahead of the one consumed.
    Fewer than two items (when `items` has a length) are worked in this thread:
    starting one costs more than the wait it saves (a 3-chunk column's restore)."""
    if hasattr(items, "__len__") and len(items) < 2:
        threads = 1
    items = iter(items)
    if threads <= 1:
        yield from map(work, items)
        return
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    window = collections.deque()
    try:
        for item in items:
            window.append(pool.submit(work, item))
            if len(window) > (ahead or 2 * threads):
                yield window.popleft().result()
        while window:
            yield window.popleft().result()
    finally:
        for future in window:
            future.cancel()
        pool.shutdown(wait=True)
