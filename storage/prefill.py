"""Zeros written into LMDB's data file ahead of a large commit, so the commit is fast.

LMDB writes a commit's pages with `pwritev`, up to 64 runs of pages a call
(`MDB_COMMIT_PAGES`, fixed in its C code): with a state's 1 MiB chunks,
64 MiB a call. On the Linux 6.18 VMs this project is measured on, one write
of 64 MiB into file pages the page cache does not hold yet takes 4 to 5
times as long as the same bytes written 1 MiB at a time, and a commit of
1 GB spent 1.3 to 1.5 s in LMDB's writes. So while a large state's blobs
are put, this writes zeros 1 MiB at a time into the part of the file that
the commit will write, and the commit writes over pages already in the
cache: 0.7 to 0.9 s, the zeros 0.3 s more (BENCHMARKS.md, "zeros ahead of
a large commit").

Why LMDB cannot be harmed:

- only the file past the last page of the newest commit is written. No
  snapshot a reader may hold references a page there, and the free-page list
  holds only pages below it. A file longer than its last page is healthy (a
  transaction that aborts after spilling leaves one too), and the next
  commit writes over what it uses of it;
- it is written inside a write transaction, so under LMDB's writer lock: no
  other process commits meanwhile;
- LMDB writes nothing of a transaction before its commit unless it spills
  dirty pages to the file, which it does only when the transaction's list
  of dirty pages nears `MDB_IDL_UM_MAX` (131,071) entries, or for a
  record too large for what is left of it, and then inside a put. Zeros
  are written only before a put, and only until the first put that might
  make it spill (counting, for each put, its record's run and two pages per
  level of the two trees it goes down): that put's spill would come after
  them, and nothing more is written in that transaction.
"""

import os

# LMDB's limit on a transaction's dirty pages (MDB_IDL_UM_MAX), the tree levels a put
# may dirty (a named database's depth plus the main database's, two pages a level
# when they split), and a margin.
_DIRTY_MAX = 2 ** 17 - 1
_LEVELS = 12
_MARGIN = 1024
# A transaction that writes less than this is left to LMDB alone: its calls are small
# (the kernel writes 1 MiB at a time fast enough), and zeros past what it uses would
# be flushed with it.
_FROM = 2 ** 22
_PIECE = 2 ** 20
_ZEROS = memoryview(bytes(_PIECE))
# A record's key and node header in a leaf page, at most (a blob's key is 32 bytes): LMDB
# keeps a record this much under half a page in the leaf, a larger one in pages of its own.
_NODE = 64
# Room for the new pages of the trees: a transaction of a few hundred blobs copies a
# few dozen tree pages.
_TREES = 2 ** 18


class Prefill:
    """The puts of a store's write transactions, one after another, with zeros written
    ahead of them: `began(env)` after each transaction begins, then its puts through
    `put`, then any deletes (which dirty pages too, so none comes before a put)."""

    def __init__(self, path):
        self.path = path
        self.fd = None

    def began(self, env):
        """A write transaction has begun: no commit can come between it and this."""
        self.page = env.stat()["psize"]
        info = env.info()
        self.done = self.start = (info["last_pgno"] + 1) * self.page
        self.limit = info["map_size"]
        self.end = self.start + _TREES
        self.dirty = 0  # dirty-list entries the puts so far may have used, at most
        self.stopped = False

    def put(self, txn, key, value, **options):
        """txn.put, after zeros over where `value` will go if that is safe now."""
        if not self.stopped:
            self._ahead(len(value))
        return txn.put(key, value, **options)

    def _ahead(self, size):
        pages = (size + 16) // self.page + 1  # LMDB's run for it (its header: 16 bytes)
        self.dirty += 1 + 2 * _LEVELS
        if self.dirty + 2 * (_LEVELS + pages + 1) + _MARGIN >= _DIRTY_MAX:
            self.stopped = True  # this put may spill: after it, LMDB may write there too
        if size + _NODE > self.page // 2:  # a run of overflow pages of its own
            grows = pages * self.page
        else:  # a node in a leaf page, and leaf pages split half full
            grows = 2 * (size + _NODE)
        self.end = min(self.end + grows, self.limit)
        if self.end - self.start < _FROM:
            return
        try:
            if self.fd is None:
                self.fd = os.open(os.path.join(self.path, "data.mdb"), os.O_WRONLY)
            while self.done < self.end:
                self.done += os.pwrite(self.fd, _ZEROS[:self.end - self.done], self.done)
        except OSError:
            # A full disk: LMDB's own write will fail and say so (Store._writing).
            self.stopped = True

    def close(self):
        """Close the file (the zeros are flushed with the commit's pages, or overwritten)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
