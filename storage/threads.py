"""Run the per-chunk work of one large save or restore on a few threads.

Hashing (hashlib), compressing and decompressing (zstd) release the GIL on
a chunk of a megabyte, so a 1 GB buffer's chunks go about as many times
faster as there are free cores. Results come back in order, and at most a
small window of them is in flight: a 1 GB save must not hold a second
gigabyte of encoded chunks before it writes the first (fresh memory is
what costs most here, about 2 s a GB on a virtual machine that backs its
memory lazily).

The threads are made once per process and kept (starting them took about
as long as hashing a small state's new chunks: a notebook run's cell
started two to four). They are idle when an iteration ends, however it
ends: a worker process forks right after a save, and a fork must not copy
a thread mid-task. A forked process makes threads of its own, as it gets
none of its parent's.
"""

import collections
import concurrent.futures
import os
import threading

_pool = None  # (this process's executor, its number of threads), made on first use
_pool_lock = threading.Lock()


def _forget_pool():
    """In a forked child: the parent's threads are not here."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _executor(threads):
    """This process's executor, with room for two iterations of `threads` at once (a
    large save hashes chunks while its writer encodes the ones before)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[1] < 2 * threads:
            if _pool is not None:
                _pool[0].shutdown(wait=False)  # its threads end once idle
            _pool = (concurrent.futures.ThreadPoolExecutor(
                2 * threads, thread_name_prefix="storage"), 2 * threads)
        return _pool[0]


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
    pool = _executor(threads)
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
        concurrent.futures.wait(window)  # the ones already running
