"""glibc's heap kept whole through one large write, and given back after it.

LMDB copies every blob of a transaction into pages it allocates with
malloc, and frees them when the transaction commits. glibc hands blocks of
a megabyte back to the kernel when they are freed, so each of a large
state's 256 MB transactions (store.write_batch_mb) faulted in fresh memory
again, which costs about 2 s a GB on a virtual machine that backs its
memory lazily. Kept meanwhile, the second transaction reuses the first
one's pages; at the end they go back to the kernel, or the holder forked
next would inherit them.
"""

import contextlib
import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_DEFAULT_THRESHOLD = 128 * 1024  # glibc's default for both
_KEEP_ALL = 2 ** 30

try:
    _libc = ctypes.CDLL(None)
    _mallopt, _malloc_trim = _libc.mallopt, _libc.malloc_trim
except (OSError, AttributeError):  # not glibc: nothing to tune
    _mallopt = _malloc_trim = None


@contextlib.contextmanager
def kept():
    """Within: freed memory stays in the process (blocks up to 1 GiB from the heap).
    After: glibc's default thresholds, and free memory returned to the kernel."""
    if _mallopt is None:
        yield
        return
    _mallopt(_M_MMAP_THRESHOLD, _KEEP_ALL)
    _mallopt(_M_TRIM_THRESHOLD, _KEEP_ALL)
    try:
        yield
    finally:
        _mallopt(_M_MMAP_THRESHOLD, _DEFAULT_THRESHOLD)
        _mallopt(_M_TRIM_THRESHOLD, _DEFAULT_THRESHOLD)
        _malloc_trim(0)
