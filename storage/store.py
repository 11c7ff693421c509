"""The LMDB store: content-addressed blobs and one manifest per named state.

Named databases: `meta` (format version), `blobs` (SHA-256 of the
uncompressed payload -> one flag byte + payload, zstd-compressed when that
pays) and `states` (name -> JSON manifest). A state is written in one
transaction, blobs before its manifest, so a crash leaves all of it or
none. Any process may open the store, but an LMDB handle must not be used
across a fork: `Store.for_process` hands each process its own.

Every blob is verified as it is read, so damaged bytes on disk become a
StoreCorrupt error instead of wrong values in a namespace. A blob carries
a checksum that costs a fraction of reading it: a compressed one zstd's
frame checksum (XXH64 of the content, checked by the decompressor), a raw
one an XXH3-64 digest before its bytes. Blobs of format 1 stores have
neither and are checked against their key, a SHA-256 (about 1 ms a MiB).
"""

import contextlib
import fcntl
import hashlib
import json
import os
import threading
import time

import lmdb
import xxhash
import zstandard

from storage import lmdbfile

# Format 2 added blob checksums; format 1 stores are read and upgraded in place
# (their blobs stay as they are, verified by their keys).
FORMAT_VERSION = 2
_READABLE_FORMATS = (b"1", b"2")
# Record flags: zstd frame (with a checksum since format 2); raw after an XXH3-64
# digest; raw without checksum (format 1).
_ZSTD, _RAW_XXH, _RAW = b"Z", b"H", b"R"
_XXH_BYTES = 8


_compressors = threading.local()  # one manifest compressor per thread, made once


def encode_manifest(manifest):
    """A manifest as stored: zstd-compressed JSON (a read-only cell's growth is its manifest)."""
    # A new compressor allocates (and the kernel zero-fills) its tables on every
    # call: about 0.1 ms of a trivial cell's save.
    compressor = getattr(_compressors, "level3", None)
    if compressor is None:
        compressor = _compressors.level3 = zstandard.ZstdCompressor(level=3)
    return compressor.compress(json.dumps(manifest).encode())


def decode_manifest(raw, name=None):
    """A stored manifest (or record: storage/notebooks.py, remote.py): zstd-compressed
    JSON, or plain JSON (which starts with '{').

    Raises StoreCorrupt, naming state `name`, when the bytes are damaged.
    """
    raw = bytes(raw)
    try:
        if not raw.startswith(b"{"):
            raw = zstandard.ZstdDecompressor().decompress(raw)
        manifest = json.loads(raw)
    except (ValueError, zstandard.ZstdError) as exc:
        problem = str(exc)
    else:
        if isinstance(manifest, dict):
            return manifest
        problem = "not a JSON object"
    raise StoreCorrupt(f"the manifest of state {name!r} is damaged ({problem})")


class StoreError(Exception):
    """The store cannot be used; the message names the path and what to do."""


class StoreFull(StoreError):
    """The store reached max_store_gb, or its file system is full; nothing
    already stored is harmed."""


class StoreCorrupt(StoreError):
    """Stored bytes failed verification (or are missing): the data on disk was damaged."""


class Store:
    """One LMDB environment holding blobs and state manifests."""

    _per_process = {}

    def __init__(self, path, settings=None):
        """Open the store at `path`: for writing (created if needed) under the
        `store.*` tunables of `settings`, or read-only when settings is None.
        Refuses a foreign store."""
        self.path = path
        self.readonly = settings is None
        self.max_store_gb = None if self.readonly else settings["store.max_store_gb"]
        self.compressor = None if self.readonly else zstandard.ZstdCompressor(
            level=settings["store.zstd_level"], write_checksum=True)
        sync = self.readonly or settings["store.durability"] == "sync"
        try:
            if not self.readonly:
                os.makedirs(path, exist_ok=True)
            check_data_file(path)
            # map_size 0 when read-only: LMDB maps the file as large as it is.
            map_size = 0 if self.readonly else int(self.max_store_gb * 2 ** 30)
            # meta, blobs, states; notebooks (storage/notebooks.py); remote (storage/cache.py)
            self.env = lmdb.open(path, map_size=map_size, max_dbs=5,
                                 sync=sync, metasync=sync, readonly=self.readonly,
                                 readahead=False, create=not self.readonly, lock=True)
            self.meta = self.env.open_db(b"meta", create=not self.readonly)
            self.blobs = self.env.open_db(b"blobs", create=not self.readonly)
            self.states = self.env.open_db(b"states", create=not self.readonly)
        except lmdb.Error as exc:
            raise StoreError(
                f"cannot open the store at {path}: {exc}. If it is damaged, move the "
                f"folder aside and start with an empty one (or restore a backup)") from None
        self._check_format()

    @classmethod
    def for_process(cls, path, settings):
        """The store handle of the calling process, opened on first use.

        An LMDB handle must not be used across a fork, and py-lmdb refuses a
        second open of an environment in one process. So a forked process
        first closes the handles it inherited, then opens its own. Closing
        there is safe: LMDB clears only reader slots of the closing pid and
        the child holds no file lock of its parent's. It must come before
        the new open, or it would clear the new handle's reader slots. The
        parent keeps its handle open through the fork (reopening costs a
        cell about 1 ms).
        """
        pid = os.getpid()
        key = (pid, path)
        store = cls._per_process.get(key)
        if store is None:
            for inherited in [k for k in cls._per_process if k[0] != pid]:
                cls._per_process.pop(inherited).env.close()
            store = cls._per_process[key] = cls(path, settings)
        return store

    @classmethod
    def release(cls, path):
        """Close the calling process's handle on the store at `path`, if it has one
        (a process that opened a temporary store, e.g. for a fresh run, and is done)."""
        store = cls._per_process.pop((os.getpid(), path), None)
        if store is not None:
            store.env.close()

    def _check_format(self):
        """Write the format record of a new store, upgrade a format 1 one; refuse
        one of another format."""
        current = str(FORMAT_VERSION).encode()
        with self.env.begin(db=self.meta) as txn:
            found = txn.get(b"format")
        if found is None and self.readonly:
            raise StoreError(f"{self.path} holds no snapshot-kernel store")
        if found in (None, *_READABLE_FORMATS) and found != current and not self.readonly:
            # Only a new or older store takes the write lock here: every worker opens
            # the store. Format 2 blobs must not reach a format 1 server, which would
            # take their checksums for data: it refuses the store by this record.
            with self._writing(), self.env.begin(db=self.meta, write=True) as txn:
                found = txn.get(b"format")
                if found in (None, *_READABLE_FORMATS):
                    txn.put(b"format", current)
                    found = current
        if found not in _READABLE_FORMATS:
            raise StoreError(
                f"the store at {self.path} has format {found.decode(errors='replace')}, "
                f"this server reads formats {b', '.join(_READABLE_FORMATS).decode()}; use "
                f"a server of that version or point --data-dir at another folder")

    @contextlib.contextmanager
    def _writing(self, size=0):
        """Turn LMDB's write failures into StoreFull (map or file system full) or
        StoreError; `size`: bytes the write adds, to tell a full disk from a bad one."""
        try:
            yield
        except lmdb.MapFullError:
            raise StoreFull(f"the store at {self.path} is full (max_store_gb = "
                            f"{self.max_store_gb}); delete states and run "
                            f"scripts/gc_states.py, or raise the limit") from None
        except lmdb.Error as exc:
            # A full file system shows as ENOSPC, or as EIO when LMDB's write came short.
            free = _free_bytes(self.path)
            if isinstance(exc, lmdb.DiskError) or free is not None and free < size + 2 ** 20:
                raise StoreFull(
                    f"the file system holding the store at {self.path} is full ({free} "
                    f"bytes free; {exc}); nothing stored before is harmed. Free space there, "
                    f"or delete states and run scripts/gc_states.py") from None
            raise StoreError(f"writing to the store at {self.path} failed: {exc}; "
                             f"run scripts/check_store.py") from None

    # Manifests ---------------------------------------------------------------

    def manifest(self, name):
        """The manifest of state `name`, or None."""
        with self.env.begin(db=self.states) as txn:
            raw = txn.get(name.encode())
        return None if raw is None else decode_manifest(raw, name)

    def manifests(self, damaged=None):
        """Every manifest, {name: manifest}.

        A damaged one raises StoreCorrupt; or, when `damaged` is a list, it is
        left out and its StoreCorrupt appended to that list.
        """
        found = {}
        with self.env.begin(db=self.states) as txn:
            for key, raw in txn.cursor():
                name = key.decode()
                try:
                    found[name] = decode_manifest(raw, name)
                except StoreCorrupt as exc:
                    if damaged is None:
                        raise
                    damaged.append(exc)
        return found

    def delete_states(self, names):
        """Remove manifests (their blobs stay until garbage collection)."""
        with self._writing(), self.env.begin(db=self.states, write=True) as txn:
            for name in names:
                txn.delete(name.encode())

    def clear(self):
        """Remove every state and blob."""
        with self._writing(), self.env.begin(write=True) as txn:
            txn.drop(self.states, delete=False)
            txn.drop(self.blobs, delete=False)

    # Blobs -------------------------------------------------------------------

    def missing(self, keys):
        """The subset of blob keys (hex) not yet in the store."""
        # buffers=True: an existence check must not copy the blob out of the map.
        with self.env.begin(db=self.blobs, buffers=True) as txn:
            return {k for k in keys if txn.get(bytes.fromhex(k)) is None}

    def encode(self, data):
        """A blob record for `data`: compressed when that saves space."""
        packed = self.compressor.compress(data)
        if len(packed) < 0.95 * len(data):
            return _ZSTD + packed
        return _RAW_XXH + xxhash.xxh3_64_digest(data) + bytes(data)

    def blob(self, key):
        """The verified, uncompressed payload of blob `key`, as a writable bytearray.

        Raises StoreCorrupt when the blob is missing or fails its checksum.
        """
        problem, data = self.read_blob(key)
        if problem:
            raise StoreCorrupt(f"blob {key} in the store at {self.path} is {problem}")
        return data

    def read_blob(self, key):
        """(None, verified payload) of blob `key`, or (what is wrong with it, None)."""
        with self.env.begin(db=self.blobs, buffers=True) as txn:
            raw = txn.get(bytes.fromhex(key))
            if raw is None:
                return "missing from the store", None
            return _decode(bytes(raw[:1]), raw[1:], key)

    def put_state(self, name, manifest, records):
        """Write `records` ({key: encoded blob}) then the manifest, atomically."""
        size = sum(len(r) for r in records.values())
        with self._writing(size), self.env.begin(write=True) as txn:
            for key, record in records.items():
                txn.put(bytes.fromhex(key), record, db=self.blobs, overwrite=False)
            txn.put(name.encode(), encode_manifest(manifest), db=self.states)

    def chunk_list(self, key):
        """The chunk keys (hex) listed by chunk-list blob `key`."""
        listing = self.blob(key)
        return [listing[i:i + 32].hex() for i in range(0, len(listing), 32)]

    def referenced(self, manifest):
        """Every blob key a manifest needs: its own, and the chunks its chunk lists name."""
        keys = referenced_blobs(manifest)
        for group in manifest.get("groups", []):
            for key, count in zip(group["buffers"], group.get("layout") or []):
                if count > 1:
                    keys.update(self.chunk_list(key))
        return keys

    def blob_keys(self):
        """Every blob key in the store (hex)."""
        with self.env.begin(db=self.blobs, buffers=True) as txn:
            return [bytes(k).hex() for k in txn.cursor().iternext(keys=True, values=False)]

    def delete_blobs(self, keys):
        """Remove blobs; returns the bytes freed (as stored)."""
        freed = 0
        with self._writing(), self.env.begin(db=self.blobs, write=True, buffers=True) as txn:
            for key in keys:
                raw = txn.get(bytes.fromhex(key))
                if raw is not None:
                    freed += len(raw)
                    txn.delete(bytes.fromhex(key))
        return freed

    def release_freed(self):
        """Make the pages freed by the last write usable by the next one at once.

        LMDB keeps the pages a transaction frees until a later transaction has
        committed (the previous snapshot may still be read from them), so after
        a clean-up that ends in one large delete, the next state could find the
        store still full. A small write committed here is that later transaction.
        """
        with self._writing(), self.env.begin(db=self.meta, write=True) as txn:
            txn.put(b"released", str(time.time_ns()).encode())

    def space(self):
        """Bytes of the data file in use by LMDB, of that free for new states, and
        the room left under max_store_gb beyond it: {used, free, room}."""
        meta = lmdbfile.current_meta(self.path)
        with self.env.begin() as txn:
            pages = sum(stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
                        for stat in (txn.stat(db) for db in (self.meta, self.blobs, self.states)))
        pages += 2 + meta.free_db_pages + meta.main_db_pages  # the two meta pages
        file_pages = meta.last_page + 1
        return {"used": file_pages * meta.page_size,
                "free": max(file_pages - pages, 0) * meta.page_size,
                "room": max(self.env.info()["map_size"] - file_pages * meta.page_size, 0)}

    def sync(self):
        """Flush to disk (used with durability = "async")."""
        self.env.sync(True)


def _decode(flag, body, key):
    """(problem or None, payload as a bytearray) of a blob record's flag and body."""
    if flag == _RAW_XXH:
        data = bytearray(body[_XXH_BYTES:])
        if xxhash.xxh3_64_digest(data) != bytes(body[:_XXH_BYTES]):
            return "corrupt: its bytes do not match their XXH3 checksum", None
        return None, data
    if flag == _ZSTD:
        try:
            checked = zstandard.get_frame_parameters(body).has_checksum
            data = bytearray(zstandard.ZstdDecompressor().decompress(
                body, max_output_size=2 ** 40))
        except zstandard.ZstdError as exc:
            return f"corrupt: zstd cannot decompress it ({exc})", None
        if checked:
            return None, data
    elif flag == _RAW:
        data = bytearray(body)
    else:
        return f"corrupt: unknown record type {flag!r}", None
    # A format 1 blob has no checksum: its key is the SHA-256 of its payload.
    if hashlib.sha256(data).hexdigest() != key:
        return "corrupt: its content does not hash to its key", None
    return None, data


def decode_record(record, key):
    """(problem or None, verified payload) of blob record `record` (a remote keeps the
    same records as LMDB)."""
    record = bytes(record)
    return _decode(record[:1], record[1:], key)


def _free_bytes(path):
    """Bytes an unprivileged writer may still use on the file system of `path`."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_data_file(path):
    """Refuse (StoreError) an LMDB file that lacks pages it uses, before LMDB maps it."""
    try:
        lmdbfile.current_meta(path)
    except lmdbfile.Truncated as exc:
        raise StoreError(
            f"the store at {path} is damaged: {exc}. Mapping it would crash this process "
            f"(SIGBUS), so it is not opened. Restore {lmdbfile.DATA_FILE} from a backup, "
            f"or move the folder aside and start with an empty store") from None
    except OSError as exc:
        raise StoreError(f"cannot read the store at {path}: {exc}") from None


def referenced_blobs(manifest):
    """The blob keys a manifest names itself (chunk lists not expanded: `Store.referenced`)."""
    keys = set()
    for group in manifest.get("groups", []):
        keys.add(group["key"])
        keys.update(group["buffers"])
    return keys


# Server lock ---------------------------------------------------------------

SERVER_LOCK = "server.lock"


def try_server_lock(data_dir):
    """Take the exclusive server lock of `data_dir` without waiting.

    The same flock a running server holds on `<data_dir>/server.lock` (see
    main.py lock_store). Returns the open lock file, which keeps the lock
    until it is closed, or None when another process (a server) holds it.
    Operator tools that write the store take it so no server starts meanwhile.
    """
    lock = open(os.path.join(data_dir, SERVER_LOCK), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock
