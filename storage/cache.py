"""LMDB as this server's cache of a shared remote store: read through, written through.

With `store.remote` set, every process of a server opens a `CachedStore`
instead of a plain `Store`: the same LMDB environment and interface, plus

- read through: a blob the cache lacks is fetched from the remote, checked
  against its key (SHA-256 of the payload) and kept; the chunks of a
  large buffer are fetched a window at a time, in parallel, as the restore
  reads them, so a restore still loads the groups a cell needs first;
- write through (`durability = "sync"`): before the state is written
  locally, its blobs go to the remote (`If-None-Match: *`), then its name
  record (compare-and-swap on the ETag). An unreachable remote or a lost
  race raises before anything is written here. With "async" the state is
  written locally only, and the server's RemoteNames (storage/remote_names.py)
  uploads it later;
- a bounded cache: past `cache_gb`, the blobs the remote has are evicted,
  oldest arrival first. Blobs the remote does not have yet never are.

Blobs are reused across states and servers, so a blob this server
believes the remote has may have been garbage-collected since:
scripts/gc_states.py --remote deletes a blob once it has been unreferenced
for `remote_grace_hours` and the remote last wrote it longer ago than
that. So a state is published only with blobs that are safe for half that
period: those its parent names while the parent was bound on the remote
that recently, those written or verified fresh that recently; any other
is looked at (HEAD) and, if old, freshened (copied onto itself, which
renews its LastModified) or sent again.

Bookkeeping lives in the LMDB database `remote`, beside `blobs` and `states`:

    b"k" + key        -> when the remote's copy was last known fresh (8-byte float)
    b"c" + ns + key   -> b"": blobs cached here and on the remote, by arrival (ns)
    b"e" + name       -> when this server last wrote or read the name's record (8-byte
                         float), then the record's ETag
    b"L"              -> when the last complete look at the remote's names began
    b"q" + name       -> id of the state to publish under the name ("async"), or b""
                         to delete the name on the remote
    b"f" + key        -> pid and time of the process fetching the blob now (a claim)
"""

import concurrent.futures
import functools
import hashlib
import os
import struct
import threading
import time

from snapkernel.storage.prefill import Prefill
from snapkernel.storage.remote import RemoteStore
from snapkernel.storage.store import (BlobMissing, Store, StoreCorrupt, decode_record, encode_manifest,
                           known_record)

# The empty starting state: every server makes its own, so it is never shared.
UNSHARED = frozenset({"initial"})
# Chunks remembered for reading ahead (about 64 GiB of 1 MiB chunks) before starting over.
_READ_AHEAD_KEYS = 2 ** 16


def open_store(settings, meta_sync=True):
    """This process's store: LMDB alone, or LMDB caching the remote of `store.remote`
    (`meta_sync`: see Store)."""
    kind = CachedStore if settings["store.remote"] else Store
    return kind.for_process(settings["server.data_dir"], settings, meta_sync)


def _time(value):
    """A bookkeeping time as stored (8 bytes)."""
    return struct.pack(">d", value)


class CachedStore(Store):
    """An LMDB store that reads and writes through to a remote store."""

    def __init__(self, path, settings, checked=False, meta_sync=True):
        """Open the LMDB cache at `path` for the remote of `settings` (`checked`,
        `meta_sync`: as Store)."""
        super().__init__(path, settings, checked, meta_sync)
        self.remote = RemoteStore(settings["store.remote"], settings["store.remote_endpoint"],
                                  settings)
        self.book = self.env.open_db(b"remote", create=not self.readonly)
        self.publish_now = settings["store.durability"] == "sync"
        self.cache_bytes = int(settings["store.cache_gb"] * 2 ** 30)
        self.trust_s = settings["store.remote_grace_hours"] * 3600 / 2
        self.parallel = settings["store.remote_parallel"]
        self.head_min_bytes = settings["store.remote_head_min_bytes"]
        # A claim to fetch a blob lapses after the longest one request may take.
        self.claim_s = settings["store.remote_timeout_s"] * settings["store.remote_attempts"]
        self._pending = {}  # records of the state being published, not yet in LMDB
        self._chunk_of = {}  # chunk key -> (its chunk list, its place), for reading ahead
        self._fetching = threading.Lock()  # read_into's fetches, one thread at a time

    # Read through --------------------------------------------------------

    def blob(self, key):
        """The payload of blob `key`: from the cache, else from the remote (then cached).

        A missing chunk of a buffer whose chunk list was read is fetched
        with the chunks after it (2 x remote_parallel at a time, in
        parallel): a restore reads a buffer's chunks in order.
        """
        if key in self._pending:
            return _verified(self._pending[key], key)
        return self._read_through(key, super().blob,
                                  lambda record: _verified(record, key, self.remote))

    def read_into(self, key, target):
        """Blob `key` into `target` (see Store.read_into): from the cache, else fetched
        from the remote first, with the chunks after it (see blob)."""
        if key in self._pending:
            target[:] = self.blob(key)
            return

        def use(record):
            target[:] = _verified(record, key, self.remote)
        self._read_through(key, functools.partial(super().read_into, target=target), use)

    def _read_through(self, key, read, use):
        """read(key) from the cache; if the cache lacks the blob, use(its record) as
        fetched from the remote.

        The record fetched is used as it is, not read back from the cache:
        another process of this server may evict it from a small cache in
        between. A restore reads on several threads; one of them fetches at a
        time, and the others mostly find their chunks fetched in its window.
        """
        for _ in range(3):  # cached by another process, and evicted before it was read
            try:
                return read(key)
            except BlobMissing:
                pass
            listing, at = self._chunk_of.get(key, ([key], 0))
            with self._fetching:
                record = self.fetch(listing[at:at + 2 * self.parallel]).get(key)
            if record is not None:
                return use(record)
        return use(self._download(key)[1])

    def chunk_list(self, key):
        """The chunk keys of a chunk list, remembered for reading ahead (see blob)."""
        keys = super().chunk_list(key)
        if len(self._chunk_of) > _READ_AHEAD_KEYS:
            self._chunk_of.clear()
        self._chunk_of.update((k, (keys, i)) for i, k in enumerate(keys))
        return keys

    def fetch(self, keys):
        """Download into the cache the blobs among `keys` it lacks, each checked.

        Refuses (StoreCorrupt) a blob the remote lacks or whose content does
        not hash to its key. Several processes of the server may restore
        one state at once (a holder loading in the background, the child
        whose cell needs the same value): each claims the blobs it fetches,
        a window at a time, and waits for the blobs another live process
        claimed instead of downloading them again.

        Returns {key: record} of the blobs this process downloaded.
        """
        todo = [k for k in dict.fromkeys(keys) if k not in self._pending]
        window = 2 * self.parallel
        downloaded = {}
        for start in range(0, len(todo), window):
            mine, theirs = self._claim(todo[start:start + window])
            downloaded.update(self._fetch_claimed(mine))
            downloaded.update(self._await(theirs))
        self._evict()
        return downloaded

    def _fetch_claimed(self, keys):
        """Download and cache blobs this process claimed, {key: record}; the claims go
        either way."""
        fetched = []
        try:
            fetched.extend(self.each(self._download, keys))
        finally:
            self._cache(fetched, keys)
        return {key: record for key, record, _ in fetched}

    def _claim(self, keys):
        """(keys this process now fetches, keys another live process is fetching)."""
        mine, theirs = [], []
        now = time.time()
        with self._writing(), self.env.begin(write=True) as txn:
            for key in keys:
                raw = bytes.fromhex(key)
                if txn.get(raw, db=self.blobs) is not None:
                    continue
                claim = txn.get(b"f" + raw, db=self.book)
                if claim is not None:
                    pid, since = struct.unpack(">Id", claim)
                    if now - since < self.claim_s and _alive(pid):
                        theirs.append(key)
                        continue
                txn.put(b"f" + raw, struct.pack(">Id", os.getpid(), now), db=self.book)
                mine.append(key)
        return mine, theirs

    def _await(self, keys):
        """Wait for blobs other processes claimed; fetch those whose claim lapsed
        ({key: record} of those)."""
        downloaded = {}
        while keys:
            time.sleep(0.01)
            missing = self.missing(keys)
            if missing:
                mine, missing = self._claim(missing)
                downloaded.update(self._fetch_claimed(mine))
            keys = missing
        return downloaded

    def _download(self, key):
        """(key, record, LastModified) of a blob from the remote, verified."""
        got = self.remote.get_blob(key)
        if got is None:
            raise StoreCorrupt(f"blob {key} is neither in the cache at {self.path} nor on "
                               f"{self.remote.url}; run scripts/check_store.py --remote")
        record, modified = got
        # Its checksum catches damage on the way; its key, a wrong blob under the key.
        if hashlib.sha256(_verified(record, key, self.remote)).hexdigest() != key:
            raise StoreCorrupt(f"blob {key} from {self.remote.url} does not hash to its key; "
                               f"refused. Run scripts/check_store.py --remote")
        return key, record, modified

    def _cache(self, fetched, claimed):
        """Write fetched blobs (on the remote since their LastModified); drop the claims."""
        if not claimed:
            return
        size = sum(len(record) for _, record, _ in fetched)
        ahead = Prefill(self.path)
        try:
            with self._writing(size), self.env.begin(write=True) as txn:
                ahead.began(self.env)
                for key, record, modified in fetched:
                    raw = bytes.fromhex(key)
                    ahead.put(txn, raw, record, db=self.blobs)
                    ahead.put(txn, b"k" + raw, _time(modified), db=self.book)
                    ahead.put(txn, b"c" + struct.pack(">Q", time.time_ns()) + raw, b"",
                              db=self.book)
                for key in claimed:
                    txn.delete(b"f" + bytes.fromhex(key), db=self.book)
        finally:
            ahead.close()

    def each(self, work, items):
        """work(item) for every item, `remote_parallel` at a time; results in order.

        The threads are gone when this returns or raises (a worker process
        forks right after, and a fork must not copy threads mid-request).
        """
        items = list(items)
        if len(items) <= 1:
            yield from map(work, items)
            return
        pool = concurrent.futures.ThreadPoolExecutor(min(self.parallel, len(items)))
        try:
            yield from pool.map(work, items)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    # Write through -------------------------------------------------------

    def put_state(self, name, manifest, records):
        """Write a new state; with durability "sync", on the remote first."""
        if not self.publish_now or name in UNSHARED:
            super().put_state(name, manifest, records)
        else:
            self._pending = records
            try:
                etag, fresh = self.publish(name, manifest)
            finally:
                self._pending = {}
            super().put_state(name, manifest, records)
            self.note(name, etag, fresh)
        self._evict()

    def records(self):
        """A plain {key: payload}: blobs go to the remote before any is written here."""
        return {}

    def write_state(self, name, manifest, payloads):
        """Write a new state from its blobs' payloads; with durability "sync", on the
        remote first (its records encoded once, for both)."""
        if not self.publish_now or name in UNSHARED:
            super().write_state(name, manifest, payloads)
            self._evict()
        else:
            self.put_state(name, manifest, {k: self.encode(p) for k, p in payloads.items()})

    def publish(self, name, manifest):
        """Put the blobs `manifest` needs on the remote, then its name record.

        Returns (new ETag, {blob key: time known fresh}). Raises
        RemoteUnavailable or NameConflict with nothing of the name changed.
        Blobs are taken as safe on the remote, with no request, when known
        fresh there, or when the parent state names them and was bound on
        the remote less than half the grace period ago (gc deletes only
        blobs unreferenced for the whole grace period).
        """
        keys = self.referenced(manifest) - self._bound_parent_blobs(manifest)
        stale = time.time() - self.trust_s
        with self.env.begin(db=self.book) as txn:
            todo = [k for k in keys if _since(txn.get(b"k" + bytes.fromhex(k))) < stale]
        fresh = dict(self.each(self._upload, todo))
        return self.remote.put_name(name, manifest, self.etag(name)), fresh

    def _bound_parent_blobs(self, manifest):
        """The blobs of the manifest's parent if its record was on the remote recently."""
        parent = manifest.get("parent")
        cached = parent and self.manifest(parent)
        if not cached or cached["id"] != manifest.get("parent_id"):
            return set()
        with self.env.begin(db=self.book) as txn:
            seen = txn.get(b"e" + parent.encode())
            looked = _since(txn.get(b"L"))
            queued = txn.get(b"q" + parent.encode()) is not None  # not on the remote yet
        if queued or seen is None or max(looked, _since(seen[:8])) < time.time() - self.trust_s:
            return set()
        return self.referenced(cached)

    def _upload(self, key):
        """(key, time it is fresh from): make sure the remote has a fresh copy of a blob."""
        now = time.time()
        record = self._record(key)
        if record is None or len(record) >= self.head_min_bytes:
            # Look first: a large blob another server stored is not sent again.
            modified = self.remote.head_blob(key)
            if modified is not None and modified >= now - self.trust_s:
                return key, modified
            if modified is not None and self.remote.freshen(key):
                return key, now
        if record is None:
            raise StoreCorrupt(f"blob {key} is neither in the cache at {self.path} nor on "
                               f"{self.remote.url} (garbage-collected while this server "
                               f"held a state using it); run the cells that made it again")
        if not self.remote.put_blob(key, record) and not self.remote.freshen(key):
            self.remote.put_blob(key, record)  # deleted between the two calls
        return key, now

    def _record(self, key):
        """The stored record of blob `key` (pending or cached), or None."""
        if key in self._pending:
            return self._pending[key]
        with self.env.begin(db=self.blobs) as txn:
            return txn.get(bytes.fromhex(key))

    def note(self, name, etag, fresh):
        """Remember a name's new ETag and the blobs now fresh on the remote."""
        with self._writing(), self.env.begin(db=self.book, write=True) as txn:
            for key, since in fresh.items():
                raw = bytes.fromhex(key)
                if txn.get(b"k" + raw) is None:
                    txn.put(b"c" + struct.pack(">Q", time.time_ns()) + raw, b"")
                txn.put(b"k" + raw, _time(since))
            txn.put(b"e" + name.encode(), _time(time.time()) + etag.encode())

    def etag(self, name):
        """The ETag of `name`'s record as last seen here, or None."""
        with self.env.begin(db=self.book) as txn:
            raw = txn.get(b"e" + name.encode())
        return None if raw is None else raw[8:].decode()

    # Names and the publishing queue (the server process) ----------------

    def etags(self):
        """{name: ETag} of every name this server knows the remote has."""
        return {k[1:].decode(): v[8:].decode() for k, v in self._prefixed(b"e")}

    def looked(self, at):
        """Every ETag known here was the remote's at time `at` (a complete look)."""
        with self._writing(), self.env.begin(db=self.book, write=True) as txn:
            txn.put(b"L", _time(at))

    def take(self, name, manifest, etag):
        """Cache the remote's record of `name`: its manifest and ETag."""
        with self._writing(), self.env.begin(write=True) as txn:
            txn.put(name.encode(), encode_manifest(manifest), db=self.states)
            txn.put(b"e" + name.encode(), _time(time.time()) + etag.encode(), db=self.book)

    def drop(self, name):
        """Forget a name the remote no longer has: its cached manifest and ETag."""
        with self._writing(), self.env.begin(write=True) as txn:
            txn.delete(name.encode(), db=self.states)
            txn.delete(b"e" + name.encode(), db=self.book)

    def forget_etag(self, name):
        """Forget the ETag of `name` (the remote has no record of it now)."""
        with self._writing(), self.env.begin(db=self.book, write=True) as txn:
            txn.delete(b"e" + name.encode())

    def queue(self, name, state_id):
        """Publish state `state_id` under `name` later ("" = delete the name remotely)."""
        with self._writing(), self.env.begin(db=self.book, write=True) as txn:
            txn.put(b"q" + name.encode(), state_id.encode())

    def unqueue(self, name, state_id):
        """Drop the queue entry of `name` if it still asks for `state_id`."""
        with self._writing(), self.env.begin(db=self.book, write=True) as txn:
            if txn.get(b"q" + name.encode()) == state_id.encode():
                txn.delete(b"q" + name.encode())

    def queued(self):
        """{name: state id, or "" for a deletion} still to be done on the remote."""
        return {k[1:].decode(): v.decode() for k, v in self._prefixed(b"q")}

    def _prefixed(self, prefix):
        """[(key, value)] of the bookkeeping entries whose key starts with `prefix`."""
        with self.env.begin(db=self.book) as txn:
            cursor = txn.cursor()
            found = cursor.set_range(prefix)
            items = []
            while found and cursor.key()[:1] == prefix:
                items.append((cursor.key(), cursor.value()))
                found = cursor.next()
            return items

    # Cache bound ---------------------------------------------------------

    def cached_bytes(self):
        """Bytes the blobs take in the LMDB file."""
        with self.env.begin() as txn:
            stat = txn.stat(self.blobs)
        return (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * \
            stat["psize"]

    def _evict(self):
        """Past cache_gb, drop the oldest cached blobs the remote has (to 90 % of it)."""
        excess = self.cached_bytes() - self.cache_bytes
        if excess <= 0:
            return
        excess += self.cache_bytes // 10  # so that not every write evicts
        with self._writing(), self.env.begin(write=True) as txn:
            cursor = txn.cursor(db=self.book)
            found = cursor.set_range(b"c")
            while found and excess > 0 and cursor.key()[:1] == b"c":
                raw = cursor.key()[9:]
                record = txn.get(raw, db=self.blobs)
                if record is not None:
                    excess -= len(record)
                    txn.delete(raw, db=self.blobs)
                found = cursor.delete()


def _since(raw):
    """A stored bookkeeping time, or 0 when there is none."""
    return 0.0 if raw is None else struct.unpack(">d", raw)[0]


def _alive(pid):
    """True if process `pid` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _verified(record, key, remote=None):
    """The payload of blob record `record` (from `remote`, else from the state being
    saved); StoreCorrupt if it fails its checksum. A record of a type this server
    does not know is damage unless a newer server has written on the remote since
    this one checked its format: then NewerFormat (storage/remote.py)."""
    problem, payload = decode_record(record, key)
    if problem:
        if remote is not None and not known_record(record):
            remote.check_format()
        where = "the state being saved" if remote is None else remote.url
        raise StoreCorrupt(f"blob {key} from {where} is {problem}; refused. Run "
                           f"scripts/check_store.py --remote")
    return payload
