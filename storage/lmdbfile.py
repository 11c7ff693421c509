"""Read an LMDB data file's meta pages without mapping the file.

LMDB maps `data.mdb` and trusts it: a file cut short (a full disk during a
copy, a bad restore) makes the first access past its end kill the process
with SIGBUS, before any Python code could report it. The two meta pages at
the start of the file say how many pages the last committed transaction
uses, so reading them with plain `read()` tells whether the file holds
them all, before LMDB maps it.

Layout (lmdb.h / mdb.c, 0.9.x, little-endian 64-bit): each page starts
with a 16-byte header; a meta page's `MDB_meta` follows it: magic,
version, address, map size, then two `MDB_db` records (free-page list and
main database, 48 bytes each; the first one's `md_pad` holds the page
size), the last used page number and the transaction id. LMDB uses the
meta page with the larger transaction id; so does this module.
"""

import os
import struct

DATA_FILE = "data.mdb"
MAGIC = 0xBEEFC0DE
DATA_VERSION = 1

_HEADER = 16  # PAGEHDRSZ
# magic, version, address, map size, FREE_DBI record, MAIN_DBI record, last page, txnid
_META = struct.Struct("<IIQQ48s48sQQ")
# md_pad (the page size in FREE_DBI), flags, depth, branch, leaf, overflow pages, entries, root
_DB = struct.Struct("<IHHQQQQQ")


class Meta:
    """What one meta page says about the file."""

    def __init__(self, raw):
        """Parse the `MDB_meta` record `raw` (bytes after the page header)."""
        (self.magic, self.version, _, self.map_size, free, main, self.last_page,
         self.txnid) = _META.unpack_from(raw)
        free_db, main_db = _DB.unpack(free), _DB.unpack(main)
        self.page_size = free_db[0]
        # Pages the free-page list and the main database (which holds the
        # named databases' records, not their trees) occupy.
        self.free_db_pages = sum(free_db[3:6])
        self.main_db_pages = sum(main_db[3:6])

    def valid(self):
        """True if this is an LMDB meta page of the data format this module reads."""
        return (self.magic == MAGIC and self.version == DATA_VERSION
                and self.page_size >= 512 and self.page_size & (self.page_size - 1) == 0)

    def needed_bytes(self):
        """Bytes the file must hold: every page up to the last one in use."""
        return (self.last_page + 1) * self.page_size


class Truncated(Exception):
    """The data file is shorter than its own meta pages say."""


def current_meta(path):
    """The meta page in force of the environment in folder `path`, checked against
    the file's size; None when the file is missing or is not an LMDB file of
    this format (LMDB itself then refuses it with its own message).

    Raises Truncated when the file lacks pages its last transaction uses.
    """
    file = os.path.join(path, DATA_FILE)
    try:
        with open(file, "rb") as f:
            first_raw = _read_at(f, _HEADER, _META.size)
            first = first_raw and Meta(first_raw)
            if first and not first.valid():
                return None
            second_raw = first and _read_at(f, first.page_size + _HEADER, _META.size)
            # Size after the metas: LMDB writes a transaction's pages before its meta.
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return None
    if not second_raw:
        # Empty too: LMDB would silently start a new environment in it.
        raise Truncated(f"{file} has {size} bytes: not even its two meta pages")
    second = Meta(second_raw)
    meta = second if second.valid() and second.txnid > first.txnid else first
    if size < meta.needed_bytes():
        raise Truncated(
            f"{file} has {size} bytes, but its last transaction ({meta.txnid}) uses "
            f"{meta.last_page + 1} pages of {meta.page_size} bytes ({meta.needed_bytes()} "
            f"bytes): the file was cut short")
    return meta


def _read_at(f, offset, size):
    """`size` bytes of `f` at `offset`, or None if the file ends before."""
    f.seek(offset)
    raw = f.read(size)
    return raw if len(raw) == size else None
