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
import queue
import shlex
import threading
import time

import lmdb
import xxhash
import zstandard

from snapkernel.storage import lmdbfile, pages, shuffle, threads
from snapkernel.storage.prefill import Prefill

# Format 2 added blob checksums, format 3 byte-shuffled blobs; older stores are read
# and upgraded in place (their blobs stay as they are; format 1's are verified by their
# keys).
FORMAT_VERSION = 3
_READABLE_FORMATS = (b"1", b"2", b"3")
# Record flags: zstd frame (with a checksum since format 2); the same of the payload
# byte-shuffled (storage/shuffle.py; format 3); raw after an XXH3-64 digest; raw
# without checksum (format 1).
_ZSTD, _ZSTD_SHUFFLED, _RAW_XXH, _RAW = b"Z", b"S", b"H", b"R"
_RECORD_TYPES = (_ZSTD, _ZSTD_SHUFFLED, _RAW_XXH, _RAW)
_XXH_BYTES = 8
_MISSING = "missing from the store"
# A payload this large is first compressed in three samples of _SAMPLE bytes: one that
# will not shrink (random floats, already compressed data) is stored as it is without
# compressing all of it (zstd gains ~6% on random float64 at 300 MB/s). One that does
# is stored shuffled if its samples shuffled compress smaller: then the whole is smaller
# and decompresses faster (numbers of 8 or 4 bytes: 1.2 to 3 times as fast).
_SAMPLE_FROM = 2 ** 16
_SAMPLE = 2 ** 13
# Blobs encoded ahead of the one being written (a few MiB of memory, used again and again).
_ENCODE_AHEAD = 16
# A new state's blobs start being written while it is saved from this many bytes on.
_STREAM_FROM = 2 ** 22


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


class NewerFormat(StoreError):
    """The store, or a blob of it, was written by a newer snapshot-kernel: nothing is
    damaged, this server is too old to read it."""


class BlobMissing(StoreCorrupt):
    """A blob is not in the store. Damage for a store of its own; for the cache of a
    remote (storage/cache.py), a blob to fetch."""


class Store:
    """One LMDB environment holding blobs and state manifests."""

    _per_process = {}

    def __init__(self, path, settings=None, checked=False, meta_sync=True):
        """Open the store at `path`: for writing (created if needed) under the
        `store.*` tunables of `settings`, or read-only when settings is None.
        Refuses a foreign store, and a data file that lacks pages it uses
        (`check_data_file`) unless `checked`: the caller has just checked it,
        or the process this one was forked from did and holds it open (see
        `for_process`).

        With durability "sync" a commit flushes the pages it wrote, then its
        meta page (the one that makes it the newest transaction), each with
        a flush of its own. `meta_sync` False (the workers' handles) leaves
        out the second: a commit is whole on disk before anything refers to
        it, so a machine crash can only undo it, never tear the store, and
        it is durable once anything flushes the file again (any later
        commit, or `sync`): the server does before it answers (see
        Registry.execute), or once for a whole notebook run, when it stores
        the run's results.

        A blob is stored compressed if that saves `store.compress_min_saving`
        of its size; `store.threads` hash, compress and check the chunks of a
        large save or restore; a state's blobs are written
        `store.write_batch_mb` at a time.
        """
        self.path = path
        self.readonly = settings is None
        self.max_store_gb = None if self.readonly else settings["store.max_store_gb"]
        if not self.readonly:
            self.zstd_level = settings["store.zstd_level"]
            self.keep_ratio = 1 - settings["store.compress_min_saving"]
            self.write_batch = settings["store.write_batch_mb"] * 2 ** 20
        self.threads = 1 if self.readonly else settings["store.threads"]
        self._local = threading.local()  # a zstd context is not to be shared by threads
        self._data_fd = None  # data.mdb opened for `prefetch`
        sync = self.readonly or settings["store.durability"] == "sync"
        try:
            if not self.readonly:
                os.makedirs(path, exist_ok=True)
            if not checked:
                check_data_file(path)
            # map_size 0 when read-only: LMDB maps the file as large as it is.
            map_size = 0 if self.readonly else int(self.max_store_gb * 2 ** 30)
            # meta, blobs, states; notebooks (storage/notebooks.py); remote (storage/cache.py)
            # Readahead on: a restore reads a large buffer's chunks, runs of overflow
            # pages, one after the other (without it, page faults read 4 KiB at a time:
            # 17 s for 700 MB not in the page cache, 2 s with it; see `prefetch`).
            self.env = lmdb.open(path, map_size=map_size, max_dbs=5,
                                 sync=sync, metasync=sync and meta_sync,
                                 readonly=self.readonly,
                                 readahead=True, create=not self.readonly, lock=True)
            self.meta = self.env.open_db(b"meta", create=not self.readonly)
            self.blobs = self.env.open_db(b"blobs", create=not self.readonly)
            self.states = self.env.open_db(b"states", create=not self.readonly)
        except lmdb.Error as exc:
            # Not proof of damage (a lock file of another user, a full disk, a map
            # size): nothing here may suggest throwing the states away.
            raise StoreError(
                f"cannot open the store at {path}: {exc}. It is left as it is. Before "
                f"trying anything on it, keep a copy: {_backup_command(path)}; "
                f"scripts/check_store.py --data-dir {shlex.quote(path)} tells whether its "
                f"data file is whole") from None
        self._check_format()

    @classmethod
    def for_process(cls, path, settings, meta_sync=True):
        """The store handle of the calling process, opened on first use (`meta_sync`:
        see __init__; it is the process's for as long as it keeps the handle).

        An LMDB handle must not be used across a fork, and py-lmdb refuses a
        second open of an environment in one process. So a forked process
        first closes the handles it inherited, then opens its own. Closing
        there is safe: LMDB clears only reader slots of the closing pid and
        the child holds no file lock of its parent's. It must come before
        the new open, or it would clear the new handle's reader slots. The
        parent keeps its handle open through the fork (reopening costs a
        cell about 1 ms).

        A process forked from one that holds this store open does not check
        the data file again (a walk of its trees when it is shorter than its
        last page number: milliseconds per process, for every spare): the
        parent checked it when it opened it, LMDB has written every page a
        later transaction uses, and no tool swaps the file while a handle
        is open on it (gc_states.py --compact refuses while a server runs).
        """
        pid = os.getpid()
        key = (pid, path)
        store = cls._per_process.get(key)
        if store is None:
            inherited = [k for k in cls._per_process if k[0] != pid]
            checked = any(k[1] == path for k in inherited)
            for k in inherited:
                cls._per_process.pop(k).close()
            store = cls._per_process[key] = cls(path, settings, checked=checked,
                                                meta_sync=meta_sync)
        return store

    @classmethod
    def release(cls, path):
        """Close the calling process's handle on the store at `path`, if it has one
        (a process that opened a temporary store, e.g. for a fresh run, and is done)."""
        store = cls._per_process.pop((os.getpid(), path), None)
        if store is not None:
            store.close()

    def close(self):
        """Close the LMDB handle (and the file `prefetch` reads ahead in)."""
        self.env.close()
        if self._data_fd is not None:
            os.close(self._data_fd)
            self._data_fd = None

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
        refusal = format_refusal(found, f"the store at {self.path}",
                                 "use a server of that version or point --data-dir at "
                                 "another folder")
        if refusal:
            raise refusal

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

    def _compressor(self):
        """This thread's zstd compressor."""
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._local.compressor = zstandard.ZstdCompressor(
                level=self.zstd_level, write_checksum=True)
        return compressor

    def encode(self, data):
        """A blob record for `data`: compressed when that saves enough space.

        Safe to call from several threads at once.
        """
        data = memoryview(data).cast("B")
        size = data.nbytes
        compress = self._compressor().compress
        pays, flag = True, _ZSTD
        if size >= _SAMPLE_FROM:
            # Whole elements of 8 bytes in each sample, for the shuffled one.
            spots = (0, (size // 2 - _SAMPLE // 2) // 8 * 8, (size - _SAMPLE) // 8 * 8)
            sample = b"".join(data[at:at + _SAMPLE] for at in spots)
            packed = len(compress(sample))
            pays = packed < self.keep_ratio * len(sample)
            if pays and len(compress(shuffle.shuffled(sample))) < packed:
                flag = _ZSTD_SHUFFLED
        if pays:
            packed = compress(shuffle.shuffled(data) if flag == _ZSTD_SHUFFLED else data)
            if len(packed) < self.keep_ratio * size:
                return b"".join((flag, packed))
        return b"".join((_RAW_XXH, xxhash.xxh3_64_digest(data), data))

    def blob(self, key):
        """The verified, uncompressed payload of blob `key`, as a writable bytearray.

        Raises StoreCorrupt when the blob is missing or fails its checksum.
        """
        problem, data = self.read_blob(key)
        if problem:
            kind = BlobMissing if problem == _MISSING else StoreCorrupt
            raise kind(f"blob {key} in the store at {self.path} is {problem}")
        return data

    def read_blob(self, key):
        """(None, verified payload) of blob `key`, or (what is wrong with it, None)."""
        with self.env.begin(db=self.blobs, buffers=True) as txn:
            raw = txn.get(bytes.fromhex(key))
            if raw is None:
                return _MISSING, None
            return _decode(bytes(raw[:1]), raw[1:], key)

    def prefetch(self, keys):
        """Have the kernel read the records of blobs `keys` into the page cache now, in
        the background (one request per record), so that reading them later finds
        them there. A restore calls it a few chunks ahead of the one it reads."""
        if self._data_fd is None:
            data_file = os.path.join(self.path, lmdbfile.DATA_FILE)
            self._data_fd = os.open(data_file, os.O_RDONLY | os.O_CLOEXEC)
            self._map_addr = _mapped_at(data_file)
        if self._map_addr is None:
            return
        with self.env.begin(db=self.blobs, buffers=True) as txn:
            for key in keys:
                raw = txn.get(bytes.fromhex(key))
                at = None if raw is None else pages.buffer_address(raw)
                if at is not None:
                    os.posix_fadvise(self._data_fd, at - self._map_addr, len(raw),
                                     os.POSIX_FADV_WILLNEED)

    def read_into(self, key, target):
        """Verify blob `key` and write its payload into `target` (a writable memoryview
        of exactly its size), without a copy in between where the record allows.

        Raises StoreCorrupt when the blob is missing (BlobMissing), damaged or not
        that size.
        """
        with self.env.begin(db=self.blobs, buffers=True) as txn:
            raw = txn.get(bytes.fromhex(key))
            if raw is None:
                raise BlobMissing(f"blob {key} in the store at {self.path} is {_MISSING}")
            problem = _decode_into(bytes(raw[:1]), raw[1:], key, target)
        if problem:
            raise StoreCorrupt(f"blob {key} in the store at {self.path} is {problem}")

    def put_state(self, name, manifest, records):
        """Write `records` ({key: encoded blob}) then the manifest, atomically."""
        size = sum(len(r) for r in records.values())
        with self._writing(size), self.env.begin(write=True) as txn:
            for key, record in records.items():
                txn.put(bytes.fromhex(key), record, db=self.blobs, overwrite=False)
            txn.put(name.encode(), encode_manifest(manifest), db=self.states)

    def records(self):
        """An empty {key: payload} of a new state's blobs, which `save_groups` fills and
        `write_state` writes: a large state's blobs start being written as they come
        (see StreamedRecords)."""
        return StreamedRecords(self)

    def write_state(self, name, manifest, payloads):
        """Encode and write `payloads` ({key: payload}), then the manifest.

        The blobs are encoded on `threads` threads as they are written, and
        written `write_batch_mb` a transaction, so a large state needs its
        encoded size in memory once (in the file's pages), not three times
        (encoded records, LMDB's dirty pages, the file's pages). The manifest
        comes in the last transaction: a crash leaves the whole state or
        none of it (blobs written before are content-addressed and
        unreferenced, and scripts/gc_states.py removes them).
        """
        if isinstance(payloads, StreamedRecords) and payloads.finish(name, manifest):
            return
        size = sum(memoryview(p).nbytes for p in payloads.values())
        self._write(self._encoded(payloads.items(), size), size, lambda: (name, manifest))

    def _encoded(self, items, size):
        """(key, record) of each (key, payload); a large state's on `threads` threads,
        a batch's worth ahead, so encoding goes on while a batch is flushed."""
        workers = self.threads if size >= 4 * _SAMPLE_FROM else 1
        return threads.ordered(lambda item: (item[0], self.encode(item[1])), items, workers,
                               _ENCODE_AHEAD)

    def _write(self, records, size, last):
        """Write (key, record) pairs, about `write_batch_mb` a transaction, then in the
        last one the manifest of last() -> (name, manifest)."""
        with self._writing(size):
            txn = self.env.begin(write=True)
            ahead = Prefill(self.path)
            ahead.began(self.env)
            try:
                batch = 0
                for key, record in records:
                    ahead.put(txn, bytes.fromhex(key), record, db=self.blobs, overwrite=False)
                    batch += len(record)
                    if batch >= self.write_batch:
                        txn.commit()
                        txn, batch = self.env.begin(write=True), 0
                        ahead.began(self.env)
                name, manifest = last()
                ahead.put(txn, name.encode(), encode_manifest(manifest), db=self.states)
                txn.commit()
            except BaseException:
                txn.abort()
                raise
            finally:
                ahead.close()

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
        meta = lmdbfile.read_meta(self.path)  # checked when the store was opened
        with self.env.begin() as txn:
            pages = sum(stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
                        for stat in (txn.stat(db) for db in (self.meta, self.blobs, self.states)))
        pages += 2 + meta.free_db_pages + meta.main_db_pages  # the two meta pages
        file_pages = meta.last_page + 1
        return {"used": file_pages * meta.page_size,
                "free": max(file_pages - pages, 0) * meta.page_size,
                "room": max(self.env.info()["map_size"] - file_pages * meta.page_size, 0)}

    def sync(self):
        """Flush to disk every transaction committed so far, by any process (with
        durability "async"; and the commits of handles opened with meta_sync False)."""
        self.env.sync(True)


def _mapped_at(path):
    """Where this process maps file `path` from its start (LMDB maps its data file
    whole), or None. py-lmdb reports 0 as the map's address (Environment.info)."""
    path = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == path \
                        and int(fields[2], 16) == 0:
                    return int(fields[0].split("-")[0], 16)
    except (OSError, ValueError):
        pass
    return None


def _decode(flag, body, key):
    """(problem or None, payload as a bytearray) of a blob record's flag and body."""
    if flag == _RAW_XXH:
        data = bytearray(body[_XXH_BYTES:])
        if xxhash.xxh3_64_digest(data) != bytes(body[:_XXH_BYTES]):
            return "corrupt: its bytes do not match their XXH3 checksum", None
        return None, data
    if flag in (_ZSTD, _ZSTD_SHUFFLED):
        try:
            checked = zstandard.get_frame_parameters(body).has_checksum
            data = bytearray(zstandard.ZstdDecompressor().decompress(
                body, max_output_size=2 ** 40))
        except zstandard.ZstdError as exc:
            return f"corrupt: zstd cannot decompress it ({exc})", None
        if flag == _ZSTD_SHUFFLED:
            shuffled, data = data, bytearray(len(data))
            shuffle.unshuffle_into(shuffled, data)
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


def _decode_into(flag, body, key, target):
    """Write the verified payload of a record's flag and body into `target`; the
    problem with it, or None."""
    size = target.nbytes
    if flag == _RAW_XXH:
        data = body[_XXH_BYTES:]
        if len(data) != size:
            return f"corrupt: {len(data)} bytes where {size} were expected"
        # Copied first, checked in place: the bytes are read from memory once, and
        # then from the CPU's cache (the caller takes their digest from there too).
        pages.copy_into(target, data)
        if xxhash.xxh3_64_digest(target) != bytes(body[:_XXH_BYTES]):
            return "corrupt: its bytes do not match their XXH3 checksum"
        return None
    if flag in (_ZSTD, _ZSTD_SHUFFLED):
        try:
            params = zstandard.get_frame_parameters(body)
            if params.has_checksum and params.content_size == size:
                if flag == _ZSTD:
                    return _unzstd_into(body, target)
                scratch = _scratch(size)  # shuffled, then unshuffled into place
                problem = _unzstd_into(body, scratch)
                if problem is None:
                    shuffle.unshuffle_into(scratch, target)
                return problem
        except zstandard.ZstdError as exc:
            return f"corrupt: zstd cannot decompress it ({exc})"
    problem, data = _decode(flag, body, key)
    if problem is None:
        if len(data) != size:
            return f"corrupt: {len(data)} bytes where {size} were expected"
        target[:] = data
    return problem


def _unzstd_into(body, target):
    """Decompress the zstd frame `body` (with a checksum and the size of `target`)
    straight into `target`; the problem with it, or None.

    The stream reader checks the frame's checksum once it has read the frame's
    end, which the read past it makes sure of.
    """
    size = target.nbytes
    with zstandard.ZstdDecompressor().stream_reader(body) as reader:
        done = 0
        while done < size:
            got = reader.readinto(target[done:])
            if not got:
                break
            done += got
        if done != size or reader.read(1):
            return "corrupt: zstd gave another size than its frame says"
    return None


_scratches = threading.local()


def _scratch(size):
    """A buffer of `size` bytes of this thread's, used again for the next record (new
    memory for each 1 MiB chunk would cost its page faults every time)."""
    buffer = getattr(_scratches, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = _scratches.buffer = bytearray(size)
    return memoryview(buffer)[:size]


def format_refusal(found, what, advice):
    """None if this server reads format `found` (the bytes of a format record) of
    `what`; else the error to raise, saying what to do (`advice`)."""
    if found in _READABLE_FORMATS:
        return None
    said = found.decode(errors="replace")
    message = (f"{what} has format {said}, this server reads formats "
               f"{b', '.join(_READABLE_FORMATS).decode()}; {advice}")
    newer = said.isdigit() and int(said) > FORMAT_VERSION
    return NewerFormat(message) if newer else StoreError(message)


def known_record(record):
    """Whether blob record `record` is of a type this server reads (one it does not is
    damaged, or written by a newer server: see format_refusal)."""
    return bytes(record[:1]) in _RECORD_TYPES


def decode_record(record, key):
    """(problem or None, verified payload) of blob record `record` (a remote keeps the
    same records as LMDB)."""
    record = bytes(record)
    return _decode(record[:1], record[1:], key)


class StreamedRecords(dict):
    """The payloads of a new state's blobs, {key: payload}, written while they are made.

    Once they add up to `_STREAM_FROM` bytes, a thread of its own encodes and
    writes them (Store._write) as the save goes on hashing the next chunks,
    so the save costs about the longer of the two, not their sum; the
    manifest follows in the last transaction (`finish`). A small state
    (a trivial cell) starts no thread and is written by `write_state`.
    """

    def __init__(self, store):
        """Collect blobs for `store`."""
        super().__init__()
        self.store = store
        self.size = 0
        self.queue = None
        self.thread = None
        self.last = None
        self.error = None

    def __setitem__(self, key, payload):
        """Add a blob; from `_STREAM_FROM` bytes on, hand it to the writing thread."""
        super().__setitem__(key, payload)
        self.size += memoryview(payload).nbytes
        if self.queue is not None:
            self.queue.put((key, payload))
        elif self.size >= _STREAM_FROM:
            self.queue = queue.SimpleQueue()
            for item in self.items():
                self.queue.put(item)
            self.thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
            self.thread.start()

    def _run(self):
        """The writing thread: what comes in, until `finish` says which manifest follows."""
        def arriving():
            while True:
                item = self.queue.get()
                if item is None:
                    return
                yield item
        try:
            self.store._write(self.store._encoded(arriving(), self.size), self.size,
                              lambda: self.last)
        except BaseException as exc:  # raised again by `finish`, in the saving thread
            self.error = exc

    def finish(self, name, manifest):
        """Write the manifest after the blobs and wait for it; False if no thread started
        (the caller writes everything)."""
        if self.thread is None:
            return False
        self.last = (name, manifest)
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return True


def _free_bytes(path):
    """Bytes an unprivileged writer may still use on the file system of `path`."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_data_file(path):
    """Refuse (StoreError) a data file that lacks pages its trees use, or whose trees
    lead to pages that are not theirs, before LMDB maps it (storage/lmdbfile.py)."""
    try:
        lmdbfile.current_meta(path)
    except lmdbfile.DataFileError as exc:
        if isinstance(exc, lmdbfile.Truncated):
            why = ("LMDB maps the file: reading a page past its end would kill this process "
                   "(SIGBUS)")
        else:
            why = "LMDB would follow whatever that page holds, which can crash this process"
        raise StoreError(
            f"the store at {path} is damaged: {exc}. {why}, so it is not opened; it is "
            f"left as it is. Before trying anything on it, keep a copy: "
            f"{_backup_command(path)}. Then restore {lmdbfile.DATA_FILE} from a backup if "
            f"you have one; scripts/check_store.py --data-dir {shlex.quote(path)} lists "
            f"every page it found missing or wrong") from None
    except OSError as exc:
        raise StoreError(f"cannot read the store at {path}: {exc}") from None


def _backup_command(path):
    """The shell command that copies the store folder `path` aside, as it is."""
    path = os.path.normpath(path)
    return f"cp -a {shlex.quote(path)} {shlex.quote(path + '.bak')}"


def referenced_blobs(manifest):
    """The blob keys a manifest names itself (chunk lists not expanded: `Store.referenced`)."""
    keys = set()
    for group in manifest.get("groups", []):
        keys.add(group["key"])
        keys.update(group["buffers"])
    keys.update((manifest.get("context") or {}).values())
    if manifest.get("execution"):  # the answer of the cell that made the state
        keys.add(manifest["execution"]["answer"])
    return keys


# Server lock ---------------------------------------------------------------

SERVER_LOCK = "server.lock"


class StoreHeld(StoreError):
    """Another process (a server, a notebook run, gc_states.py) holds the store."""


def claim_store(data_dir, holder):
    """Take the exclusive lock of the store at `data_dir` without waiting, saying in
    it who holds it (`holder`, shown to whoever is refused next).

    One process writes a store at a time: a server, `main.py run`, or an
    operator tool. Returns the open lock file, which keeps the lock until it
    is closed; StoreHeld naming the holder when another process has it;
    StoreError when the folder cannot be used.
    """
    try:
        os.makedirs(data_dir, exist_ok=True)
        lock = open(os.path.join(data_dir, SERVER_LOCK), "a+")
    except OSError as exc:
        raise StoreError(f"cannot use the store at {data_dir}: {exc}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise StoreHeld(f"{store_holder(data_dir) or 'another process'} is using the store "
                        f"at {data_dir}") from None
    note_holder(lock, holder)
    return lock


def note_holder(lock, holder):
    """Say in the held lock file who holds it."""
    lock.seek(0)
    lock.truncate()
    lock.write(holder)
    lock.flush()


def store_holder(data_dir):
    """Who holds the store's lock, as its holder wrote it ("" if it did not)."""
    try:
        with open(os.path.join(data_dir, SERVER_LOCK)) as f:
            return f.read().strip()
    except OSError:
        return ""
