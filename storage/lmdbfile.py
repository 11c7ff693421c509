"""Check an LMDB data file without mapping it: does it hold every page its trees use?

LMDB maps `data.mdb` and trusts it: a file cut short (a full disk during a
copy, a bad restore) makes the first access past its end kill the process
with SIGBUS, before any Python code could report it. So before LMDB maps a
file, `current_meta` reads it with plain `pread` and checks it.

The file's length alone does not tell. The meta page's last page number
counts every page the transactions allocated, and LMDB need not have
written them all: a page allocated and freed again within one transaction
(a record put then deleted, a page split undone) is never written, and
LMDB writes with `pwrite`, so the file is only as long as the pages it
actually wrote. A healthy store is often shorter than (last page + 1) *
page size (measured here: after 146 of 200 commits of a loop that puts
and deletes a 20 KB record in each; after each of 6 runs of
scripts/gc_states.py --keep-last 3 on 200 states). So when the file
is that short, this module walks the B-trees the meta page in force
references (the free-page list, the main database, and every named
database, whose `MDB_db` record with its root lies in a leaf of the main
database) and finds the highest page they use: every branch and leaf page
it reads, and for each record on overflow pages (a leaf node flagged
F_BIGDATA) the run its size needs, computed from the node, so no blob's
pages are read. The file is cut short only if one of those lies beyond
its end; pages past them that were allocated but never written are fine.
A file at least as long as its last page number needs no walk (its meta
pages are read: 0.02 ms). A walk, measured here (2 shared cores) on a
store a real server made of 2,000 states and 0.94 GiB of blobs: 860 tree
pages read (245,100 overflow pages not), 4 ms with the file in the page
cache, 32 to 40 ms with none of it there (scripts/check_store.py prints
each walk's time). A server walks at start when the file is short, and
so does each worker forked from the zygote; one forked from a process that
holds the store open does not (Store.for_process).

Layout (lmdb.h / mdb.c 0.9.x, data format 1, little-endian, 64-bit
`pgno_t`; checked against LMDB 0.9.36 bundled with py-lmdb 3.0.0, whose
files this project writes, by comparing the pages reached with LMDB's own
per-database page counts, tests/test_lmdbfile.py):

- every page starts with a 16-byte header: mp_pgno (8 bytes), mp_pad (2),
  mp_flags (2), then mp_lower and mp_upper (2 + 2), or for the first page
  of an overflow run mp_pages (4). Flags: P_BRANCH 1, P_LEAF 2,
  P_OVERFLOW 4, P_META 8, P_LEAF2 0x20 (keys only, no nodes), P_SUBP 0x40
  (a page inside a node, never referenced by number).
- a branch or leaf page's node offsets (2 bytes each, from the page start)
  follow the header; their count is (mp_lower - 16) / 2.
- a node: mn_lo, mn_hi (2 + 2), mn_flags (2), mn_ksize (2), the key, then
  the data. A branch node's child is lo | hi << 16 | flags << 32. A leaf
  node's data size is lo | hi << 16; with F_BIGDATA (1) its data is the
  page number of an overflow run of (16 - 1 + size) // page size + 1 pages;
  with F_SUBDATA (2) it is an `MDB_db` record (a named database, or with
  F_DUPDATA (4) too, a key's sorted duplicates), whose root is its last
  8 bytes; F_DUPDATA alone keeps the duplicates inside the node.
- a meta page (pages 0 and 1): magic, version, address, map size, two
  `MDB_db` records (free-page list and main database, 48 bytes each; the
  first one's md_pad holds the page size), the last page number and the
  transaction id. LMDB uses the valid meta page with the larger
  transaction id; so does this module.
"""

import contextlib
import os
import struct
import time

DATA_FILE = "data.mdb"
MAGIC = 0xBEEFC0DE
DATA_VERSION = 1

_HEADER = 16  # PAGEHDRSZ
# magic, version, address, map size, FREE_DBI record, MAIN_DBI record, last page, txnid
_META = struct.Struct("<IIQQ48s48sQQ")
# md_pad (the page size in FREE_DBI), flags, depth, branch, leaf, overflow pages, entries, root
_DB = struct.Struct("<IHHQQQQQ")
_PAGE = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_PGNO = struct.Struct("<Q")
_ROOT_AT = 40  # md_root's offset in an MDB_db record
P_INVALID = 2 ** 64 - 1  # the root of an empty tree
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
FREE_TREE, MAIN_TREE = "the free-page list", "the main database"
# Pages read with one pread when they are consecutive (tree pages often are).
_RUN = 64
# Seconds a walk that found something wrong is tried again while a writer commits
# meanwhile (see `_stable_walk`).
_SETTLE_S = 2.0


class Meta:
    """What one meta page says about the file."""

    def __init__(self, raw):
        """Parse the `MDB_meta` record `raw` (bytes after the page header)."""
        (self.magic, self.version, _, self.map_size, free, main, self.last_page,
         self.txnid) = _META.unpack_from(raw)
        self.free_db, self.main_db = _DB.unpack(free), _DB.unpack(main)
        self.page_size = self.free_db[0]
        # Pages the free-page list and the main database (which holds the
        # named databases' records, not their trees) occupy.
        self.free_db_pages = sum(self.free_db[3:6])
        self.main_db_pages = sum(self.main_db[3:6])

    def valid(self):
        """True if this is an LMDB meta page of the data format this module reads."""
        return self.magic == MAGIC and self.version == DATA_VERSION

    def page_size_possible(self):
        """True if LMDB could have pages of this size: a power of two from 512 bytes
        to 64 KiB (MAX_PAGESIZE)."""
        return 512 <= self.page_size <= 65536 and self.page_size & (self.page_size - 1) == 0

    def needed_bytes(self):
        """Bytes of a file holding every page up to the last one allocated: at least
        that long, it holds every page the trees use (it may well be shorter)."""
        return (self.last_page + 1) * self.page_size


class DataFileError(Exception):
    """The data file cannot be mapped safely; the message says what was found."""


class Truncated(DataFileError):
    """The data file lacks pages its trees use: it was cut short.

    `findings` lists every reference past the end (`Finding`), `size` is
    the file's length in bytes.
    """

    def __init__(self, message, findings=(), size=None):
        super().__init__(message)
        self.findings = list(findings)
        self.size = size


class Damaged(DataFileError):
    """A page a tree references within the file is not a page of that tree."""

    def __init__(self, message, findings=()):
        super().__init__(message)
        self.findings = list(findings)


class Finding:
    """One page (or run of overflow pages) a tree references that is missing or wrong.

    `tree`: the database ("blobs", or FREE_TREE / MAIN_TREE), `first` and
    `last` its pages, `what`: "root page", "branch or leaf page", "overflow
    pages" or "root page of a key's duplicates", `source`: (page, tree)
    that references it (None for a root the meta page names), `problem`:
    None for a page past the end, else what is wrong with the page there.
    """

    def __init__(self, tree, first, last, what, source, problem=None):
        self.tree, self.first, self.last, self.what = tree, first, last, what
        self.source, self.problem = source, problem

    def __str__(self):
        pages = str(self.first) if self.first == self.last else f"{self.first} to {self.last}"
        text = f"{self.what} {pages} of {_tree_name(self.tree)}"
        if self.source is None:
            text += " (named by the meta page)"
        elif self.source[1] == self.tree:
            text += f" (referenced by page {self.source[0]})"
        else:
            text += f" (named in page {self.source[0]} of {_tree_name(self.source[1])})"
        return text if self.problem is None else f"{text} {self.problem}"


def _tree_name(tree):
    """How a message names a tree."""
    return tree if tree in (FREE_TREE, MAIN_TREE) else f"database {tree!r}"


class Walk:
    """What a walk of the trees found.

    `pages`: {tree: [branch, leaf, overflow pages]} reached (as LMDB's own
    stat counts them), `highest`: the highest page any tree uses (overflow
    runs included), `beyond` and `damaged`: Findings, `size`: the file's length,
    `unsettled`: what walks found while a writer kept reusing their pages (not
    evidence of damage; see `_stable_walk`).
    """

    def __init__(self, meta, size):
        self.meta, self.size = meta, size
        self.pages = {}
        self.highest = 1  # the two meta pages
        self.beyond = []
        self.damaged = []
        self.unsettled = []

    def file_pages(self):
        """Whole pages the file holds."""
        return self.size // self.meta.page_size


@contextlib.contextmanager
def _data_file(path):
    """The environment's data file in folder `path`, opened for reading: (fd, file
    name), or (None, file name) when there is none."""
    file = os.path.join(path, DATA_FILE)
    try:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield None, file
        return
    try:
        yield fd, file
    finally:
        os.close(fd)


def read_meta(path):
    """The meta page in force of the environment in folder `path`, without checking
    the rest of the file; None when the file is missing or is not an LMDB file
    of this format (LMDB itself then refuses it with its own message).

    Raises Truncated when the file does not even hold its two meta pages.
    """
    with _data_file(path) as (fd, file):
        return None if fd is None else _metas(fd, file)[0]


def current_meta(path):
    """The meta page in force of the environment in folder `path`, once the file is
    known to hold every page its trees use; None when the file is missing or
    is not an LMDB file of this format.

    Raises Truncated when a page (or overflow run) a tree references lies
    past the end of the file, Damaged when a page a tree references is not
    what the tree says (see `walk`).
    """
    with _data_file(path) as (fd, file):
        if fd is None:
            return None
        meta, st = _metas(fd, file)
        if meta is None or st.st_size >= meta.needed_bytes():
            return meta  # every page ever allocated lies in the file
        found = _stable_walk(fd, file, meta, st.st_size)
    _refuse(found, file)
    return found.meta


def walk(path):
    """Walk every tree of the environment in folder `path` (whatever the file's
    length): a Walk, or None when the file is missing or not an LMDB file of
    this format. Raises Truncated when even the meta pages are missing."""
    with _data_file(path) as (fd, file):
        if fd is None:
            return None
        meta, st = _metas(fd, file)
        return None if meta is None else _stable_walk(fd, file, meta, st.st_size)


def describe(found, file):
    """The message for a walk's findings (None when there are none)."""
    meta = found.meta
    if found.beyond:
        first = found.beyond[0]
        more = len(found.beyond) - 1
        return (f"{file} has {found.size} bytes ({found.file_pages()} whole pages of "
                f"{meta.page_size} bytes), but its last transaction ({meta.txnid}) uses "
                f"{first}, which lies beyond its end: the file was cut short"
                + (f" ({more} more page reference(s) beyond its end)" if more else ""))
    if found.damaged:
        first = found.damaged[0]
        more = len(found.damaged) - 1
        return (f"in {file}, {first} (last transaction {meta.txnid}): the file is "
                f"damaged" + (f" ({more} more such page(s))" if more else ""))
    return None


def _refuse(found, file):
    """Raise Truncated or Damaged for a walk's findings."""
    message = describe(found, file)
    if found.beyond:
        raise Truncated(message, found.beyond, found.size)
    if found.damaged:
        raise Damaged(message, found.damaged)


def _metas(fd, file):
    """(the meta page in force or None, os.stat_result of the file after reading it)."""
    first_raw = _read_at(fd, _HEADER, _META.size)
    first = first_raw and Meta(first_raw)
    if first and not first.valid():
        return None, None
    if first and not first.page_size_possible():
        raise Damaged(f"{file}: its first meta page names pages of {first.page_size} bytes, "
                      f"which LMDB cannot have: the file is damaged")
    second_raw = first and _read_at(fd, first.page_size + _HEADER, _META.size)
    # Size after the metas: LMDB writes a transaction's pages before its meta.
    st = os.fstat(fd)
    if not second_raw:
        # Empty too: LMDB would silently start a new environment in it.
        raise Truncated(f"{file} has {st.st_size} bytes: not even its two meta pages",
                        size=st.st_size)
    second = Meta(second_raw)
    newer = second.valid() and second.page_size_possible() and second.txnid > first.txnid
    return (second if newer else first), st


def _stable_walk(fd, file, meta, size):
    """Walk the trees of `meta`; again, from the new meta page, if a writer may have
    overwritten pages meanwhile and the walk found something wrong.

    Without a reader slot, a walk may meet pages a writer reuses. LMDB
    reuses a page only once the transaction that freed it is older than
    the writer's own minus one, so the pages of transaction T stay as they
    are until T + 3 begins: a walk after which the meta in force is at most
    T + 1 read only pages of T. A walk that found nothing wrong stands
    either way (a file a writer keeps committing to is not one cut short
    under it). Measured beside a writer committing as fast as it can: one
    walk in 400 met pages reused under it; of 15,825 walks none settled on
    a false finding. On a loaded machine a writer may commit during every
    walk for as long as one tries: what such walks found is then not
    evidence (`unsettled` says so), and never a refusal.
    """
    deadline = time.monotonic() + _SETTLE_S
    while True:
        found = _walk(fd, meta, size)
        after, st = _metas(fd, file)
        if after is None or after.txnid <= meta.txnid + 1 or not (found.beyond or
                                                                  found.damaged):
            return found
        if time.monotonic() > deadline:
            found.unsettled = found.beyond + found.damaged
            found.beyond, found.damaged = [], []
            return found
        meta, size = after, st.st_size


def _walk(fd, meta, size):
    """Walk the free-page list, the main database and every named database of `meta`."""
    found = Walk(meta, size)
    psize = meta.page_size
    last_page = meta.last_page
    have = size // psize  # whole pages in the file
    seen = set()
    # Breadth first, a level at a time in page order: the reads go forward through
    # the file. Each entry: (page number, tree, what it is, page referencing it).
    level = [(db[7], tree, "root page", None)
             for db, tree in ((meta.free_db, FREE_TREE), (meta.main_db, MAIN_TREE))
             if db[7] != P_INVALID]
    while level:
        level.sort(key=lambda entry: entry[0])
        below = []
        readable = []
        for entry in level:
            pgno, tree, what, source = entry
            found.pages.setdefault(tree, [0, 0, 0])
            if pgno > last_page or pgno < 2:
                found.damaged.append(Finding(tree, pgno, pgno, what, source,
                                             f"is not a page the transaction allocated "
                                             f"(its last page is {last_page})"))
            elif pgno in seen:
                found.damaged.append(Finding(tree, pgno, pgno, what, source,
                                             "is also referenced from elsewhere"))
            elif pgno >= have:
                seen.add(pgno)
                found.beyond.append(Finding(tree, pgno, pgno, what, source))
                found.highest = max(found.highest, pgno)
            else:
                seen.add(pgno)
                readable.append(entry)
                found.highest = max(found.highest, pgno)
        for entry, page in _read_pages(fd, readable, psize):
            _parse(page, entry, psize, found, below)
        level = below
    found.beyond.sort(key=lambda f: f.first)
    return found


def _read_pages(fd, entries, psize):
    """(entry, page bytes) for each entry (sorted by page number), consecutive pages
    read together."""
    at = 0
    while at < len(entries):
        end = at + 1
        while (end < len(entries) and end - at < _RUN
               and entries[end][0] == entries[end - 1][0] + 1):
            end += 1
        first = entries[at][0]
        data = os.pread(fd, (end - at) * psize, first * psize)
        view = memoryview(data)
        for i in range(at, end):
            yield entries[i], view[(i - at) * psize:(i - at + 1) * psize]
        at = end


def _parse(page, entry, psize, found, below):
    """Count branch or leaf page `page` of `entry` and queue what it references."""
    pgno, tree, what, _ = entry
    counts = found.pages[tree]
    if len(page) < psize:
        found.beyond.append(Finding(tree, pgno, pgno, what, entry[3]))
        return
    number, _, flags, lower, upper = _PAGE.unpack_from(page)
    problem = None
    if number != pgno:
        problem = f"holds page {number} instead"
    elif flags & (P_BRANCH | P_LEAF | P_OVERFLOW | P_META) not in (P_BRANCH, P_LEAF):
        problem = f"is not a branch or leaf page (flags {flags:#x})"
    elif not _HEADER <= lower <= upper <= psize:
        problem = f"has a malformed header (lower {lower}, upper {upper})"
    if problem:
        found.damaged.append(Finding(tree, pgno, pgno, what, entry[3], problem))
        return
    branch = flags & P_BRANCH
    counts[0 if branch else 1] += 1
    if flags & P_LEAF2:
        return  # keys only (sorted duplicates of fixed size): no page references
    count = (lower - _HEADER) >> 1
    offsets = struct.unpack_from(f"<{count}H", page, _HEADER)
    lowest = _HEADER + 2 * count
    for offset in offsets:
        if not lowest <= offset <= psize - _NODE.size:
            found.damaged.append(Finding(tree, pgno, pgno, what, entry[3],
                                         f"has a node offset {offset} outside the page"))
            return
        lo, hi, nflags, ksize = _NODE.unpack_from(page, offset)
        if branch:
            below.append((lo | hi << 16 | nflags << 32, tree, "branch or leaf page",
                          (pgno, tree)))
            continue
        data = offset + _NODE.size + ksize
        if nflags & F_BIGDATA:
            if data + _PGNO.size > psize:
                found.damaged.append(Finding(tree, pgno, pgno, what, entry[3],
                                             "has a node running past the page's end"))
                return
            first = _PGNO.unpack_from(page, data)[0]
            size = lo | hi << 16
            pages = (_HEADER - 1 + size) // psize + 1
            counts[2] += pages
            _overflow(found, tree, first, first + pages - 1, (pgno, tree))
        elif nflags & F_SUBDATA:
            if data + _DB.size > psize:
                found.damaged.append(Finding(tree, pgno, pgno, what, entry[3],
                                             "has a node running past the page's end"))
                return
            root = _PGNO.unpack_from(page, data + _ROOT_AT)[0]
            if root == P_INVALID:
                continue
            if nflags & F_DUPDATA:
                # A key's sorted duplicates: LMDB counts their pages as the database's.
                below.append((root, tree, "root page of a key's duplicates", (pgno, tree)))
            else:
                name = bytes(page[offset + _NODE.size:data]).decode("utf-8", "replace")
                below.append((root, name, "root page", (pgno, tree)))


def _overflow(found, tree, first, last, source):
    """Note an overflow run [first, last] that a leaf of `tree` references (`source`:
    (that leaf's page, tree))."""
    if last > found.meta.last_page or first < 2:
        found.damaged.append(Finding(tree, first, last, "overflow pages", source,
                                     f"are not pages the transaction allocated (its last "
                                     f"page is {found.meta.last_page})"))
        return
    found.highest = max(found.highest, last)
    if last >= found.size // found.meta.page_size:
        found.beyond.append(Finding(tree, first, last, "overflow pages", source))


def _read_at(fd, offset, size):
    """`size` bytes of the file at `offset`, or None if the file ends before."""
    raw = os.pread(fd, size, offset)
    return raw if len(raw) == size else None
